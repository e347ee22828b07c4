"""Pipelined layer stack: the layers' weights stacked on a ``stage`` dim, activations shifted between stages.

The named-dimension formulation of pipeline parallelism (GSPMD, Xu et al. 2021, section 3.3; praxis'
``LayerwiseShardablePipelined`` / ``CircularLayerwiseShardablePipelined``; MaxText's ``Pipeline``): the
weights of layer ``r * S + s`` are row ``[s, r]`` of variables ``[stage, repeat, ...]``, the activations
live in a state buffer ``[stage, microbatch dims...]``, and ONE call of the layer code per iteration
computes every stage at once, ``stage`` being a batch dim of each einsum. Splitting ``stage`` over a mesh
axis (layout rule ``stage:pipe``) makes each processor compute only its own stage, and the shift of the
buffer by one stage between iterations becomes a neighbour exchange over that axis (the ``collective_permute``
collective). The loop is unrolled (``M * R + S - 1`` iterations, :class:`~meshtorch.core.pipeline.PipelineSchedule`),
so autodiff gives the GPipe backward pass (the gradient of ``shift(+1)`` is ``shift(-1)``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence

import torch

from meshtorch.autodiff import recompute_grad
from meshtorch.core.dims import Dimension, Shape, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.core.pipeline import PipelineSchedule, StackedNames
from meshtorch.core.scopes import scoped_variable_name, variable_scope
from meshtorch.ops.einsum import einsum
from meshtorch.ops.initializers import Initializer, convert_initializer
from meshtorch.ops.reduce import reduce_sum
from meshtorch.ops.sequence import shift
from meshtorch.ops.shape import broadcast, stack, unstack, where
from meshtorch.ops.variables import constant, import_tensor

__all__ = ["pipeline", "StackedVariables", "StackedInitializer"]


def _k_stacked_slice(begin, sizes, device=None, *, rows, lead) -> torch.Tensor:
    """A slice of a stacked initial value: each leading index's block drawn by its row kernel (row-major)."""
    n = len(lead)
    blocks = []
    for idx in itertools.product(*(range(b, b + k) for b, k in zip(begin[:n], sizes[:n], strict=True))):
        flat = 0
        for i, size in zip(idx, lead, strict=True):
            flat = flat * size + i
        blocks.append(rows[flat](tuple(begin[n:]), tuple(sizes[n:]), device))
    return torch.stack(blocks).reshape(tuple(int(s) for s in sizes))


class StackedInitializer(Initializer):
    """Initial values of a stacked variable ``[lead dims..., shape...]``: the block at leading index ``i``
    (row-major) is what ``inner`` draws for a variable named ``keys[i]`` of shape ``shape``, so a pipelined
    layer stack starts from exactly the weights of the unstacked layers (counter-based draws keyed by name)."""

    def __init__(self, inner, lead: tuple[int, ...], keys: tuple[str, ...]):
        if len(keys) != math.prod(lead):
            raise ValueError(f"StackedInitializer: {len(keys)} keys for {math.prod(lead)} stacked rows.")
        self.inner, self.lead, self.keys = convert_initializer(inner), tuple(lead), tuple(keys)

    def slice_fn(self, shape, dtype, seed, key, out_dtype=None):
        inner_shape = Shape(shape.dims[len(self.lead):])
        rows = tuple(self.inner.slice_fn(inner_shape, dtype, seed, k, out_dtype) for k in self.keys)
        return functools.partial(_k_stacked_slice, rows=rows, lead=self.lead)

    def __repr__(self):
        return f"StackedInitializer({self.inner!r}, {self.lead}, {self.keys[0]!r}...)"


class StackedVariables:
    """The custom getter (see :func:`meshtorch.variable_scope`) that stacks a layer's weights.

    A ``get_variable(mesh, "{prefix}/{kind}", shape)`` made by the layer code of one iteration becomes the
    variable ``{variable_prefix}/{kind}`` (full names, enclosing variable scopes included) of shape
    ``[stage, (repeat,) shape...]``, created at the first request with the layer's dtype and initializer (with
    ``layer_names``, row ``[s, r]`` draws the values of the variable ``{layer_names(r * S + s)}/{kind}``) and
    shared by every iteration. The layer code gets ``[stage, shape...]``: the variable itself when
    ``repeats == 1``, else each stage's row of the repeat it runs in this iteration (an einsum with a
    ``[stage, repeat]`` one-hot constant: local when ``stage`` is split). Initializers see the stacked shape:
    fans must come from explicit dims (VarianceScaling with ``reduced_dims``/``new_dims``, constants), as every
    meshtorch layer's are.
    """

    def __init__(self, stage: Dimension, repeat: Dimension | None, variable_prefix: str,
                 layer_names: Callable[[int], str] | None = None):
        self.stage, self.repeat, self.variable_prefix = stage, repeat, variable_prefix
        self.layer_names = layer_names
        self.variables: dict[str, Tensor] = {}  # kind -> stacked variable value
        self.frozen = False

    def getter(self, prefix: str, select: Tensor | None):
        """The custom getter for one iteration: the layer code names its variables ``{prefix}/{kind}``."""

        def custom(getter, mesh, full_name, shape, **kwargs):
            if not full_name.startswith(prefix + "/"):
                raise ValueError(f"pipeline: stage_fn made variable {full_name!r} outside its name {prefix!r}; "
                                 "name every variable under the name stage_fn receives.")
            kind = full_name[len(prefix) + 1:]
            shape = convert_to_shape(shape)
            if kind not in self.variables:
                if self.frozen:
                    raise ValueError(f"pipeline: stage_fn asked for variable {kind!r} after its first call; it must "
                                     "make the same variables at every call (names under the name it receives).")
                lead = [self.stage] + ([self.repeat] if self.repeat is not None else [])
                for d in lead:
                    if d.name in shape:
                        raise ShapeError(f"pipeline: variable {kind!r} {shape} already has dimension {d.name!r}.")
                if self.layer_names is not None:  # row [s, r] starts as layer r * S + s would
                    S, R = self.stage.size, (self.repeat.size if self.repeat is not None else 1)
                    keys = tuple(f"{self.layer_names(StackedNames.index(s, r, S))}/{kind}" for s in range(S)
                                 for r in range(R))
                    kwargs["initializer"] = StackedInitializer(kwargs.get("initializer"), tuple(d.size for d in lead),
                                                               keys)
                self.variables[kind] = getter(mesh, f"{self.variable_prefix}/{kind}", Shape(lead + shape.dims),
                                              **kwargs)
            w = self.variables[kind]
            if select is None:
                return w
            return einsum([w, select], output_shape=Shape([self.stage] + shape.dims), name=f"{prefix}/{kind}/select")

        return custom


def _sides(side_inputs, schedule: PipelineSchedule, t: int, stage: Dimension, microbatch_dim: str,
           prefix: str) -> list[Tensor]:
    """Each side input's slice ``[stage, other dims...]`` of the microbatch each stage works on at iteration ``t``
    (zeros in a bubble): an einsum with the ``[stage, microbatch]`` one-hot of the schedule."""
    out = []
    for i, side in enumerate(side_inputs):
        mb = side.shape.get_dim_by_name(microbatch_dim)
        onehot = torch.zeros(stage.size, mb.size, dtype=side.dtype)
        for s in range(stage.size):
            w = schedule.work(t, s)
            if w is not None:
                onehot[s, w[0]] = 1
        pick = import_tensor(side.mesh, onehot, [stage, mb], name=f"{prefix}/side_{i}_onehot")
        out.append(einsum([side, pick], output_shape=Shape([stage] + (side.shape - [microbatch_dim]).dims),
                          name=f"{prefix}/side_{i}"))
    return out


def _mask(mesh, stage: Dimension, values, name) -> Tensor:
    return import_tensor(mesh, torch.tensor(values, dtype=torch.bool), [stage], name=name)


def pipeline(stage_fn: Callable[[Tensor, str], Tensor], x: Tensor, schedule: PipelineSchedule,
             microbatch_dim: str = "microbatches", stage_dim: str = "stage", repeat_dim: str = "repeat",
             variable_prefix: str = "stack", name: str = "pipeline", remat: bool = True,
             remat_keep: Callable | None = None, bubble_fill: float = 0.0,
             layer_names: Callable[[int], str] | None = None, side_inputs: Sequence[Tensor] = ()) -> Tensor:
    """Run ``S * R`` layers over ``M`` microbatches as an ``S``-stage pipeline (GPipe; circular when ``R > 1``).

    Layer ``r * S + s`` (stage ``s``, repeat ``r``) is ``stage_fn`` with the weights ``[s, r]`` of the stacked
    variables (see :class:`StackedVariables`). At iteration ``t`` the state buffer ``[stage, microbatch's dims...]``
    is shifted one stage forward (wrapping around), stage 0 takes microbatch ``t`` (``t < M``) or, for ``R > 1``,
    the last stage's output of that microbatch's previous repeat (kept ``M - S`` iterations); bubble slots
    (:meth:`PipelineSchedule.work` is None) are replaced by zeros with a true select *before* ``stage_fn``, so
    nothing a bubble holds reaches a value or a gradient; then ``stage_fn`` runs once on the whole buffer.

    Communication with ``stage`` split over a mesh axis: one neighbour exchange of the state slice per iteration
    after the first, forward and backward; the microbatches enter as ``x`` broadcast over ``stage`` (no
    communication; its gradient is one all-reduce over the stage axis) and the last stage's final outputs leave
    as one masked sum over ``stage`` of all of them (one all-reduce), not one collective per microbatch.

    Args:
        stage_fn: ``stage_fn(h, name, *sides) -> y``: one layer on ``h`` ``[stage, microbatch's dims...]``,
            returning the same shape and dtype, making its variables (``get_variable``) under names ``{name}/...`` only
            (e.g. ``layers.dense(..., name=f"{name}/ffn")``), the same at every call.
        x: the microbatches, ``[..., microbatch_dim, ...]`` with ``microbatch_dim`` of size M (an LM:
            ``[batch, microbatches, length, d_model]``).
        schedule: S, M, R.
        microbatch_dim / stage_dim / repeat_dim: dim names (the layout splits ``stage``: ``stage:pipe``).
        variable_prefix: the stacked variables are ``{variable_prefix}/{kind}`` for each ``{name}/{kind}`` (inside
            the enclosing variable scopes, as ``get_variable`` names).
        name: names the iterations (``{name}/iter_{t}``).
        remat: recompute each iteration's layer in the backward pass (:func:`meshtorch.autodiff.recompute_grad`),
            so activation memory does not grow with ``M``. ``remat_keep``: recompute_grad's ``keep`` (ops kept).
        bubble_fill: the value bubble slots hold before the mask (0; tests use NaN to show it never leaks).
        layer_names: ``layer_names(i)`` names layer ``i`` of the unpipelined stack (e.g. ``f"layer_{i}"``): the
            stacked variables then start from the values those layers' variables would have.
        side_inputs: tensors ``[..., microbatch_dim, ...]`` (``microbatch_dim`` of size M) that every layer reads
            beside its state, e.g. an encoder's output for the decoder stack of an encoder-decoder (Megatron-LM
            sends it to every decoder stage). At iteration ``t`` stage ``s`` gets microbatch ``work(t, s)``'s slice
            of each (zeros in a bubble): ``[stage, side's other dims...]``, passed as ``stage_fn(h, name, *sides)``;
            an einsum with a ``[stage, microbatch]`` one-hot constant, local when ``stage`` is split (its gradient:
            one all-reduce over the stage axis per iteration).

    Returns:
        Tensor of ``x``'s shape: microbatch ``m``'s slot holds the output of layer ``S * R - 1`` on it.

    Raises:
        ShapeError: ``x`` (or a side input) lacks ``microbatch_dim`` of size M, or already has ``stage_dim`` /
            ``repeat_dim``.
        ValueError: ``stage_fn`` returning another shape or dtype, or changing its variables between calls.
    """
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    for t in [x, *side_inputs]:
        if microbatch_dim not in t.shape or t.shape.get_dim_by_name(microbatch_dim).size != M:
            raise ShapeError(f"pipeline: input {t.name!r} {t.shape} needs dimension {microbatch_dim!r} of size {M} "
                             "(the schedule's microbatches).")
        for dim in (stage_dim, repeat_dim):
            if dim in t.shape:
                raise ShapeError(f"pipeline: input {t.name!r} {t.shape} already has dimension {dim!r}.")
    mesh, dtype = x.mesh, x.dtype
    stage = Dimension(stage_dim, S)
    repeat = Dimension(repeat_dim, R) if R > 1 else None
    state_shape = Shape([stage] + (x.shape - [microbatch_dim]).dims)
    stacker = StackedVariables(stage, repeat, scoped_variable_name(variable_prefix), layer_names)
    first, last = _mask(mesh, stage, [s == 0 for s in range(S)], f"{name}/first_stage"), None
    if S > 1:
        last = _mask(mesh, stage, [s == S - 1 for s in range(S)], f"{name}/last_stage")
    feeds = unstack(broadcast(x, Shape([stage] + x.shape.dims), name=f"{name}/feed_all"), microbatch_dim,
                    name=f"{name}/feeds")
    shifted: list[Tensor] = []
    outputs: list[Tensor | None] = [None] * M
    prev = None
    for t in range(schedule.iterations()):
        prefix = f"{name}/iter_{t}"
        if prev is None:
            carry = constant(mesh, bubble_fill, state_shape, dtype=dtype, name=f"{prefix}/initial_state")
        else:
            carry = shift(prev, 1, stage_dim, wrap=True, name=f"{prefix}/shift")
        shifted.append(carry)
        if t < M:  # stage 0 takes the next microbatch
            inp = where(first, feeds[t], carry, output_shape=state_shape, name=f"{prefix}/feed")
        elif t < M * R and M > S:  # the previous repeat's last-stage output, M - S iterations old
            inp = where(first, shifted[t - (M - S)], carry, output_shape=state_shape, name=f"{prefix}/recirculate")
        else:  # M == S: the wrap-around itself; t >= M * R: stage 0 idles
            inp = carry
            if t >= M * R and bubble_fill != 0.0:  # (tests) the idle stage 0 holds the fill, not the wrap-around
                inp = where(first, constant(mesh, bubble_fill, [], dtype=dtype), carry, output_shape=state_shape,
                            name=f"{prefix}/idle")
        valid = schedule.valid(t)
        if not all(valid):  # a true select: a bubble's contents never reach values or gradients
            inp = where(_mask(mesh, stage, valid, f"{prefix}/valid"), inp, constant(mesh, 0.0, [], dtype=dtype),
                        output_shape=state_shape, name=f"{prefix}/mask_bubbles")
        select = None
        if repeat is not None:
            onehot = torch.zeros(S, R, dtype=dtype)
            for s in range(S):
                w = schedule.work(t, s)
                if w is not None:
                    onehot[s, w[1]] = 1.0
            select = import_tensor(mesh, onehot, [stage, repeat], name=f"{prefix}/repeat_onehot")

        sides = _sides(side_inputs, schedule, t, stage, microbatch_dim, prefix)

        def body(h, *sides, prefix=prefix, select=select):
            with variable_scope("", custom_getter=stacker.getter(scoped_variable_name(prefix), select)):
                return stage_fn(h, prefix, *sides)

        out = recompute_grad(body, [inp, *sides], keep=remat_keep) if remat else body(inp, *sides)
        if out.shape != state_shape or out.dtype != dtype:
            raise ValueError(f"pipeline: stage_fn returned {out.shape} {out.dtype}; it must return its input's "
                             f"shape {state_shape} and dtype {dtype}.")
        stacker.frozen = True
        m = schedule.outputs_at(t)
        if m is not None:  # the last stage's slot; the others' are zeroed (a true select: bubbles never leak)
            outputs[m] = out if last is None else where(last, out, constant(mesh, 0.0, [], dtype=dtype),
                                                        output_shape=state_shape, name=f"{prefix}/output")
        prev = out
    stacked = stack(outputs, microbatch_dim, axis=1 + x.shape.dims.index(x.shape.get_dim_by_name(microbatch_dim)),
                    name=f"{name}/outputs")
    return reduce_sum(stacked, output_shape=x.shape, name=f"{name}/last_stage_outputs")

"""Pipelined layer stack: the layers' weights stacked on a ``stage`` dim, activations shifted between stages.

The named-dimension formulation of pipeline parallelism (GSPMD, Xu et al. 2021, section 3.3; praxis'
``LayerwiseShardablePipelined`` / ``CircularLayerwiseShardablePipelined``; MaxText's ``Pipeline``): the
weights of layer ``r * S + s`` are row ``[s, r]`` of variables ``[stage, repeat, ...]``, the activations
live in a state buffer ``[stage, microbatch dims...]``, and ONE call of the layer code per iteration
computes every stage at once, ``stage`` being a batch dim of each einsum. Splitting ``stage`` over a mesh
axis (layout rule ``stage:pipe``) makes each processor compute only its own stage, and the shift of the
buffer by one stage between iterations becomes a neighbour exchange over that axis (the ``receive``
collective). The loop is unrolled (``M * R + S - 1`` iterations, :class:`~meshtorch.core.pipeline.PipelineSchedule`),
so autodiff gives the GPipe backward pass (the gradient of ``shift(+1)`` is ``shift(-1)``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshtorch.autodiff import recompute_grad
from meshtorch.core.dims import Dimension, Shape, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.core.pipeline import PipelineSchedule
from meshtorch.core.scopes import scoped_variable_name, variable_scope
from meshtorch.ops.einsum import einsum
from meshtorch.ops.reduce import reduce_sum
from meshtorch.ops.sequence import shift
from meshtorch.ops.shape import where
from meshtorch.ops.variables import constant, import_tensor

__all__ = ["pipeline", "StackedVariables"]


class StackedVariables:
    """The custom getter (see :func:`meshtorch.variable_scope`) that stacks a layer's weights.

    A ``get_variable(mesh, "{prefix}/{kind}", shape)`` made by the layer code of one iteration becomes
    the variable ``{variable_prefix}/{kind}`` of shape ``[stage, (repeat,) shape...]`` (created at the first
    request, with the layer's initializer and dtype; shared by every iteration), and the layer code gets
    ``[stage, shape...]``: the variable itself when ``repeats == 1``, else each stage's row of the repeat it
    runs in this iteration (an einsum with a ``[stage, repeat]`` one-hot constant: local when ``stage`` is
    split). Initializers see the stacked shape: fans must come from explicit dims (VarianceScaling with
    ``reduced_dims``/``new_dims``, constants), as every meshtorch layer's are.
    """

    def __init__(self, stage: Dimension, repeat: Dimension | None, variable_prefix: str):
        self.stage, self.repeat, self.variable_prefix = stage, repeat, variable_prefix
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
                self.variables[kind] = getter(mesh, f"{self.variable_prefix}/{kind}", Shape(lead + shape.dims),
                                              **kwargs)
            w = self.variables[kind]
            if select is None:
                return w
            return einsum([w, select], output_shape=Shape([self.stage] + shape.dims), name=f"{prefix}/{kind}/select")

        return custom


def _mask(mesh, stage: Dimension, values, name) -> Tensor:
    return import_tensor(mesh, torch.tensor(values, dtype=torch.bool), [stage], name=name)


def pipeline(stage_fn: Callable[[Tensor, str], Tensor], microbatches: list[Tensor], schedule: PipelineSchedule,
             stage_dim: str = "stage", repeat_dim: str = "repeat", variable_prefix: str = "stack",
             name: str = "pipeline", remat: bool = True, remat_keep: Callable | None = None,
             bubble_fill: float = 0.0) -> list[Tensor]:
    """Run ``S * R`` layers over ``M`` microbatches as an ``S``-stage pipeline (GPipe; circular when ``R > 1``).

    Layer ``r * S + s`` (stage ``s``, repeat ``r``) is ``stage_fn`` with the weights ``[s, r]`` of the stacked
    variables (see :class:`StackedVariables`). At iteration ``t`` the state buffer ``[stage, x dims...]`` is
    shifted one stage forward (wrapping around), stage 0 takes microbatch ``t`` (``t < M``) or, for
    ``R > 1``, the last stage's output of that microbatch's previous repeat (kept ``M - S`` iterations);
    bubble slots (:meth:`PipelineSchedule.work` is None) are replaced by zeros with a true select *before*
    ``stage_fn``, so nothing a bubble holds reaches a value or a gradient; then ``stage_fn`` runs once on the
    whole buffer. The last stage's final-repeat outputs are read with a masked sum over ``stage`` (one
    all-reduce over the ``stage`` mesh axis per microbatch when it is split).

    Args:
        stage_fn: ``stage_fn(x, name) -> y``: one layer on ``x`` ``[stage, x dims...]``, returning the same
            shape and dtype, making its variables (``get_variable``) under names ``{name}/...`` only
            (e.g. ``layers.dense(..., name=f"{name}/ffn")``), the same at every call.
        microbatches: ``M`` Tensors of one shape (``[batch, length, d_model]`` for an LM), without ``stage``.
        schedule: S, M, R; ``len(microbatches)`` must be M.
        stage_dim / repeat_dim: names of the stacked dims (the layout splits ``stage``: ``stage:pipe``).
        variable_prefix: the stacked variables are ``{variable_prefix}/{kind}`` for each ``{name}/{kind}``.
        name: names the iterations (``{name}/iter_{t}``).
        remat: recompute each iteration's layer in the backward pass (:func:`meshtorch.autodiff.recompute_grad`),
            so activation memory does not grow with ``M``. ``remat_keep``: recompute_grad's ``keep`` (ops kept).
        bubble_fill: the value bubble slots hold before the mask (0; tests use NaN to show it never leaks).

    Returns:
        the ``M`` outputs, in microbatch order, each of the microbatches' shape.

    Raises:
        ValueError: ``len(microbatches) != M``, microbatches of different shapes or dtypes, or ``stage_fn``
            changing its variables between calls. ShapeError: a microbatch already has ``stage_dim``.
    """
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    if len(microbatches) != M:
        raise ValueError(f"pipeline: {len(microbatches)} microbatches given, the schedule has {M}.")
    x0 = microbatches[0]
    for x in microbatches:
        if x.shape != x0.shape or x.dtype != x0.dtype:
            raise ValueError(f"pipeline: microbatch {x.name!r} {x.shape} {x.dtype} differs from {x0.name!r} "
                             f"{x0.shape} {x0.dtype}; all microbatches need one shape and dtype.")
    if stage_dim in x0.shape:
        raise ShapeError(f"pipeline: microbatch {x0.name!r} {x0.shape} already has dimension {stage_dim!r}.")
    mesh = x0.mesh
    stage = Dimension(stage_dim, S)
    repeat = Dimension(repeat_dim, R) if R > 1 else None
    state_shape = Shape([stage] + x0.shape.dims)
    stacker = StackedVariables(stage, repeat, variable_prefix)
    first, last = _mask(mesh, stage, [s == 0 for s in range(S)], f"{name}/first_stage"), None
    if S > 1:
        last = _mask(mesh, stage, [s == S - 1 for s in range(S)], f"{name}/last_stage")
    shifted: list[Tensor] = []
    outputs: list[Tensor | None] = [None] * M
    prev = None
    for t in range(schedule.iterations()):
        prefix = f"{name}/iter_{t}"
        if prev is None:
            carry = constant(mesh, bubble_fill, state_shape, dtype=x0.dtype, name=f"{prefix}/initial_state")
        else:
            carry = shift(prev, 1, stage_dim, wrap=True, name=f"{prefix}/shift")
        shifted.append(carry)
        if t < M:  # stage 0 takes the next microbatch
            inp = where(first, microbatches[t], carry, output_shape=state_shape, name=f"{prefix}/feed")
        elif t < M * R and M > S:  # the previous repeat's last-stage output, M - S iterations old
            inp = where(first, shifted[t - (M - S)], carry, name=f"{prefix}/recirculate")
        else:  # M == S: the wrap-around itself; t >= M * R: stage 0 idles
            inp = carry
            if t >= M * R and bubble_fill != 0.0:  # (tests) the idle stage 0 holds the fill, not the wrap-around
                inp = where(first, constant(mesh, bubble_fill, [], dtype=x0.dtype), carry, name=f"{prefix}/idle")
        valid = schedule.valid(t)
        if not all(valid):  # a true select: a bubble's contents never reach values or gradients
            inp = where(_mask(mesh, stage, valid, f"{prefix}/valid"), inp, constant(mesh, 0.0, [], dtype=x0.dtype),
                        name=f"{prefix}/mask_bubbles")
        select = None
        if repeat is not None:
            onehot = torch.zeros(S, R, dtype=x0.dtype)
            for s in range(S):
                w = schedule.work(t, s)
                if w is not None:
                    onehot[s, w[1]] = 1.0
            select = import_tensor(mesh, onehot, [stage, repeat], name=f"{prefix}/repeat_onehot")

        def body(x, prefix=prefix, select=select):
            with variable_scope("", custom_getter=stacker.getter(scoped_variable_name(prefix), select)):
                return stage_fn(x, prefix)

        out = recompute_grad(body, [inp], keep=remat_keep) if remat else body(inp)
        if out.shape != state_shape or out.dtype != x0.dtype:
            raise ValueError(f"pipeline: stage_fn returned {out.shape} {out.dtype}; it must return its input's "
                             f"shape {state_shape} and dtype {x0.dtype}.")
        stacker.frozen = True
        m = schedule.outputs_at(t)
        if m is not None:
            if last is None:
                outputs[m] = reduce_sum(out, reduced_dim=stage_dim, name=f"{prefix}/output")
            else:
                outputs[m] = reduce_sum(where(last, out, constant(mesh, 0.0, [], dtype=x0.dtype)),
                                        reduced_dim=stage_dim, name=f"{prefix}/output")
        prev = out
    return outputs

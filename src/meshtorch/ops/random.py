"""Random ops and dropout, drawn from the counter-based generator (:mod:`meshtorch.ops.rng`).

Every value is a pure function of ``(graph seed, op key, run, global element index)``:

* **graph seed**: ``mtf.Graph(seed=...)``;
* **op key**: the op's name (unique in its graph, so the same graph-building code gives the same
  keys), or ``seed=`` when given explicitly (two ops with one explicit seed draw the same numbers,
  as TF op-level seeds do);
* **run**: ``lowering.run_count``, the number of ``run`` calls the Lowering completed before this
  one, read from ``lowering.run_counter_slot`` at every run. Each run therefore draws fresh values
  (a new dropout mask per training step, as Mesh TF's stateful TF random ops give), and setting
  ``lowering.run_count`` replays a run's draws (e.g. after restoring a checkpoint);
* **global element index**: each processor hashes the row-major indices of its own slice in the
  full tensor (offsets from ``mesh_impl.slice_begin``).

So the same graph gives bitwise the same numbers on one processor and under every mesh and layout,
on every replica, with no communication. Mesh TF instead draws each slice from a stateful TF op
(``mesh_impl.random``), so its numbers change with the layout.

Dropout stores no mask: its gradient is the same dropout (same key, same run) applied to ``dy``,
which recomputes the mask from the generator.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.dims import convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Mesh, Operation, Tensor
from meshtorch.ops import rng
from meshtorch.ops._kernels import align_spec, aligned, slice_begin

__all__ = ["random_uniform", "random_normal", "truncated_normal", "dropout", "RandomOperation",
           "DropoutOperation", "random_reference"]


def run_key(key: str, run: int) -> str:
    """The generator key an op with key ``key`` uses at run number ``run``."""
    return f"{key}@{int(run)}"


def _draw(kind: str, params: dict, dtype: torch.dtype, seed: int, key: str, index: torch.Tensor) -> torch.Tensor:
    """Values of distribution ``kind`` for global element indices ``index`` (any shape)."""
    if kind == "uniform":
        lo, hi = params["minval"], params["maxval"]
        if not dtype.is_floating_point:
            # integers in [minval, maxval): 32 random bits modulo the range (bias < range / 2**32)
            return (rng.random_bits(seed, key, index) % (hi - lo) + lo).to(dtype)
        return (rng.uniform(seed, key, index) * (hi - lo) + lo).to(dtype)
    if kind == "normal":
        return (rng.normal(seed, key, index) * params["stddev"] + params["mean"]).to(dtype)
    if kind == "truncated_normal":
        return (rng.truncated_normal(seed, key, index) * params["stddev"] + params["mean"]).to(dtype)
    raise ValueError(f"unknown distribution {kind!r}")


def random_reference(kind: str, shape, dtype=torch.float32, seed: int = 0, key: str = "random", run: int = 0,
                     **params) -> torch.Tensor:
    """The full tensor a random op draws, computed unsliced on one device (tests, debugging).

    ``kind`` is ``"uniform"`` (params ``minval``, ``maxval``), ``"normal"`` or
    ``"truncated_normal"`` (params ``mean``, ``stddev``); ``key`` is the op's key (its name, or
    ``f"seed={seed}"`` for an explicit op seed); ``run`` the run number.
    """
    shape = convert_to_shape(shape)
    full = shape.to_integer_list()
    idx = rng.global_index(full, [0] * len(full), full)
    defaults = {"uniform": {"minval": 0.0, "maxval": 1.0}}.get(kind, {"mean": 0.0, "stddev": 1.0})
    return _draw(kind, {**defaults, **params}, dtype, seed, run_key(key, run), idx)


def _k_where(impl, pnum: int, *, sizes, layout, dims):
    """``(begin, device)``: the global offsets of ``pnum``'s slice along tensor dims ``dims`` and its device."""
    begin = slice_begin(impl, pnum, sizes, layout)
    return [begin[i] for i in dims], impl.device(pnum)


def _k_random(begin_device, run, *, kind, params, dtype, seed, key, full, sizes):
    """A slice of ``sizes`` (at ``begin``) of the tensor of ``full`` sizes drawn from ``kind``."""
    begin, device = begin_device
    return _draw(kind, params, dtype, seed, run_key(key, run), rng.global_index(full, begin, sizes, device))


def _k_dropout(t, begin_device, run, *, keep, seed, key, full, sizes, align):
    """Dropout of slice ``t``: the noise slice of ``sizes`` (at ``begin``) aligned onto ``t`` by ``align``."""
    begin, device = begin_device
    u = rng.uniform(seed, run_key(key, run), rng.global_index(full, begin, sizes, device))
    mask = aligned(u < keep, align)
    return torch.where(mask, t * (1.0 / keep), torch.zeros((), dtype=t.dtype, device=t.device))


class RandomOperation(Operation):
    """A tensor of ``shape`` drawn from distribution ``kind`` (see the module docstring).

    Each processor computes its own slice from the global indices; no communication.
    """

    def __init__(self, mesh: Mesh, shape, kind: str, params: dict, dtype=torch.float32, seed=None, name=None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"random {kind}: mesh must be an mtf.Mesh, got {type(mesh).__name__}.")
        super().__init__([], mesh, name=name or f"random_{kind}")
        self.kind, self.params = kind, dict(params)
        self.key = self.name if seed is None else f"seed={int(seed)}"
        self.outputs = [Tensor(self, convert_to_shape(shape), dtype)]

    differentiable = False

    def lower(self, lw):
        out = self.outputs[0]
        layout = tuple(lw.tensor_layout(out))
        full, sizes = tuple(out.shape.to_integer_list()), tuple(lw.slice_shape(out))
        where = lw.pnum_constant(out, functools.partial(_k_where, sizes=full, layout=layout,
                                                        dims=tuple(range(len(full)))))
        f = functools.partial(_k_random, kind=self.kind, params=dict(self.params), dtype=out.dtype,
                              seed=self.graph.seed, key=self.key, full=full, sizes=sizes)
        lw.set(out, lw.slicewise(f, where, lw.run_counter_slot(self.mesh)))


def _check_dtype(dtype, what):
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what}: dtype must be a torch.dtype, got {dtype!r}.")


def random_uniform(mesh: Mesh, shape, minval=0.0, maxval=None, dtype=torch.float32, seed=None,
                   name=None) -> Tensor:
    """Uniform values on ``[minval, maxval)`` (Mesh TF ``mtf.random_uniform`` / ``tf.random.uniform``).

    Args:
        mesh: the Mesh. shape: named shape of the result.
        minval, maxval: bounds; ``maxval`` defaults to 1 for floats and is required for integers.
        dtype: float dtypes get 24 random bits per element (float32 resolution, also for float64);
            integer dtypes get ``minval + bits % (maxval - minval)``.
        seed: optional int; replaces the op's name as its key (see the module docstring).

    Returns:
        Tensor of ``shape`` and ``dtype``; identical under every layout, fresh at every run.

    Raises:
        ValueError: if an integer dtype has no ``maxval`` or ``maxval <= minval``.
    """
    _check_dtype(dtype, "random_uniform")
    if maxval is None:
        if not dtype.is_floating_point:
            raise ValueError("random_uniform: integer dtypes need maxval (as tf.random.uniform).")
        maxval = 1.0
    if not dtype.is_floating_point:
        minval, maxval = int(minval), int(maxval)
        if maxval <= minval:
            raise ValueError(f"random_uniform: maxval {maxval} must exceed minval {minval} for integers.")
    return RandomOperation(mesh, shape, "uniform", {"minval": minval, "maxval": maxval}, dtype, seed,
                           name).outputs[0]


def random_normal(mesh: Mesh, shape, mean=0.0, stddev=1.0, dtype=torch.float32, seed=None, name=None) -> Tensor:
    """Normal(``mean``, ``stddev``) values (Mesh TF ``mtf.random_normal`` / ``tf.random.normal``).

    Box-Muller on two counter-based uniform streams, computed in float32, cast to ``dtype``.
    Identical under every layout, fresh at every run; ``seed`` as in :func:`random_uniform`.
    """
    _check_dtype(dtype, "random_normal")
    if not dtype.is_floating_point:
        raise TypeError(f"random_normal: dtype must be floating point, got {dtype}.")
    return RandomOperation(mesh, shape, "normal", {"mean": mean, "stddev": stddev}, dtype, seed, name).outputs[0]


def truncated_normal(mesh: Mesh, shape, mean=0.0, stddev=1.0, dtype=torch.float32, seed=None, name=None) -> Tensor:
    """Normal(``mean``, ``stddev``) truncated to two standard deviations (``tf.random.truncated_normal``).

    Drawn by the inverse CDF (no resampling), so each element costs one uniform draw; the result's
    standard deviation is ``0.8796 * stddev`` as in TF. Identical under every layout.
    """
    _check_dtype(dtype, "truncated_normal")
    if not dtype.is_floating_point:
        raise TypeError(f"truncated_normal: dtype must be floating point, got {dtype}.")
    return RandomOperation(mesh, shape, "truncated_normal", {"mean": mean, "stddev": stddev}, dtype, seed,
                           name).outputs[0]


class DropoutOperation(Operation):
    """``x * mask / keep_prob`` with ``mask = uniform(noise_shape) < keep_prob`` broadcast to x's shape.

    ``key`` fixes the mask's stream (default: this op's name); the gradient is a DropoutOperation
    on ``dy`` with the same key, so it recomputes the identical mask in the same run.
    """

    def __init__(self, x: Tensor, keep_prob: float, noise_shape, key=None, name=None):
        super().__init__([x], name=name or "dropout")
        self.keep_prob = float(keep_prob)
        self.noise_shape = noise_shape
        self.key = key or self.name
        self.outputs = [Tensor(self, x.shape, x.dtype)]

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        return [DropoutOperation(dy, self.keep_prob, self.noise_shape, self.key, f"{self.name}_grad").outputs[0]]

    def lower(self, lw):
        x, out = self.inputs[0], self.outputs[0]
        noise = self.noise_shape
        pos = tuple(x.shape.get_dim_index(d.name) for d in noise)
        xsizes = lw.slice_shape(x)
        where = lw.pnum_constant(x, functools.partial(_k_where, sizes=tuple(x.shape.to_integer_list()),
                                                      layout=tuple(lw.tensor_layout(x)), dims=pos))
        f = functools.partial(_k_dropout, keep=self.keep_prob, seed=self.graph.seed, key=self.key,
                              full=tuple(noise.to_integer_list()), sizes=tuple(xsizes[i] for i in pos),
                              align=align_spec(noise, x.shape))
        lw.set(out, lw.slicewise(f, lw.get(x), where, lw.run_counter_slot(self.mesh)))


def dropout(x: Tensor, is_training: bool = True, keep_prob=None, rate=None, noise_shape=None, name=None) -> Tensor:
    """Dropout (Mesh TF ``mtf.dropout``): zero elements with probability ``rate``, scale the rest.

    Args:
        x: Tensor of any named shape (floating dtype).
        is_training: if False, returns ``x`` unchanged.
        keep_prob / rate: give exactly one; ``rate = 1 - keep_prob``; ``keep_prob`` in (0, 1].
        noise_shape: a subset of x's dims (same sizes, any order): the mask is drawn over these
            dims and broadcast over the others (e.g. the same mask for every position). Default
            ``x.shape``.
        name: op name; it keys the mask (see the module docstring).

    Returns:
        Tensor of x's shape: ``x * mask / keep_prob``, ``mask = uniform < keep_prob``. The mask is
        identical under every layout and fresh at every run; the gradient is
        ``dy * mask / keep_prob`` with the mask recomputed, nothing stored.

    Raises:
        ValueError: if both or neither of ``keep_prob`` and ``rate`` are given, or out of range.
        ShapeError: if ``noise_shape`` has a dim that x lacks (or with another size).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"dropout: x must be an mtf Tensor, got {type(x).__name__}.")
    if (keep_prob is None) == (rate is None):
        raise ValueError(f"dropout of {x.name!r}: give exactly one of keep_prob and rate.")
    if keep_prob is None:
        keep_prob = 1.0 - float(rate)
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"dropout of {x.name!r}: keep_prob must be in (0, 1], got {keep_prob} "
                         f"(rate must be in [0, 1)).")
    if not x.dtype.is_floating_point:
        raise TypeError(f"dropout of {x.name!r}: x must be floating point, got {x.dtype}.")
    noise = x.shape if noise_shape is None else convert_to_shape(noise_shape)
    for d in noise:
        if d.name not in x.shape or x.shape.get_dim_by_name(d.name).size != d.size:
            raise ShapeError(f"dropout of {x.name!r}: noise_shape dimension {d} is not a dimension of x {x.shape}; "
                             "noise_shape must be a subset of x's dims.")
    if not is_training or keep_prob == 1.0:
        return x
    return DropoutOperation(x, keep_prob, noise, name=name).outputs[0]

"""Reductions over named dimensions: sum, mean, max, min, logsumexp; softmax and log-softmax.

Lowering: reduce each slice locally, then all-reduce over the mesh axes that split the reduced
dims. A sum's all-reduce is deferred (lazy), so ``reduce_sum(a) + reduce_sum(b)`` or a sum
followed by a scaling costs one all-reduce; max and min all-reduce at once.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.dims import convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops._util import dim_names
from meshtorch.ops.binary import add, maximum, subtract

_TORCH = {"SUM": torch.sum, "MAX": torch.amax, "MIN": torch.amin}


class ReduceOperation(Operation):
    """Reduce ``x`` to ``output_shape`` (a subset of x's dims, any order) with SUM, MAX or MIN."""

    def __init__(self, x: Tensor, output_shape, reduction: str, name: str | None = None):
        super().__init__([x], name=name or f"reduce_{reduction.lower()}")
        self.reduction = reduction
        self.partial_sums = "first" if reduction == "SUM" else None  # a sum of partial sums stays partial
        output_shape = convert_to_shape(output_shape)
        for d in output_shape:
            if d not in x.shape.dims:
                raise ShapeError(f"reduce {self.name!r}: output dimension {d} is not a dimension of input "
                                 f"{x.name!r} {x.shape}.")
        self.outputs = [Tensor(self, output_shape, x.dtype)]

    @property
    def has_gradient(self):
        return self.reduction in ("SUM", "MAX", "MIN")

    def lower(self, lw):
        x = self.inputs[0]
        out = self.outputs[0]
        names = x.shape.dimension_names
        red_axes = tuple(i for i, n in enumerate(names) if n not in out.shape)
        kept = [n for n in names if n in out.shape]
        perm = [kept.index(n) for n in out.shape.dimension_names]
        need_perm = perm != list(range(len(perm)))
        red_mesh_axes = lw.tensor_mesh_axes(x, [names[i] for i in red_axes])
        # mixed precision: accumulate a low-precision local sum in float32, round once (torch does so
        # for bfloat16 on CPU but not for float16; here it is explicit for both, on every device)
        low = self.reduction == "SUM" and x.dtype in (torch.bfloat16, torch.float16)
        f = functools.partial(_k_reduce, reduction=self.reduction if red_axes else None, dims=red_axes,
                              perm=tuple(perm) if need_perm else None, low=x.dtype if low else None)
        if self.reduction == "SUM":
            (slot,), pending = lw.inputs(self)
            lw.set(out, lw.slicewise(f, slot), pending | frozenset(red_mesh_axes))
        else:
            local = lw.slicewise(f, lw.get(x))
            lw.set(out, lw.allreduce(local, red_mesh_axes, self.reduction, out) if red_mesh_axes else local)

    def max_min_gradient(self, dy: Tensor) -> Tensor:
        """Gradient of a MAX or MIN reduction: ``dy`` goes to the elements equal to the result, split
        evenly among ties. (A SUM's gradient is a broadcast, which builds on reductions; both rules are
        registered in :mod:`meshtorch.ops.gradients`.)"""
        x, y = self.inputs[0], self.outputs[0]
        mask = ew.slicewise(_k_argmask, [x, y], output_shape=x.shape, name="reduce_argmask")
        count = reduce_sum(mask, output_shape=y.shape)
        return ew.slicewise(_k_share, [mask, dy, count], output_shape=x.shape, name="reduce_extreme_grad")


def _k_reduce(t, *, reduction, dims, perm, low):
    """Local reduction of ``t`` over ``dims`` (``reduction`` None: none), then ``perm``; ``low``: the
    low-precision dtype whose sum is accumulated in float32."""
    if reduction is not None:
        t = torch.sum(t, dim=dims, dtype=torch.float32).to(low) if low is not None else _TORCH[reduction](t, dim=dims)
    return t if perm is None else t.permute(perm)


def _k_argmask(a, b):
    return (a == b).to(a.dtype)


def _k_share(m, d, c):
    return m * (d / c)


def _output_shape(x: Tensor, reduced_dim, output_shape, what):
    if output_shape is not None and reduced_dim is not None:
        raise ValueError(f"{what}: give reduced_dim or output_shape, not both.")
    if output_shape is not None:
        return convert_to_shape(output_shape)
    if reduced_dim is None:
        return convert_to_shape([])
    dims = reduced_dim if isinstance(reduced_dim, list | tuple) and not _is_pair(reduced_dim) else [reduced_dim]
    names = dim_names(dims)
    for n in names:
        if n not in x.shape:
            raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {n!r} to reduce.")
    return x.shape - names


def _positional_dim(positional, reduced_dim, what):
    """Mesh TF's reductions take ``(x, disable_positional_args, output_shape, reduced_dim)`` and reject a
    positional second argument; meshtorch also accepts the reduced dim there (``reduce_sum(x, "d")``)."""
    if positional is None:
        return reduced_dim
    if reduced_dim is not None:
        raise ValueError(f"{what}: reduced dim given twice (positionally and as reduced_dim=).")
    return positional


def _is_pair(d):
    return isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], str) and isinstance(d[1], int)


def reduce_sum(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None, name=None) -> Tensor:
    """Sum over ``reduced_dim`` (a dim, name, or list), or down to ``output_shape``; all dims if neither.

    Follows Mesh TF ``mtf.reduce_sum``. Returns a Tensor of the remaining dims, x's dtype.
    """
    reduced_dim = _positional_dim(disable_positional_args, reduced_dim, "reduce_sum")
    return ReduceOperation(x, _output_shape(x, reduced_dim, output_shape, "reduce_sum"), "SUM", name).outputs[0]


def reduce_max(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None, name=None) -> Tensor:
    """Maximum over ``reduced_dim`` or down to ``output_shape`` (Mesh TF ``mtf.reduce_max``)."""
    reduced_dim = _positional_dim(disable_positional_args, reduced_dim, "reduce_max")
    return ReduceOperation(x, _output_shape(x, reduced_dim, output_shape, "reduce_max"), "MAX", name).outputs[0]


def reduce_min(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None, name=None) -> Tensor:
    """Minimum over ``reduced_dim`` or down to ``output_shape`` (Mesh TF ``mtf.reduce_min``)."""
    reduced_dim = _positional_dim(disable_positional_args, reduced_dim, "reduce_min")
    return ReduceOperation(x, _output_shape(x, reduced_dim, output_shape, "reduce_min"), "MIN", name).outputs[0]


def reduce_to_shape(g: Tensor, shape) -> Tensor:
    """``g`` summed over the dims ``shape`` lacks, in ``shape``'s order (the gradient of broadcasting);
    ``g`` itself if it has that shape already."""
    shape = convert_to_shape(shape)
    if g.shape == shape:
        return g
    return reduce_sum(g, output_shape=shape)


def reduce_mean(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None, name=None) -> Tensor:
    """Mean over ``reduced_dim`` or down to ``output_shape`` (global count; one lazy all-reduce)."""
    reduced_dim = _positional_dim(disable_positional_args, reduced_dim, "reduce_mean")
    shape = _output_shape(x, reduced_dim, output_shape, "reduce_mean")
    n = x.shape.size // max(shape.size, 1)
    return ew.scalar_op(reduce_sum(x, output_shape=shape, name=name), 1.0 / n, "mul")


def reduce_logsumexp(x: Tensor, reduced_dim=None, extra_logit=None, name=None, output_shape=None) -> Tensor:
    """log(sum(exp(x))) over ``reduced_dim`` (Mesh TF ``mtf.reduce_logsumexp``), computed stably.

    ``extra_logit``: optional float or Tensor broadcastable to ``x.shape - reduced_dim``, an extra
    logit added to the sum as Mesh TF does (``log(sum(exp(x)) + exp(extra_logit))``).
    Returns a Tensor of ``x.shape - reduced_dim`` (or ``output_shape``), x's dtype.
    """
    shape = _output_shape(x, reduced_dim, output_shape, "reduce_logsumexp")
    m = ew.stop_gradient(reduce_max(x, output_shape=shape))
    if extra_logit is not None:
        m = maximum(m, ew.stop_gradient(extra_logit) if isinstance(extra_logit, Tensor) else extra_logit)
    s = reduce_sum(ew.exp(subtract(x, m)), output_shape=shape)
    if extra_logit is not None:
        s = add(s, ew.exp(subtract(extra_logit, m)))
    return add(ew.log(s), m, name=name)


def log_softmax(x: Tensor, reduced_dim, extra_logit=None, name=None) -> Tensor:
    """x - logsumexp(x) over ``reduced_dim`` (Mesh TF ``mtf.log_softmax``, with its ``extra_logit``); shape of x."""
    return subtract(x, reduce_logsumexp(x, reduced_dim, extra_logit), output_shape=x.shape, name=name)


def softmax(x: Tensor, reduced_dim, extra_logit=None, name=None) -> Tensor:
    """exp(log_softmax(x)) over ``reduced_dim`` (Mesh TF ``mtf.softmax``); shape of x."""
    return ew.exp(log_softmax(x, reduced_dim, extra_logit), name=name)

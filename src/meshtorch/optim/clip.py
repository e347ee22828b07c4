"""Gradient clipping by global norm, as graph operations.

``clip_by_global_norm(grads, max_norm)`` follows ``torch.nn.utils.clip_grad_norm_`` (norm_type 2):
``norm = sqrt(sum_i sum(g_i^2))``, ``coef = min(1, max_norm / (norm + 1e-6))``, ``g_i <- g_i * coef``.

Communication: the squared norm is one :class:`GlobalSumOfSquares` op. Each processor sums the
squares of its slices of every gradient; a gradient replicated over some mesh axes of the union
of the gradients' split axes contributes only from the processors at coordinate 0 on those axes,
so one deferred all-reduce over the union of the split axes gives the exact total. Summing
per-variable ``reduce_sum(square(g))`` instead costs one all-reduce per distinct layout met in a
row (our lazy add only merges partial sums over identical mesh axes).
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops._kernels import tensor_of

__all__ = ["GlobalSumOfSquares", "ScaleGroup", "ClipGroup", "global_norm", "clip_by_global_norm"]


def _squared_norms(ts):
    """``[sum(t_i^2)]`` of local slices as one float32 vector: one multi-tensor ``torch._foreach_norm`` call
    (as ``torch.nn.utils.clip_grad_norm_(foreach=True)``), in float32 whatever the slices' dtype."""
    return torch.stack(torch._foreach_norm(list(ts), 2, dtype=torch.float32)).square()


def _k_sum_squares(*ts):
    """``sum_i sum(t_i^2)`` of local slices, in float32."""
    return _squared_norms(ts).sum()


def _k_sum_squares_masked(m, *ts):
    """``sum_i m_i sum(t_i^2)``: only the slices this processor contributes (bool mask ``m``)."""
    terms = _squared_norms(ts)
    return torch.where(m, terms, torch.zeros_like(terms)).sum()


class GlobalSumOfSquares(Operation):
    """``sum_i sum(x_i^2)`` over tensors of any shapes and layouts: a float32 scalar, one all-reduce.

    Inputs: any float tensors on one mesh. Output: shape ``[]``, float32 (the squares are summed in
    float32 whatever the inputs' dtype). No gradient (it is used on gradients).

    Raises:
        ValueError: if ``xs`` is empty, holds a non-float tensor, or spans several meshes.
    """

    def __init__(self, xs, name=None):
        xs = list(xs)
        if not xs:
            raise ValueError("global_norm: no tensors given.")
        for x in xs:
            if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
                raise ValueError(f"global_norm: {x!r} is not a float mtf Tensor.")
        super().__init__(xs, name=name or "global_sum_of_squares")
        self.outputs = [Tensor(self, [], torch.float32)]

    differentiable = False

    def lower(self, lw):
        impl = lw.mesh_spec(self)
        axes = [frozenset(lw.tensor_mesh_axes(x)) for x in self.inputs]
        union = frozenset().union(*axes)
        # contribute[p][i]: does processor p add tensor i's local sum (once per distinct slice)?
        contribute = []
        for p in range(impl.size):
            coords = impl.pnum_to_processor_coordinates(p)
            contribute.append([all(coords[a] == 0 for a in union - ax) for ax in axes])
        need_mask = not all(all(row) for row in contribute)
        slots = [lw.get(x) for x in self.inputs]
        if need_mask:
            mask = lw.pnum_constant(self, functools.partial(tensor_of, values=contribute, dtype=torch.bool))
            slot = lw.slicewise(_k_sum_squares_masked, mask, *slots)
        else:
            slot = lw.slicewise(_k_sum_squares, *slots)
        lw.set(self.outputs[0], slot, union)


def _k_scale_group(factor, *gs):
    """``g_i * factor`` (``factor``: a float32 0-dim tensor) of local slices: one ``torch._foreach_mul`` per dtype,
    the factor rounded to a group's dtype first. New tensors (gradients are no variable's storage)."""
    out = [None] * len(gs)
    groups: dict = {}
    for i, g in enumerate(gs):
        groups.setdefault(g.dtype, []).append(i)
    for dtype, idx in groups.items():
        scaled = torch._foreach_mul([gs[i] for i in idx], factor if dtype == factor.dtype else factor.to(dtype))
        for i, t in zip(idx, scaled, strict=True):
            out[i] = t
    return tuple(out) if len(out) > 1 else out[0]


def _k_clip_group(norm, *gs, max_norm: float, eps: float):
    """``g_i * min(1, max_norm / (norm + eps))``: ``torch.nn.utils.clip_grad_norm_(foreach=True)``'s scaling
    (``clamp(max_norm / (norm + eps), max=1)``, then ``_foreach_mul_`` of the grads grouped by dtype)."""
    return _k_scale_group(torch.clamp(max_norm / (norm + eps), max=1.0), *gs)


_k_scale_group.fresh_outputs = True
_k_clip_group.fresh_outputs = True


class ScaleGroup(Operation):
    """``grads`` times the float32 scalar ``factor``, all in one multi-tensor kernel per processor.

    Inputs: ``factor`` (shape ``[]``, float32) and ``n`` float gradients (any shapes, layouts and float dtypes).
    Outputs: ``n`` tensors, each of its gradient's named shape and dtype. Per processor one
    ``torch._foreach_mul`` per gradient dtype, instead of one multiply per gradient. No gradient (it is
    used on gradients).

    Raises:
        ValueError: if ``grads`` is empty or ``factor`` is not a float32 scalar.
    """

    differentiable = False

    def __init__(self, factor: Tensor, grads, name=None):
        grads = list(grads)
        if not grads or factor.shape.ndims or factor.dtype != torch.float32:
            raise ValueError(f"{type(self).__name__}: give a float32 scalar and at least one gradient, got "
                             f"{factor!r} and {len(grads)} gradients.")
        super().__init__([factor, *grads], name=name or "scale_group")
        self.outputs = [Tensor(self, g.shape, g.dtype, index=i) for i, g in enumerate(grads)]

    def kernel(self):
        return _k_scale_group

    def lower(self, lw):
        outs = lw.slicewise(self.kernel(), *[lw.get(x) for x in self.inputs], num_outputs=len(self.outputs))
        outs = outs if len(self.outputs) > 1 else [outs]  # one output: slicewise returns its slot alone
        for t, s in zip(self.outputs, outs, strict=True):
            lw.set(t, s)


class ClipGroup(ScaleGroup):
    """``grads`` scaled by ``min(1, max_norm / (norm + eps))`` (``norm``: float32 scalar), as
    :class:`ScaleGroup`: ``torch.nn.utils.clip_grad_norm_(foreach=True)``'s ``_foreach_mul_`` per dtype."""

    def __init__(self, norm: Tensor, grads, max_norm: float, eps: float = 1e-6, name=None):
        super().__init__(norm, grads, name=name or "clip_by_global_norm")
        self.params = {"max_norm": float(max_norm), "eps": float(eps)}

    def kernel(self):
        return functools.partial(_k_clip_group, **self.params)


def global_norm(xs) -> Tensor:
    """``sqrt(sum_i sum(x_i^2))`` of the non-None tensors ``xs``: a float32 scalar (one all-reduce)."""
    return ew.sqrt(GlobalSumOfSquares([x for x in xs if x is not None]).outputs[0])


def clip_by_global_norm(grads, max_norm: float, eps: float = 1e-6):
    """Scale ``grads`` so their global 2-norm is at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``).

    Args:
        grads: list of Tensors (None entries pass through as None).
        max_norm: the threshold (> 0).
        eps: added to the norm in the denominator, as torch (1e-6).

    Returns:
        ``(clipped grads, global norm)``: each clipped grad has its input's named shape and dtype;
        the norm is the float32 scalar norm *before* clipping (what torch returns).

    Raises:
        ValueError: if ``max_norm <= 0`` or every gradient is None.

    Per processor the gradients are scaled by one :class:`ClipGroup` (``torch._foreach_mul`` per dtype, as
    ``clip_grad_norm_(foreach=True)``). The clipping ops are built in
    :meth:`Graph.storage_scope <meshtorch.core.graph.Graph.storage_scope>`: with storage rules (FSDP) each
    gradient is reduce-scattered to its variable's shards first.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm}.")
    grads = list(grads)
    present = [g for g in grads if g is not None]
    if not present:
        raise ValueError("clip_by_global_norm: every gradient is None.")
    # optimizer math: laid out like the variables (storage rules; FSDP shards it, see Graph.storage_scope)
    with present[0].graph.storage_scope():
        norm = global_norm(present)
        clipped = iter(ClipGroup(norm, present, max_norm, eps).outputs)
    return [None if g is None else next(clipped) for g in grads], norm

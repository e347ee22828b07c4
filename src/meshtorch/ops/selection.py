"""Selection by value: top_k, top_1, argmax, nth_largest_element, sample_with_temperature.

Lowering of top-k over ``reduced_dim`` (Mesh TF ``TopKOperation``):

* ``reduced_dim`` not split: ``torch.topk`` (``torch.max`` for k = 1) on each slice, no
  communication;
* split over mesh axis ``a`` (``n`` processors): each processor takes its local top
  ``kk = min(k, local size)`` with global indices (local index + its slice offset); values and
  indices are all-gathered along ``a`` (``kk`` candidates per processor), and a final top-k over
  the ``n * kk`` candidates picks the result on every processor.

The output ``k_dim`` is unsplittable. Ties: k = 1 returns the first (lowest-index) maximum under
every layout, as ``torch.max`` / ``torch.argmax`` do. For k > 1 without a split the result is
``torch.topk``'s; with a split, tied candidates are ordered by global index, so the lowest-index
candidates win (``torch.topk`` leaves the choice among ties unspecified). With distinct values the
result is identical under every layout. Indices are int64 (torch's index dtype; Mesh TF: int32).
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.dims import Dimension, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops._kernels import slice_begin
from meshtorch.ops.einsum import einsum
from meshtorch.ops.indexing import gather, one_hot, resolve_dim
from meshtorch.ops.random import random_uniform

__all__ = ["top_k", "top_1", "argmax", "nth_largest_element", "nth_largest", "sample_with_temperature",
           "TopKOperation"]


def _merge(vals: torch.Tensor, idx: torch.Tensor, k: int):
    """Top k of candidates along the last axis: value descending, then global index ascending."""
    idx, perm = torch.sort(idx, dim=-1)
    vals = vals.gather(-1, perm)
    vals, order = torch.sort(vals, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx.gather(-1, order[..., :k])


# ----- kernels: the local computations top-k emits (module-level, so the program is data) -----

def _k_max(t: torch.Tensor, *, dim: int):
    """Values and (first) indices of the maximum along ``dim`` (``torch.max``)."""
    v, i = torch.max(t, dim=dim)
    return v, i


def _k_topk_last(t: torch.Tensor, *, dim: int, k: int):
    """``torch.topk`` of ``k`` along ``dim``, moved to the last axis."""
    v, i = torch.topk(t.movedim(dim, -1), k, dim=-1)
    return v, i


def _k_local_top(t: torch.Tensor, begin: int, *, dim: int, kk: int):
    """A slice's top ``kk`` along ``dim`` (moved last) with global indices (local index + ``begin``)."""
    if kk == 1:
        v, i = torch.max(t, dim=dim, keepdim=True)
        v, i = v.movedim(dim, -1), i.movedim(dim, -1)
    else:
        v, i = torch.topk(t.movedim(dim, -1), kk, dim=-1)
    return v, i + begin


def _k_merge(vals: torch.Tensor, idx: torch.Tensor, *, k: int, squeeze: bool):
    """Top ``k`` of the gathered candidates; ``squeeze`` drops the size-1 k axis (top_1)."""
    vals, idx = _merge(vals, idx, k)
    return (vals.squeeze(-1), idx.squeeze(-1)) if squeeze else (vals, idx)


class TopKOperation(Operation):
    """Top ``k`` values along ``reduced_dim`` and their indices; ``k_dim=None`` means k = 1 with no k dim.

    Outputs: values ``x.shape - reduced_dim + [k_dim]`` (x's dtype) and indices (int64), same shape.
    """

    def __init__(self, x: Tensor, reduced_dim, k_dim=None, name=None):
        super().__init__([x], name=name or ("top_k" if k_dim is not None else "top_1"))
        reduced_dim = resolve_dim(x, reduced_dim, f"top_k {self.name!r}")
        if k_dim is not None:
            k_dim = convert_to_dimension(k_dim)
            if k_dim.name in x.shape:
                raise ShapeError(f"top_k {self.name!r}: k_dim {k_dim} must be a new dimension name, but x "
                                 f"{x.name!r} {x.shape} already has {k_dim.name!r}.")
            if k_dim.size > reduced_dim.size:
                raise ShapeError(f"top_k {self.name!r}: k_dim {k_dim} is larger than the reduced dimension "
                                 f"{reduced_dim} of {x.name!r}.")
            self.unsplittable_dims = (k_dim.name,)
        if x.dtype == torch.bool or x.dtype.is_complex:
            raise TypeError(f"top_k {self.name!r}: x {x.name!r} must be real numbers, got {x.dtype}.")
        self.reduced_dim, self.k_dim = reduced_dim, k_dim
        self.k = 1 if k_dim is None else k_dim.size
        shape = x.shape - reduced_dim.name
        if k_dim is not None:
            shape = shape + [k_dim]
        self.outputs = [Tensor(self, shape, x.dtype), Tensor(self, shape, torch.int64, index=1)]

    def gradient(self, grad_ys):
        dv = grad_ys[0]
        if dv is None:
            return [None]
        x = self.inputs[0]
        mapping = one_hot(self.outputs[1], self.reduced_dim, dtype=dv.dtype, name=f"{self.name}_grad_onehot")
        return [einsum([dv, mapping], output_shape=x.shape, name=f"{self.name}_grad")]

    def lower(self, lw):
        x = self.inputs[0]
        values, indices = self.outputs
        r = x.shape.get_dim_index(self.reduced_dim.name)
        axis = lw.tensor_layout(x)[r]
        local = lw.slice_shape(x)
        k, squeeze = self.k, self.k_dim is None
        xslot = lw.get(x)
        if axis is None:
            f = functools.partial(_k_max, dim=r) if squeeze else functools.partial(_k_topk_last, dim=r, k=k)
            v, i = lw.slicewise(f, xslot, num_outputs=2)
            lw.set(values, v)
            lw.set(indices, i)
            return
        kk = min(k, local[r])
        layout = lw.tensor_layout(x)
        begins = lw.pnum_constant(x, functools.partial(slice_begin, sizes=tuple(x.shape.to_integer_list()),
                                                       layout=tuple(layout), dim=r))
        v, i = lw.slicewise(functools.partial(_k_local_top, dim=r, kk=kk), xslot, begins, num_outputs=2)
        cand = local[:r] + local[r + 1:] + [kk]  # each processor's candidates
        last = len(local) - 1
        v = lw.all_gather(v, axis, last, values, local_shape=cand)
        i = lw.all_gather(i, axis, last, indices, local_shape=cand)
        v, i = lw.slicewise(functools.partial(_k_merge, k=k, squeeze=squeeze), v, i, num_outputs=2)
        lw.set(values, v)
        lw.set(indices, i)


def top_k(x: Tensor, reduced_dim, k_dim, name=None):
    """The ``k_dim.size`` largest values along ``reduced_dim`` and their indices (Mesh TF ``mtf.top_k``).

    Args:
        x: real Tensor. reduced_dim: a dim of x (Dimension or name).
        k_dim: a new Dimension whose size is k (<= reduced_dim.size); it may not be split.

    Returns:
        ``(values, indices)``, both of shape ``x.shape - reduced_dim + [k_dim]``: values in
        descending order (x's dtype), indices into ``reduced_dim`` (int64). Gradient of values:
        ``dy`` scattered to the selected positions.

    Raises:
        ShapeError: if x lacks ``reduced_dim``, ``k_dim`` is too large or not a new name.
        LayoutError (at lowering): if the layout splits ``k_dim``.
    """
    op = TopKOperation(x, reduced_dim, k_dim, name)
    return op.outputs[0], op.outputs[1]


def top_1(x: Tensor, reduced_dim, name=None):
    """``(max, argmax)`` along ``reduced_dim`` (Mesh TF ``mtf.top_1``): shape ``x.shape - reduced_dim``.

    The first (lowest-index) maximum under every layout, as ``torch.max(x, dim)``.
    """
    op = TopKOperation(x, reduced_dim, None, name)
    return op.outputs[0], op.outputs[1]


def argmax(x: Tensor, reduced_dim, name=None) -> Tensor:
    """Index of the first maximum along ``reduced_dim`` (int64; Mesh TF ``mtf.argmax``, ``torch.argmax``)."""
    return top_1(x, reduced_dim, name or "argmax")[1]


def nth_largest_element(x: Tensor, n: int, reduced_dim, name=None) -> Tensor:
    """The ``n``-th largest value along ``reduced_dim``, zero-indexed (Mesh TF ``mtf.nth_largest_element``).

    ``top_k`` with k = n + 1, then the last value. Shape ``x.shape - reduced_dim``, x's dtype.

    Raises:
        ValueError: if ``n`` is negative. ShapeError: if ``n >= reduced_dim.size``.
    """
    if int(n) != n or n < 0:
        raise ValueError(f"nth_largest_element: n must be a non-negative int, got {n!r}.")
    n = int(n)
    reduced = resolve_dim(x, reduced_dim, "nth_largest_element")
    k_dim = Dimension(f"_{reduced.name}_top{n + 1}", n + 1)
    values, _ = top_k(x, reduced, k_dim, name=name or "nth_largest")
    return gather(values, n, k_dim)


nth_largest = nth_largest_element


def sample_with_temperature(logits: Tensor, dim, temperature: float = 1.0, name=None) -> Tensor:
    """Sample an index along ``dim`` from ``softmax(logits / temperature)`` (Mesh TF ``mtf.sample_with_temperature``).

    Gumbel-max: ``argmax(logits + temperature * g)`` with ``g = -log(-log(u))`` and ``u`` from
    :func:`~meshtorch.ops.random.random_uniform` on ``[1e-9, 1)`` (as Mesh TF), so the samples
    are identical under every layout and fresh at every run. ``temperature == 0`` is argmax.

    Returns:
        int64 Tensor of ``logits.shape - dim``.
    """
    dim = resolve_dim(logits, dim, "sample_with_temperature")
    if temperature < 0:
        raise ValueError(f"sample_with_temperature: temperature must be >= 0, got {temperature}.")
    x = logits
    if temperature != 0.0:
        u = random_uniform(logits.mesh, logits.shape, minval=1e-9, maxval=1.0, dtype=logits.dtype,
                           name=f"{name or 'sample'}_gumbel")
        g = ew.negative(ew.log(ew.negative(ew.log(u))))
        x = logits + g * float(temperature)
    return argmax(x, dim, name=name or "sample")

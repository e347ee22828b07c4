"""Reshape, rename_dimension, replace_dimensions and transpose (Mesh TF ``mtf.reshape`` and friends).

Lowering of a reshape (Mesh TF ``ReshapeOperation.lower``, extended). A reshape reads the
tensor in row-major order, so what matters for a mesh axis ``a`` of size n is the *cumprod* of
the dimension it splits: the product of the sizes of the dimensions before it. Processor k on
``a`` then holds, inside every block of that many leading elements, the k-th n-th of it; two
layouts with the same cumprod for ``a`` hold the same elements. Per mesh axis:

* **free**: split at the same cumprod before and after (e.g. a kept dim, or ``[b, h]`` ->
  ``[b, h1, h2]`` with h and h1 split): a local reshape, no communication;
* **local slice**: split only after the reshape: each processor keeps its piece (no
  communication), before the reshape when the input has a dim at that cumprod, else after it;
* **all-gather**: split only before the reshape;
* **all-to-all**: split at different cumprods before and after, both on the same mesh axis:
  one all-to-all, before the local reshape when the input has a dim at the new cumprod,
  else after it when the output has one at the old cumprod.

Where Mesh TF raises "Try first reshaping to insert a new tf dimension" (the split moves to a
cumprod at which neither shape has a dim divisible by the mesh-axis size, e.g. a split dim
merged with a preceding dim: ``[a:2, b:8]`` with b split 4 ways -> ``[c:16]`` with c split),
we lower it correctly instead: all-gather before the local reshape, then a local slice after it
(the bytes of an all-gather rather than an all-to-all).
"""

from __future__ import annotations

import functools

from meshtorch.core.dims import Dimension, Shape, convert_to_dimension, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor

__all__ = ["reshape", "rename_dimension", "replace_dimensions", "transpose", "ReshapeOperation", "TransposeOperation"]


def _k_reshape(t, *, shape):
    return t.reshape(shape)


def _k_permute(t, *, perm):
    return t.permute(perm)


def _k_permute_copy(t, *, perm):
    return t.permute(perm).contiguous()


_k_permute_copy.fresh_outputs = True  # a new tensor (meshtorch.lowering.donate)


def _cumprods(shape: Shape) -> list[int]:
    out, c = [], 1
    for d in shape:
        out.append(c)
        c *= d.size
    return out


def plan_reshape(impl, old: Shape, new: Shape, lo, ln):
    """Intermediate layouts ``(mid_old, mid_new)`` for a reshape from ``old`` (layout ``lo``) to ``new`` (``ln``).

    The input goes ``lo -> mid_old`` (redistributed on the old shape), is reshaped locally (``mid_old``
    and ``mid_new`` split every mesh axis at the same cumprod), then goes ``mid_new -> ln``.
    """
    co, cn = _cumprods(old), _cumprods(new)
    size = {a: impl.shape[a].size for a in range(impl.ndims)}
    po = {a: co[i] for i, a in enumerate(lo) if a is not None and size[a] > 1}
    pn = {a: cn[i] for i, a in enumerate(ln) if a is not None and size[a] > 1}

    def has_dim(shape, cum, c, n):
        return any(cc == c and d.size % n == 0 for cc, d in zip(cum, shape, strict=True))

    mid: dict[int, int] = {a: c for a, c in po.items() if pn.get(a) == c}  # free
    for a, c in pn.items():  # slice or all-to-all before the local reshape
        if a not in mid and has_dim(old, co, c, size[a]) and c not in mid.values():
            mid[a] = c
    for a, c in po.items():  # all-to-all after the local reshape
        if a not in mid and a in pn and has_dim(new, cn, c, size[a]) and c not in mid.values():
            mid[a] = c

    def layout(shape, cum):
        out = [None] * len(shape)
        for a, c in mid.items():
            out[next(i for i, (cc, d) in enumerate(zip(cum, shape, strict=True))
                     if cc == c and d.size % size[a] == 0)] = a
        return tuple(out)
    return layout(old, co), layout(new, cn)


class ReshapeOperation(Operation):
    """Reinterpret ``x`` (row-major) as ``new_shape`` (same number of elements)."""

    def __init__(self, x: Tensor, new_shape, name=None):
        super().__init__([x], name=name or "reshape")
        new_shape = convert_to_shape(new_shape)
        if new_shape.size != x.shape.size:
            raise ShapeError(f"reshape {self.name!r}: tensor {x.name!r} {x.shape} has {x.shape.size} elements, "
                             f"but the new shape {new_shape} has {new_shape.size}.")
        self.outputs = [Tensor(self, new_shape, x.dtype)]

    def lower(self, lw):
        x, out = self.inputs[0], self.outputs[0]
        impl = lw.mesh_spec(self)
        lo, ln = tuple(lw.tensor_layout(x)), tuple(lw.tensor_layout(out))
        mid_old, mid_new = plan_reshape(impl, x.shape, out.shape, lo, ln)
        slot, partial = lw.get_lazy(x)
        used = {a for a in lo + ln if a is not None}
        # a partial sum over an axis the layouts split is reduced here (a reduce-scatter where the
        # split happens before the local reshape); the others stay lazy through the reshape
        pending = partial - used
        slot = lw.redistribute(slot, x, lo, mid_old, partial, pending)
        before = impl.slice_shape(x.shape, mid_old)
        after = impl.slice_shape(out.shape, mid_new)
        if before != after:
            slot = lw.slicewise(functools.partial(_k_reshape, shape=tuple(after)), slot)
        slot = lw.redistribute(slot, out, mid_new, ln)
        lw.set(out, slot, pending)

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        return [None if dy is None else reshape(dy, self.inputs[0].shape, name=f"{self.name}_grad")]


def reshape(x: Tensor, new_shape, name=None) -> Tensor:
    """``x`` read in row-major order as ``new_shape`` (Mesh TF ``mtf.reshape``).

    Args:
        x: Tensor.
        new_shape: Shape (or anything ``convert_to_shape`` reads) with ``x.shape.size`` elements.

    Returns:
        Tensor of ``new_shape``, ``x``'s dtype. Communication per mesh axis: none, a local slice,
        an all-gather or an all-to-all (see the module docstring); unlike Mesh TF, no layout is
        rejected.

    Raises:
        ShapeError: naming ``x``, if the number of elements differs.
    """
    new_shape = convert_to_shape(new_shape)
    if new_shape == x.shape and name is None:
        return x
    return ReshapeOperation(x, new_shape, name).outputs[0]


def rename_dimension(x: Tensor, old_name: str, new_name: str, name=None) -> Tensor:
    """``x`` with dimension ``old_name`` renamed ``new_name`` (Mesh TF ``mtf.rename_dimension``).

    A reshape: free when both names have the same layout, else an all-gather, a local slice or an
    all-to-all over the mesh axes involved.

    Raises:
        ShapeError: if ``x`` has no ``old_name`` or already has another dim called ``new_name``.
    """
    if old_name not in x.shape:
        raise ShapeError(f"rename_dimension: tensor {x.name!r} {x.shape} has no dimension {old_name!r}.")
    return reshape(x, x.shape.rename_dimension(old_name, new_name), name=name or "rename_dimension")


def replace_dimensions(tensor_or_shape, old_dim_or_dims, new_dim_or_dims):
    """Replace dims ``old_dim_or_dims`` (consecutive, in order) by ``new_dim_or_dims``.

    Mesh TF ``mtf.replace_dimensions``: given a Shape, returns the new Shape; given a Tensor,
    returns it reshaped to that shape.

    Raises:
        ShapeError: if the old dims are not in the shape, or are not consecutive and in order.
    """
    is_tensor = isinstance(tensor_or_shape, Tensor)
    shape = tensor_or_shape.shape if is_tensor else convert_to_shape(tensor_or_shape)
    old = _dims(old_dim_or_dims)
    new = _dims(new_dim_or_dims)
    what = tensor_or_shape.name if is_tensor else str(shape)
    for d in old:
        if d not in shape.dims:
            raise ShapeError(f"replace_dimensions: {what!r} {shape} has no dimension {d}.")
    positions = [shape.dims.index(d) for d in old]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise ShapeError(f"replace_dimensions: dimensions {[str(d) for d in old]} are not consecutive and in order "
                         f"in {what!r} {shape}.")
    p = positions[0]
    new_shape = Shape(list(shape.dims[:p]) + new + list(shape.dims[p + len(old):]))
    return reshape(tensor_or_shape, new_shape) if is_tensor else new_shape


def _dims(d) -> list[Dimension]:
    if isinstance(d, Shape):
        return list(d.dims)
    if isinstance(d, Dimension) or (isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], str)
                                     and isinstance(d[1], int)):
        return [convert_to_dimension(d)]
    if isinstance(d, str) and ":" in d and "," not in d and ";" not in d:
        return [convert_to_dimension(d)]
    if isinstance(d, str):
        return list(convert_to_shape(d).dims)
    return [convert_to_dimension(x) for x in d]


class TransposeOperation(Operation):
    """``x`` with its dims permuted to ``new_shape``'s order: a local ``permute`` (a dim keeps its split)."""

    partial_sums = "first"  # a permutation: a partial sum stays partial

    def __init__(self, x: Tensor, new_shape: Shape, name=None, copy: bool = False):
        super().__init__([x], name=name or "transpose")
        self.copy = copy
        if sorted(new_shape.dims) != sorted(x.shape.dims):
            raise ShapeError(f"transpose {self.name!r}: {new_shape} is not a permutation of the dims of {x.name!r} "
                             f"{x.shape}.")
        self.perm = [x.shape.get_dim_index(d.name) for d in new_shape]
        self.outputs = [Tensor(self, new_shape, x.dtype)]

    def lower(self, lw):
        (slot,), pending = lw.inputs(self)
        perm = self.perm
        kernel = _k_permute_copy if self.copy else _k_permute
        lw.set(self.outputs[0], lw.slicewise(functools.partial(kernel, perm=tuple(perm)), slot), pending)

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        return [None if dy is None else transpose(dy, self.inputs[0].shape, name=f"{self.name}_grad")]


def transpose(x: Tensor, new_shape, name=None, copy: bool = False) -> Tensor:
    """``x`` with its dims permuted to ``new_shape``'s order (Mesh TF ``mtf.transpose``).

    A local permute under every layout (a dim keeps its split); no communication. Mesh TF builds
    it as a one-operand einsum; here it is its own op so that it adds no einsum FLOPs to the counters.
    ``copy``: each slice is a new contiguous tensor in the new order (``permute().contiguous()``), not a
    strided view; e.g. a weight kept in the order a matmul reads fastest.

    Raises:
        ShapeError: naming ``x``, if ``new_shape`` is not a permutation of its dims.
    """
    new_shape = convert_to_shape(new_shape)
    if new_shape == x.shape and name is None and not copy:
        return x
    return TransposeOperation(x, new_shape, name, copy).outputs[0]

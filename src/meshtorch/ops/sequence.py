"""Ops along one (often sequence) dimension: shift, cumsum and range (Mesh TF ``mtf.shift``,
``mtf.cumsum``, ``mtf.range``). Re-exported by :mod:`meshtorch.ops.shape`.

Lowering when the dimension is split over mesh axis ``a`` (n processors, blocks of b = size/n):

* shift by ``offset = q*b + r`` (0 <= r < b): in processor c's output block, positions [r, b)
  are the first b - r elements of input block c - q and positions [0, r) the last r elements
  of block c - q - 1 (modulo n with ``wrap``, else zeros off the end). Each part moves by one
  ``lw.collective_permute`` (a neighbour exchange) carrying only those elements, so a shift by less than a
  block sends just the r boundary elements; nothing moves for parts that stay on the processor.
  Mesh TF handles only |offset| <= b here.
* cumsum: a local ``torch.cumsum`` (linear work), an all-gather of each slice's total (n numbers
  per row), and the sum of the totals of the preceding blocks added locally. Mesh TF builds an
  n x n mask and an einsum (quadratic work).
* range: each processor creates its block from its offset (``lw.pnum_constant``).
"""

from __future__ import annotations

import builtins
import functools

import torch

from meshtorch.core.dims import convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Mesh, Operation, Tensor
from meshtorch.ops._kernels import cat, narrow, slice_begin
from meshtorch.ops._relayout import coordinate_constant

__all__ = ["shift", "cumsum", "mtf_range", "range", "ShiftOperation", "CumsumOperation", "RangeOperation"]


def _dim_index(x: Tensor, dim, what: str) -> tuple[str, int]:
    name = dim if isinstance(dim, str) else convert_to_dimension(dim).name
    if name not in x.shape:
        raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {name!r}.")
    if not isinstance(dim, str) and convert_to_dimension(dim) != x.shape.get_dim_by_name(name):
        raise ShapeError(f"{what}: dimension {dim} does not match {x.shape.get_dim_by_name(name)} of {x.name!r}.")
    return name, x.shape.get_dim_index(name)


def _shift_local(t: torch.Tensor, offset: int, axis: int, wrap: bool) -> torch.Tensor:
    n = t.shape[axis]
    if wrap:
        return torch.roll(t, offset % n, dims=axis)
    if abs(offset) >= n:
        return torch.zeros_like(t)
    if offset == 0:
        return t
    shape = list(t.shape)
    shape[axis] = abs(offset)
    z = t.new_zeros(shape)
    if offset > 0:
        return torch.cat([z, t.narrow(axis, 0, n - offset)], dim=axis)
    return torch.cat([t.narrow(axis, -offset, n + offset), z], dim=axis)


def _k_cumsum_local(t: torch.Tensor, *, axis: int, exclusive: bool, reverse: bool) -> torch.Tensor:
    """Running sum of a slice along ``axis`` (inclusive or exclusive, from the start or the end)."""
    ax = axis
    c = t.flip(ax).cumsum(ax).flip(ax) if reverse else t.cumsum(ax)
    if exclusive:
        n = t.shape[ax]
        shape = list(t.shape)
        shape[ax] = 1
        z = t.new_zeros(shape)
        c = torch.cat([c.narrow(ax, 1, n - 1), z], ax) if reverse else torch.cat([z, c.narrow(ax, 0, n - 1)], ax)
    return c


def _k_sum_keepdim(t: torch.Tensor, *, axis: int) -> torch.Tensor:
    return t.sum(axis, keepdim=True)


def _k_add_prefix(c_local: torch.Tensor, g: torch.Tensor, coord: int, *, axis: int, n: int,
                  reverse: bool) -> torch.Tensor:
    """Add to a local cumsum the totals ``g`` (all ``n`` blocks') of the blocks before ``coord``."""
    before = g.narrow(axis, coord + 1, n - coord - 1) if reverse else g.narrow(axis, 0, coord)
    return c_local + before.sum(axis, keepdim=True)


def _k_range_block(impl, pnum: int, *, sizes, layout, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Processor ``pnum``'s block ``[b, b + n)`` of a range laid out as ``layout``."""
    b = slice_begin(impl, pnum, sizes, layout, 0)
    return torch.arange(b, b + n, device=impl.device(pnum)).to(dtype)


class ShiftOperation(Operation):
    """``out[i] = x[i - offset]`` along ``dim``; wrapped around or zero-filled."""

    partial_sums = "first"  # linear: a partial sum stays partial

    def __init__(self, x: Tensor, offset: int, dim, wrap: bool, name=None):
        super().__init__([x], name=name or "shift")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise TypeError(f"shift {self.name!r}: offset must be a Python int, got {offset!r}.")
        self.dim_name, self.axis = _dim_index(x, dim, f"shift {self.name!r}")
        self.offset, self.wrap = offset, bool(wrap)
        self.outputs = [Tensor(self, x.shape, x.dtype)]

    def lower(self, lw):
        x, out = self.inputs[0], self.outputs[0]
        ax, wrap = self.axis, self.wrap
        (slot,), pending = lw.inputs(self)
        a = lw.tensor_layout(x)[ax]
        impl = lw.mesh_spec(self)
        n = impl.shape[a].size if a is not None else 1
        size = x.shape[ax].size
        offset = self.offset % size if wrap else self.offset
        if n == 1:
            lw.set(out, lw.slicewise(functools.partial(_shift_local, offset=offset, axis=ax, wrap=wrap), slot), pending)
            return
        if not wrap and abs(offset) >= size:
            lw.set(out, lw.slicewise(torch.zeros_like, slot), pending)
            return
        blk = size // n
        q, r = divmod(offset, blk)
        local = lw.slice_shape(x)

        if r == 0:
            lw.set(out, _move(lw, slot, a, n, q, wrap, x, list(local)), pending)
            return
        # head -> positions [r, blk) of block c + q; tail -> positions [0, r) of block c + q + 1
        head = lw.slicewise(functools.partial(narrow, dim=ax, start=0, length=blk - r), slot)
        tail = lw.slicewise(functools.partial(narrow, dim=ax, start=blk - r, length=r), slot)
        local_head = list(local)
        local_head[ax] = blk - r
        local_tail = list(local)
        local_tail[ax] = r
        head = _move(lw, head, a, n, q, wrap, x, list(local_head))
        tail = _move(lw, tail, a, n, q + 1, wrap, x, list(local_tail))
        lw.set(out, lw.slicewise(functools.partial(cat, dim=ax), tail, head), pending)

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        return [shift(dy, -self.offset, self.dim_name, self.wrap, name=f"{self.name}_grad")]


def _move(lw, part: int, a: int, n: int, procs: int, wrap: bool, t: Tensor, local_shape) -> int:
    """Processor c on mesh axis ``a`` gets ``part`` of processor c - procs (wrapped, or zeros off the end)."""
    src = [((c - procs) % n) if wrap else (c - procs if 0 <= c - procs < n else None) for c in builtins.range(n)]
    if src == list(builtins.range(n)):
        return part
    if all(s is None for s in src):
        return lw.slicewise(torch.zeros_like, part)
    return lw.collective_permute(part, a, src, t, local_shape=local_shape)


def shift(x: Tensor, offset: int, dim, wrap: bool, name=None) -> Tensor:
    """Shift ``x`` by ``offset`` along ``dim``: ``out[i] = x[i - offset]`` (Mesh TF ``mtf.shift``).

    Args:
        offset: int; negative shifts the other way.
        dim: Dimension or name of ``x``.
        wrap: True: rotate (``torch.roll``); False: fill with zeros.

    Returns:
        Tensor of ``x.shape`` and dtype. Layouts: all. A split ``dim`` costs one or two collective-permutes
        (neighbour exchanges) of boundary elements, none of the whole slice for small offsets.

    Raises:
        ShapeError: naming ``x``, if it lacks ``dim``; TypeError: a non-int offset.
    """
    return ShiftOperation(x, offset, dim, wrap, name).outputs[0]


class CumsumOperation(Operation):
    """Inclusive or exclusive running sum along ``dim``; ``reverse`` sums from the end."""

    partial_sums = "first"  # linear: a partial sum stays partial

    def __init__(self, x: Tensor, dim, exclusive: bool = False, reverse: bool = False, name=None):
        super().__init__([x], name=name or "cumsum")
        self.dim_name, self.axis = _dim_index(x, dim, f"cumsum {self.name!r}")
        self.exclusive, self.reverse = bool(exclusive), bool(reverse)
        self.outputs = [Tensor(self, x.shape, x.dtype)]

    def lower(self, lw):
        x, out = self.inputs[0], self.outputs[0]
        ax, excl, rev = self.axis, self.exclusive, self.reverse
        (slot,), pending = lw.inputs(self)
        res = lw.slicewise(functools.partial(_k_cumsum_local, axis=ax, exclusive=excl, reverse=rev), slot)
        a = lw.tensor_layout(x)[ax]
        impl = lw.mesh_spec(self)
        if a is None or impl.shape[a].size == 1:
            lw.set(out, res, pending)
            return
        n = impl.shape[a].size
        totals = lw.slicewise(functools.partial(_k_sum_keepdim, axis=ax), slot)
        tshape = list(lw.slice_shape(x))
        tshape[ax] = 1
        gathered = lw.all_gather(totals, a, ax, x, local_shape=tshape)  # n totals per row: small
        add_prefix = functools.partial(_k_add_prefix, axis=ax, n=n, reverse=rev)
        lw.set(out, lw.slicewise(add_prefix, res, gathered, coordinate_constant(lw, x, a)), pending)

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        return [cumsum(dy, self.dim_name, self.exclusive, reverse=not self.reverse, name=f"{self.name}_grad")]


def cumsum(x: Tensor, dim, exclusive: bool = False, reverse: bool = False, name=None) -> Tensor:
    """Running sum along ``dim`` (Mesh TF ``mtf.cumsum``; ``torch.cumsum``).

    Args:
        dim: Dimension or name of ``x``.
        exclusive: out[i] = sum of x[j] for j < i (inclusive: j <= i).
        reverse: sum from the end instead (j > i, or j >= i); an extension of Mesh TF's API,
            used by the gradient (the gradient of a cumsum is the reverse cumsum).

    Returns:
        Tensor of ``x.shape`` and dtype. Layouts: all. A split ``dim`` costs an all-gather of one
        total per slice row (size / block-size smaller than the tensor), not of ``x``.

    Raises:
        ShapeError: naming ``x``, if it lacks ``dim``.
    """
    return CumsumOperation(x, dim, exclusive, reverse, name).outputs[0]


class RangeOperation(Operation):
    """``[0, 1, ..., dim.size - 1]`` along ``dim``."""

    def __init__(self, mesh: Mesh, dim, dtype, name=None):
        super().__init__([], mesh, name=name or "range")
        self.dim = convert_to_dimension(dim)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"range {self.name!r}: dtype must be a torch.dtype, got {dtype!r}.")
        self.outputs = [Tensor(self, [self.dim], dtype)]

    differentiable = False

    def lower(self, lw):
        out = self.outputs[0]
        block = functools.partial(_k_range_block, sizes=tuple(out.shape.to_integer_list()),
                                  layout=tuple(lw.tensor_layout(out)), n=lw.slice_shape(out)[0], dtype=out.dtype)
        lw.set(out, lw.pnum_constant(out, block))


def mtf_range(mesh: Mesh, dim, dtype=torch.int64, name=None) -> Tensor:
    """``0 .. dim.size - 1`` along ``dim`` (Mesh TF ``mtf.range`` / ``mtf_range``).

    Each processor creates its own block from its offset; no communication. No gradient.

    Returns:
        Tensor of shape ``[dim]`` and ``dtype`` (default int64; Mesh TF requires the dtype).
    """
    return RangeOperation(mesh, dim, dtype, name).outputs[0]


range = mtf_range  # noqa: A001 - Mesh TF's name

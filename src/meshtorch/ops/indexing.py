"""Indexing: one_hot, gather (a real per-slice lookup) and its transpose, scatter-add.

Selection by value (top_k, top_1, argmax, nth_largest_element, sample_with_temperature) lives in
:mod:`meshtorch.ops.selection` (built on gather and one_hot here).

gather lowering (Mesh TF writes ``gather`` as ``einsum([one_hot(indices, dim), weights])``, which
costs ``|indices| * |dim| * |rest|`` multiply-adds; here each processor looks its indices up in
its own slice with ``index_select``):

* ``dim`` not split: a local lookup, no communication;
* ``dim`` split over mesh axis ``a``: each processor looks up the indices that fall in its range
  ``[begin, begin + n/|a|)`` and writes zeros for the others; the output is a lazy (deferred)
  sum over ``a``: one all-reduce when a consumer needs it, none if it is summed further;
* if ``a`` also splits a dim of ``indices``, the weights are all-gathered along ``dim`` first
  (as einsum does when one mesh axis splits different dims in different operands).

The gradient w.r.t. ``weights`` is :class:`ScatterAddOperation` (``index_add`` into each
processor's range); indices split over a mesh axis leave a lazy sum over that axis.
Indices outside ``[0, dim.size)`` select zeros (Mesh TF's one_hot semantics), under every layout.
"""

from __future__ import annotations

import functools
import math

import torch

from meshtorch.core.dims import Shape, combine_shapes, convert_to_dimension, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._kernels import slice_begin, value_of
from meshtorch.ops.variables import constant

__all__ = ["one_hot", "OneHotOperation", "gather", "GatherOperation", "scatter_add", "ScatterAddOperation"]


class OneHotOperation(Operation):
    """``indices.shape + [output_dim]``: ``on_value`` where the index equals the position."""

    def __init__(self, indices: Tensor, output_dim, on_value, off_value, dtype, name=None):
        super().__init__([indices], name=name or "one_hot")
        output_dim = convert_to_dimension(output_dim)
        if output_dim.name in indices.shape:
            raise ShapeError(f"one_hot {self.name!r}: indices {indices.name!r} {indices.shape} already have a "
                             f"dimension named {output_dim.name!r}.")
        if indices.dtype.is_floating_point:
            raise TypeError(f"one_hot {self.name!r}: indices {indices.name!r} must be integers, got {indices.dtype}.")
        self.on_value, self.off_value = on_value, off_value
        self.output_dim = output_dim
        self.outputs = [Tensor(self, indices.shape + [output_dim], dtype)]

    differentiable = False

    def lower(self, lw):
        out = self.outputs[0]
        n = lw.slice_shape(out)[-1]
        begins = _dim_begin_constant(lw, out, out.shape.ndims - 1)
        f = functools.partial(_k_one_hot, n=n, on=self.on_value, off=self.off_value, dtype=out.dtype)
        lw.set(out, lw.slicewise(f, lw.get(self.inputs[0]), begins))


def _k_one_hot(idx, begin, *, n, on, off, dtype):
    positions = torch.arange(begin, begin + n, device=idx.device)
    hit = idx.unsqueeze(-1) == positions
    if on == 1 and off == 0:
        return hit.to(dtype)
    return torch.where(hit, torch.tensor(on, dtype=dtype), torch.tensor(off, dtype=dtype))


def one_hot(indices: Tensor, output_dim, on_value=1.0, off_value=0.0, dtype=torch.float32, name=None) -> Tensor:
    """One-hot encoding along a new dim ``output_dim`` (may be split; no communication).

    Args:
        indices: integer Tensor of any named shape.
        output_dim: the new Dimension (its size is the number of classes).

    Returns:
        Tensor of ``indices.shape + [output_dim]``, ``dtype``. Out-of-range indices give all off.
    """
    return OneHotOperation(indices, output_dim, on_value, off_value, dtype, name).outputs[0]


def resolve_dim(x: Tensor, dim, what: str):
    """The Dimension of ``x`` named by ``dim`` (a name, Dimension, pair or ``"name:size"``).

    Raises:
        ShapeError: naming ``x`` if it lacks the dim or has it with another size.
    """
    if isinstance(dim, str) and ":" not in dim:
        if dim not in x.shape:
            raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {dim!r}.")
        return x.shape.get_dim_by_name(dim)
    dim = convert_to_dimension(dim)
    if dim.name not in x.shape or x.shape.get_dim_by_name(dim.name).size != dim.size:
        raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {dim}.")
    return dim


class _LookupPlan:
    """Dim bookkeeping shared by gather and scatter-add.

    ``shared`` dims are in both weights and indices (a batched lookup), ``idx_only`` only in the
    indices, ``rest`` the weights' dims other than ``dim`` and ``shared``. The lookup works on
    ``weights`` as ``[shared, dim, rest]`` and ``indices`` as ``[shared, idx_only]``; its result is
    ``[shared, idx_only, rest]`` ("natural" order).
    """

    def __init__(self, wshape: Shape, ishape: Shape, dim):
        self.dim = dim
        self.shared = [d.name for d in wshape if d.name in ishape]
        self.idx_only = [d.name for d in ishape if d.name not in wshape]
        self.rest = [d.name for d in wshape if d.name != dim.name and d.name not in ishape]
        self.natural = self.shared + self.idx_only + self.rest
        wn, inn = list(wshape.dimension_names), list(ishape.dimension_names)
        self.w_perm = [wn.index(n) for n in self.shared + [dim.name] + self.rest]
        self.w_inv = [self.w_perm.index(i) for i in range(len(wn))]
        self.i_perm = [inn.index(n) for n in self.shared + self.idx_only]

    def default_output(self, wshape: Shape, ishape: Shape) -> Shape:
        return Shape(list(ishape) + [wshape.get_dim_by_name(n) for n in self.rest])

    def perm_from(self, names) -> list[int]:
        names = list(names)
        return [names.index(n) for n in self.natural]

    def perm_to(self, names) -> list[int]:
        return [self.natural.index(n) for n in names]


def _local_positions(idx: torch.Tensor, begin: int, n: int, nb: int):
    """(flat row index into a ``[B * n, R]`` table, valid mask) for indices ``idx`` of shape [B, S]."""
    loc = idx.to(torch.int64) - begin
    valid = (loc >= 0) & (loc < n)
    rows = torch.where(valid, loc, torch.zeros((), dtype=torch.int64, device=loc.device))
    rows = rows + (torch.arange(nb, device=loc.device, dtype=torch.int64) * n).unsqueeze(1)
    return rows.reshape(-1), valid


def _dim_begin_constant(lw, t: Tensor, pos: int) -> int:
    """A slot holding the global index where each processor's slice of ``t`` starts along dim ``pos``."""
    return lw.pnum_constant(t, functools.partial(slice_begin, sizes=tuple(t.shape.to_integer_list()),
                                                 layout=tuple(lw.tensor_layout(t)), dim=pos))


class GatherOperation(Operation):
    """``out[shared, idx_only, rest] = weights[shared, indices[shared, idx_only], rest]`` (see module doc)."""

    partial_sums = "first"  # linear in the weights

    def __init__(self, weights: Tensor, indices: Tensor, dim, output_shape=None, name=None):
        super().__init__([weights, indices], name=name or "gather")
        dim = resolve_dim(weights, dim, f"gather {self.name!r}")
        if indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise TypeError(f"gather {self.name!r}: indices {indices.name!r} must be integers, got {indices.dtype}.")
        if dim.name in indices.shape:
            raise ShapeError(f"gather {self.name!r}: indices {indices.name!r} {indices.shape} have the gathered "
                             f"dimension {dim.name!r}; rename it in the indices.")
        combine_shapes([weights.shape, indices.shape], f"gather {self.name!r}")
        self.dim = dim
        self.plan = _LookupPlan(weights.shape, indices.shape, dim)
        default = self.plan.default_output(weights.shape, indices.shape)
        if output_shape is None:
            shape = default
        else:
            shape = convert_to_shape(output_shape)
            if set(shape.dims) != set(default.dims) or len(shape) != len(default):
                raise ShapeError(f"gather {self.name!r}: output_shape {shape} must hold exactly the dims {default} "
                                 f"(indices dims, then the weights' dims other than {dim.name!r}).")
        self.outputs = [Tensor(self, shape, weights.dtype)]

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None, None]
        w, idx = self.inputs
        return [scatter_add(dy, idx, self.dim, w.shape, name=f"{self.name}_grad"), None]

    def lower(self, lw):
        impl = lw.mesh_spec(self)
        w, ind = self.inputs
        out = self.outputs[0]
        vpos = w.shape.get_dim_index(self.dim.name)
        v_axis = lw.tensor_layout(w)[vpos]
        ind_axes = set(lw.tensor_mesh_axes(ind))
        # partial sums over an axis that splits the indices are summed first
        (wslot, islot), pending = lw.inputs(self, blocked=ind_axes)
        n = lw.slice_shape(w)[vpos]
        if v_axis is not None and v_axis in ind_axes:
            wslot = lw.all_gather(wslot, v_axis, vpos, w)
            n *= impl.shape[v_axis].size
            v_axis = None
        begins = _dim_begin_constant(lw, w, vpos) if v_axis is not None else lw.pnum_constant(
            w, functools.partial(value_of, values=(0,) * impl.size))
        plan = self.plan
        f = functools.partial(_k_gather, w_perm=tuple(plan.w_perm), i_perm=tuple(plan.i_perm), nb=len(plan.shared),
                              n=n, out_perm=tuple(plan.perm_to(out.shape.dimension_names)))
        slot = lw.slicewise(f, wslot, islot, begins)
        lw.set(out, slot, pending | ({v_axis} if v_axis is not None else set()))


def _k_gather(weights, idx, begin, *, w_perm, i_perm, nb, n, out_perm):
    weights, idx = weights.permute(w_perm), idx.permute(i_perm)
    bshape, sshape, rshape = idx.shape[:nb], idx.shape[nb:], weights.shape[nb + 1:]
    b, s, r = math.prod(bshape), math.prod(sshape), math.prod(rshape)
    rows, valid = _local_positions(idx.reshape(b, s), begin, n, b)
    g = weights.reshape(b * n, r).index_select(0, rows)
    g = torch.where(valid.reshape(-1, 1), g, torch.zeros((), dtype=g.dtype, device=g.device))
    return g.reshape(*bshape, *sshape, *rshape).permute(out_perm)


_k_gather.fresh_outputs = True  # index_select: a new tensor (meshtorch.lowering.donate)


def _k_scatter_add(u, idx, begin, *, u_perm, i_perm, nb, n, w_inv):
    u, idx = u.permute(u_perm), idx.permute(i_perm)
    bshape, sshape = idx.shape[:nb], idx.shape[nb:]
    rshape = u.shape[len(bshape) + len(sshape):]
    b, s, r = math.prod(bshape), math.prod(sshape), math.prod(rshape)
    rows, valid = _local_positions(idx.reshape(b, s), begin, n, b)
    u = u.reshape(b * s, r)
    u = torch.where(valid.reshape(-1, 1), u, torch.zeros((), dtype=u.dtype, device=u.device))
    z = torch.zeros(b * n, r, dtype=u.dtype, device=u.device).index_add_(0, rows, u)
    return z.reshape(*bshape, n, *rshape).permute(w_inv)


_k_scatter_add.fresh_outputs = True  # a new tensor (meshtorch.lowering.donate)

class ScatterAddOperation(Operation):
    """Transpose of gather: ``out[shared, dim, rest] = sum over idx_only of updates where indices == position``.

    ``updates`` has the gather output's dims (any order); the result has ``output_shape`` (the
    gathered weights' shape), zeros where no index points.
    """

    partial_sums = "first"  # linear in the updates

    def __init__(self, updates: Tensor, indices: Tensor, dim, output_shape, name=None):
        super().__init__([updates, indices], name=name or "scatter_add")
        output_shape = convert_to_shape(output_shape)
        dim = convert_to_dimension(dim)
        if dim not in output_shape.dims:
            raise ShapeError(f"scatter_add {self.name!r}: output_shape {output_shape} lacks dimension {dim}.")
        if indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise TypeError(f"scatter_add {self.name!r}: indices {indices.name!r} must be integers.")
        self.dim = dim
        self.plan = _LookupPlan(output_shape, indices.shape, dim)
        want = self.plan.default_output(output_shape, indices.shape)
        if set(updates.shape.dims) != set(want.dims):
            raise ShapeError(f"scatter_add {self.name!r}: updates {updates.name!r} {updates.shape} must have the dims "
                             f"{want} (indices dims, then the output's dims other than {dim.name!r}).")
        self.outputs = [Tensor(self, output_shape, updates.dtype)]

    def gradient(self, grad_ys):
        dz = grad_ys[0]
        if dz is None:
            return [None, None]
        upd, idx = self.inputs
        return [gather(dz, idx, self.dim, output_shape=upd.shape), None]

    def lower(self, lw):
        upd, ind = self.inputs
        out = self.outputs[0]
        plan = self.plan
        vpos = out.shape.get_dim_index(self.dim.name)
        v_axis = lw.tensor_layout(out)[vpos]
        # updates that are partial sums over the axis splitting ``dim`` are summed first: each processor adds
        # its rows into its own slice of ``dim``, which a later all-reduce over that axis could not combine
        (uslot, islot), pending = lw.inputs(self, blocked={v_axis} - {None})
        split_idx = {a: name for name, a in zip(ind.shape.dimension_names, lw.tensor_layout(ind), strict=True)
                     if a is not None and name in plan.idx_only}
        if v_axis is not None and v_axis in split_idx:
            # the axis splitting dim also splits an indices dim: gather updates and indices along it
            name = split_idx.pop(v_axis)
            uslot = lw.all_gather(uslot, v_axis, upd.shape.get_dim_index(name), upd)
            islot = lw.all_gather(islot, v_axis, ind.shape.get_dim_index(name), ind)
        n = lw.slice_shape(out)[vpos]
        begins = _dim_begin_constant(lw, out, vpos) if v_axis is not None else lw.pnum_constant(
            out, functools.partial(value_of, values=(0,) * lw.mesh_spec(out).size))
        f = functools.partial(_k_scatter_add, u_perm=tuple(plan.perm_from(upd.shape.dimension_names)),
                              i_perm=tuple(plan.i_perm), nb=len(plan.shared), n=n, w_inv=tuple(plan.w_inv))
        slot = lw.slicewise(f, uslot, islot, begins)
        lw.set(out, slot, pending | frozenset(split_idx))


def gather(weights: Tensor, indices, dim, output_shape=None, name=None) -> Tensor:
    """Look up ``weights`` along ``dim`` at ``indices`` (Mesh TF ``mtf.gather``; an embedding lookup).

    Args:
        weights: Tensor with dimension ``dim``, any dtype. Dims it shares with ``indices`` are
            batch dims (a batched lookup, as Mesh TF's einsum formulation gives).
        indices: integer Tensor without ``dim``, or a Python int (a scalar lookup).
        dim: the dimension of ``weights`` to index (Dimension, ``"name:size"`` or name).
        output_shape: optional order of the result's dims.

    Returns:
        Tensor of ``indices.shape + (weights.shape - dim - indices' dims)`` (or ``output_shape``),
        weights' dtype. Out-of-range indices give zeros.

    Raises:
        ShapeError: if ``weights`` lacks ``dim``, the indices have it, a shared name has two sizes,
            or ``output_shape`` holds other dims. TypeError: non-integer indices.
    """
    if not isinstance(indices, Tensor):
        indices = constant(weights.mesh, int(indices), [], dtype=torch.int64, name="gather_index")
    return GatherOperation(weights, indices, dim, output_shape, name).outputs[0]


def scatter_add(updates: Tensor, indices: Tensor, dim, output_shape, name=None) -> Tensor:
    """Sum ``updates`` into a zero tensor of ``output_shape`` at ``indices`` along ``dim`` (gather's transpose).

    ``updates`` has the dims ``gather(zeros(output_shape), indices, dim)`` would have (any order).
    Follows ``torch.Tensor.index_add_`` per slice; out-of-range indices are dropped.
    """
    return ScatterAddOperation(updates, indices, dim, output_shape, name).outputs[0]


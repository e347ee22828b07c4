"""Layouts with partial sums, and the one function that moves a value between two layouts.

A :class:`Layout` is, per tensor dimension, the mesh axis that splits it (or None), plus the set of
mesh axes over which the value is still a pending partial sum (DTensor's ``Partial`` placement;
Mesh TF's lazy all-reduce). :func:`redistribute` moves a laid-out value from any layout to any
other layout of the same shape with the fewest collectives it knows:

* partial over ``a``, and the target splits dim ``j`` over ``a`` (``j`` whole now): **reduce-scatter**;
* partial over other axes: one **all-reduce** over all of them;
* split in the source only: **all-gather** along the dim;
* split on dim ``i`` in the source and ``j`` in the target: **all-to-all**;
* split in the target only: a local slice (each processor keeps its piece; no communication).

Every collective the program holds is emitted through :meth:`Planner.collective
<meshtorch.lowering.planner.Planner.collective>`, and its byte count comes from :func:`slice_nbytes`
alone, so run-time counters, ``plan_counters``, the memory report and the cost model agree by
construction.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from meshtorch.ops._kernels import processor_coordinate


class Layout(NamedTuple):
    """``axes[i]``: mesh axis index splitting tensor dim ``i`` (or None); ``partial``: mesh axes
    over which the value is a pending partial sum."""

    axes: tuple
    partial: frozenset = frozenset()

    def __str__(self):
        p = f" partial{sorted(self.partial)}" if self.partial else ""
        return f"{list(self.axes)}{p}"


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def slice_nbytes(local_shape, dtype: torch.dtype) -> int:
    """Bytes of one processor's slice of ``local_shape`` (ints) in ``dtype``: the byte accounting."""
    return math.prod(int(s) for s in local_shape) * itemsize(dtype)


def narrow_kernel(x, c, *, axis: int, piece: int):
    """Processor at coordinate ``c`` keeps piece ``c`` (of length ``piece``) of tensor axis ``axis``."""
    return x.narrow(axis, c * piece, piece)


def local_narrow(lw, slot: int, t, tensor_axis: int, mesh_axis: int, piece: int) -> int:
    """Each processor keeps its piece of ``tensor_axis`` (split over ``mesh_axis``): no communication."""
    coords = lw.pnum_constant(t, functools.partial(processor_coordinate, mesh_axis=mesh_axis))
    return lw.slicewise(functools.partial(narrow_kernel, axis=tensor_axis, piece=piece), slot, coords, mesh=t)


def redistribute(lw, slot: int, t, src: Layout, dst: Layout) -> int:
    """Move ``slot`` (``t``'s value laid out as ``src``) to layout ``dst``; returns the new slot.

    ``t`` (a graph Tensor) names the value in the collective records and gives its shape and dtype.
    If the moves between split dims form a cycle (a: i->j and b: j->i) one of them is all-gathered
    and sliced instead. Mesh axes of size 1 are ignored (splitting over them moves nothing).

    Raises:
        ValueError: if ``dst`` is partial over an axis ``src`` is not (a replicated value cannot
            become a partial sum without choosing how to divide it).
    """
    impl = lw.mesh_spec(t)
    sizes = [d.size for d in t.shape]
    nax = {a: impl.shape[a].size for a in range(impl.ndims)}
    if dst.partial - src.partial:
        raise ValueError(f"redistribute {t.name!r}: cannot make a value partial over new mesh axes "
                         f"{sorted(dst.partial - src.partial)}.")
    cur = [a if a is not None and nax[a] > 1 else None for a in src.axes]
    want = [a if a is not None and nax[a] > 1 else None for a in dst.axes]
    local = [s // (nax[a] if a is not None else 1) for s, a in zip(sizes, cur, strict=True)]
    dst_dim = {a: i for i, a in enumerate(want) if a is not None}
    reduce = sorted(a for a in src.partial - dst.partial if nax[a] > 1)
    # partial sums first: reduce-scatter straight into the target split where the dim is whole now
    for a in list(reduce):
        j = dst_dim.get(a)
        if j is not None and cur[j] is None and a not in cur:
            slot = lw.collective("reduce_scatter", slot, t, [a], local, mesh_axis=a, scatter_axis=j)
            cur[j], local[j] = a, local[j] // nax[a]
            reduce.remove(a)
    if reduce:
        slot = lw.collective("allreduce", slot, t, reduce, local, mesh_axes=tuple(reduce), reduction="SUM")

    def gather(a):
        nonlocal slot
        i = cur.index(a)
        slot = lw.collective("allgather", slot, t, [a], local, mesh_axis=a, concat_axis=i)
        cur[i], local[i] = None, sizes[i]

    src_dim = {a: i for i, a in enumerate(cur) if a is not None}
    for a in src_dim:
        if a not in dst_dim:
            gather(a)
    moves = [a for a in src_dim if a in dst_dim and dst_dim[a] != src_dim[a]]
    while moves:
        ready = [a for a in moves if cur[dst_dim[a]] is None]
        a = ready[0] if ready else moves[0]
        if ready:
            i, j = src_dim[a], dst_dim[a]
            slot = lw.collective("alltoall", slot, t, [a], local, mesh_axis=a, split_axis=j, concat_axis=i)
            cur[i], cur[j] = None, a
            local[i], local[j] = sizes[i], sizes[j] // nax[a]
        else:
            gather(a)
        moves.remove(a)
    for a, j in dst_dim.items():
        if cur[j] == a:
            continue
        assert cur[j] is None, (cur, want)
        local[j] = sizes[j] // nax[a]
        slot = local_narrow(lw, slot, t, j, a, local[j])
        cur[j] = a
    return slot

"""Layouts with partial sums, and the one pure function that plans a move between two layouts.

A :class:`Layout` is, per tensor dimension, the mesh axis that splits it (or None), plus the set of
mesh axes over which the value is still a pending partial sum (DTensor's ``Partial`` placement;
Mesh TF's lazy all-reduce). :func:`plan_redistribute` returns the list of :class:`Transform` s that
move a value of a given shape from any layout to any other layout of the same shape with the fewest
collectives it knows (as DTensor's ``_redistribute.py`` first computes its transform infos, then runs
them):

* partial over ``a``, and the target splits dim ``j`` over ``a`` (``j`` whole now): **reduce-scatter**;
* partial over other axes: one **all-reduce** over all of them;
* split in the source only: **all-gather** along the dim;
* split on dim ``i`` in the source and ``j`` in the target: **all-to-all**;
* split in the target only: a **local slice** (each processor keeps its piece; no communication).

It reads only a :class:`~meshtorch.core.mesh_spec.MeshSpec`, a shape and a dtype: no planner, no slots.
The planner emits the steps of a transform list in one place
(:meth:`Planner.apply_transforms <meshtorch.lowering.planner.Planner.apply_transforms>`) and takes each
collective's bytes from its transform (:func:`slice_nbytes` of the input slice), so run-time counters,
``plan_counters``, the memory report and the cost model (:func:`meshtorch.planning.cost.transform_time`
prices a list before it is emitted) agree by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from meshtorch.lowering.collectives import CollectiveKind, kind_of

#: the kind of a :class:`Transform` that keeps each processor's piece of a whole dimension (no communication)
LOCAL_SLICE = "local_slice"


class Layout(NamedTuple):
    """``axes[i]``: mesh axis index splitting tensor dim ``i`` (or None); ``partial``: mesh axes
    over which the value is a pending partial sum."""

    axes: tuple
    partial: frozenset = frozenset()

    def __str__(self):
        p = f" partial{sorted(self.partial)}" if self.partial else ""
        return f"{list(self.axes)}{p}"


def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype`` (read from the dtype: nothing is allocated)."""
    return dtype.itemsize


def slice_nbytes(local_shape, dtype: torch.dtype) -> int:
    """Bytes of one processor's slice of ``local_shape`` (ints) in ``dtype``: the byte accounting."""
    return math.prod(int(s) for s in local_shape) * itemsize(dtype)


def narrow_kernel(x, c, *, axis: int, piece: int):
    """Processor at coordinate ``c`` keeps piece ``c`` (of length ``piece``) of tensor axis ``axis``."""
    return x.narrow(axis, c * piece, piece)


@dataclass(frozen=True)
class Transform:
    """One step of a redistribution (see :func:`plan_redistribute`).

    Attributes:
        kind: a collective kind declared in :mod:`meshtorch.lowering.collectives` (``"allreduce"``,
            ``"reduce_scatter"``, ``"allgather"``, ``"alltoall"``) or :data:`LOCAL_SLICE`.
        mesh_axes: indices of the mesh axes it works over (one, except an all-reduce over several).
        tensor_axis: the tensor dimension it scatters (reduce-scatter), gathers (all-gather), newly splits
            (all-to-all's split axis, local slice); None for an all-reduce.
        nbytes: bytes of each processor's input slice (what the collective's record counts; 0 for a local
            slice, which moves nothing).
        layout: the value's layout after this transform.
        params: keyword arguments of the backend primitive (the kind's ``method``, e.g.
            ``(("mesh_axis", 0), ("scatter_axis", 1))``), or of :func:`narrow_kernel` for a local slice,
            as ``(name, value)`` pairs.
    """

    kind: str
    mesh_axes: tuple[int, ...]
    tensor_axis: int | None
    nbytes: int
    layout: Layout
    params: tuple = ()

    @property
    def collective(self) -> CollectiveKind | None:
        """The kind's record (:mod:`meshtorch.lowering.collectives`), None for a local slice.

        Raises:
            ValueError: the kind is neither declared nor :data:`LOCAL_SLICE`.
        """
        return None if self.kind == LOCAL_SLICE else kind_of(self.kind)[0]


def plan_redistribute(spec, shape, dtype: torch.dtype, src: Layout, dst: Layout, *,
                      name: str = "tensor") -> list[Transform]:
    """The transforms that move a value of ``shape`` and ``dtype`` laid out as ``src`` to layout ``dst``.

    Pure: reads ``spec`` (a :class:`~meshtorch.core.mesh_spec.MeshSpec`: the mesh axis sizes) and nothing
    else. ``shape``: a :class:`~meshtorch.core.dims.Shape` or the dimension sizes (ints). Applying the
    transforms in order (each collective with the backend's ``method`` and ``params``, a local slice with
    :func:`narrow_kernel` and the processor's coordinate on its mesh axis) turns every processor's
    ``src`` slice into its ``dst`` slice; the last transform's ``layout`` is ``dst`` with mesh axes of
    size 1 dropped. If the moves between split dims form a cycle (a: i->j and b: j->i) one of them is
    all-gathered and sliced instead. Mesh axes of size 1 are ignored (splitting over them moves nothing).
    An empty list: nothing to do.

    Raises:
        ValueError: naming ``name``, if ``dst`` is partial over an axis ``src`` is not (a replicated value
            cannot become a partial sum without choosing how to divide it), if the layouts' lengths differ
            from the shape's rank, or a split dim's size is not divisible by its mesh axis.
    """
    sizes = [int(getattr(d, "size", d)) for d in shape]
    nax = [d.size for d in spec.shape]
    if len(src.axes) != len(sizes) or len(dst.axes) != len(sizes):
        raise ValueError(f"redistribute {name!r}: layouts {src} -> {dst} do not match the shape's "
                         f"{len(sizes)} dims.")
    if dst.partial - src.partial:
        raise ValueError(f"redistribute {name!r}: cannot make a value partial over new mesh axes "
                         f"{sorted(dst.partial - src.partial)}.")
    for lay in (src, dst):
        for s, a in zip(sizes, lay.axes, strict=True):
            if a is not None and s % nax[a]:
                raise ValueError(f"redistribute {name!r}: a dim of size {s} cannot be split over mesh axis "
                                 f"{spec.shape[a].name!r} of size {nax[a]}.")
    cur = [a if a is not None and nax[a] > 1 else None for a in src.axes]
    want = [a if a is not None and nax[a] > 1 else None for a in dst.axes]
    local = [s // (nax[a] if a is not None else 1) for s, a in zip(sizes, cur, strict=True)]
    dst_dim = {a: i for i, a in enumerate(want) if a is not None}
    partial = {a for a in src.partial if nax[a] > 1}
    reduce = sorted(a for a in partial - dst.partial)
    out: list[Transform] = []

    def add(kind, axes, tensor_axis, nbytes, **params):
        out.append(Transform(kind, tuple(axes), tensor_axis, nbytes, Layout(tuple(cur), frozenset(partial)),
                             tuple(params.items())))

    # partial sums first: reduce-scatter straight into the target split where the dim is whole now
    for a in list(reduce):
        j = dst_dim.get(a)
        if j is not None and cur[j] is None and a not in cur:
            b = slice_nbytes(local, dtype)
            cur[j], local[j] = a, local[j] // nax[a]
            partial.discard(a)
            reduce.remove(a)
            add("reduce_scatter", [a], j, b, mesh_axis=a, scatter_axis=j)
    if reduce:
        partial.difference_update(reduce)
        add("allreduce", reduce, None, slice_nbytes(local, dtype), mesh_axes=tuple(reduce), reduction="SUM")

    def gather(a):
        i = cur.index(a)
        b = slice_nbytes(local, dtype)
        cur[i], local[i] = None, sizes[i]
        add("allgather", [a], i, b, mesh_axis=a, concat_axis=i)

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
            b = slice_nbytes(local, dtype)
            cur[i], cur[j] = None, a
            local[i], local[j] = sizes[i], sizes[j] // nax[a]
            add("alltoall", [a], j, b, mesh_axis=a, split_axis=j, concat_axis=i)
        else:
            gather(a)
        moves.remove(a)
    for a, j in dst_dim.items():
        if cur[j] == a:
            continue
        assert cur[j] is None, (cur, want)
        local[j] = sizes[j] // nax[a]
        cur[j] = a
        add(LOCAL_SLICE, [a], j, 0, axis=j, piece=local[j])
    return out


__all__ = ["LOCAL_SLICE", "Layout", "Transform", "itemsize", "narrow_kernel", "plan_redistribute", "slice_nbytes"]

"""The SPMD mesh's collectives as functional collectives, so a compiled program holds them.

``torch.compile`` cannot trace ``torch.distributed.all_reduce`` and friends (they mutate a buffer
and return a work handle): each one splits the compiled program into separately compiled pieces
with the collective run eagerly between them. PyTorch's *functional collectives*
(``torch.distributed._functional_collectives``, the ops DTensor and TorchTitan's compiled models
use) are pure functions ``tensor -> tensor`` that dynamo records as graph nodes
(``_c10d_functional.all_reduce`` + ``wait_tensor``); inductor then schedules the wait as late as the
graph allows, which is what the eager mesh's ``async_collectives`` does by hand.

:class:`FunctionalSpmdMeshImpl` is an :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` with the same mesh,
rank, process groups and storage rules whose all-reduce, all-gather, reduce-scatter, all-to-all and
their buckets are functional collectives; :meth:`SpmdMeshImpl.traceable` makes one, and a
:class:`~meshtorch.lowering.session.Session` in ``"compile"`` mode binds its SPMD steps to it, so the
whole step (forward, backward, collectives and optimizer update) is one graph per rank. Results are
the same as the eager mesh's (the same reduction over the same group; tests compare both with the
placement mesh). ``receive`` (the shift ops' point-to-point exchange) stays the eager one (a graph
break).

Flight recorder (:mod:`meshtorch.mesh.recorder`): while ``torch.compile`` traces, these primitives record
nothing (tracing executes no collective, and the compiled graph calls no Python method when it runs);
a :class:`~meshtorch.lowering.session.Session` records a compiled run's collectives from its plan
instead. Called eagerly (outside a compiled graph) they record each call like the eager mesh, with
the time it took to *issue* the call (the result is an ``AsyncCollectiveTensor`` waited for later).
Source: PyTorch ``torch.distributed._functional_collectives`` (RFC pytorch/pytorch#93173).
"""

from __future__ import annotations

import math

import torch.distributed._functional_collectives as funcol

from meshtorch.mesh.spmd import (
    SpmdMeshImpl,
    _exchanged,
    _flat_buckets,
    _gathered_piece,
    _nbytes,
    _piece,
    _row_buckets,
    _scattered_piece,
    _sizes,
    _wire,
)

# torch >= 2.5 names; the older ones warn about deprecation from 2.6 on
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


class FunctionalSpmdMeshImpl(SpmdMeshImpl):
    """:class:`~meshtorch.mesh.spmd.SpmdMeshImpl` whose collectives ``torch.compile`` can trace.

    Built with :meth:`of` (or ``SpmdMeshImpl.traceable()``) from an existing SPMD mesh, never
    directly: it shares that mesh's process groups, rank and rules. Every collective returns a plain
    tensor (outside a compiled graph an ``AsyncCollectiveTensor`` waited for at first use); buffers
    are never modified in place, so no input is copied first.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("FunctionalSpmdMeshImpl is made from an SpmdMeshImpl: use spmd_impl.traceable().")

    @classmethod
    def of(cls, impl: SpmdMeshImpl) -> FunctionalSpmdMeshImpl:
        """A functional-collective view of ``impl`` (same state; ``impl`` is left unchanged)."""
        view = object.__new__(cls)
        view.__dict__.update(impl.__dict__)
        view.async_collectives = False  # the compiler places the waits
        return view

    def traceable(self) -> FunctionalSpmdMeshImpl:
        return self

    def allreduce(self, x, mesh_axes, reduction="SUM"):
        group = self._reduction_group("allreduce", mesh_axes, reduction)
        if group is None:
            return self._trivial("allreduce", mesh_axes, [x], reduction)[0]
        buf, back = _wire(x)
        rec = self._record("allreduce", mesh_axes, (_nbytes(buf),), buf.dtype, reduction)
        return _done(rec, back(funcol.all_reduce(buf, reduction.lower(), group)))

    def allreduce_many(self, *xs, mesh_axes, reduction="SUM"):
        group = self._reduction_group("allreduce_many", mesh_axes, reduction)
        if group is None:
            return self._trivial("allreduce", mesh_axes, xs, reduction)
        out: list = [None] * len(xs)
        for flat, members in _flat_buckets(xs):  # one flat buffer (one call) per dtype, as on the eager mesh
            rec = self._record_bucket("allreduce", mesh_axes, _sizes(members, flat), flat.dtype, reduction)
            flat = _done(rec, funcol.all_reduce(flat, reduction.lower(), group))
            for i, offset, shape, back in members:
                out[i] = _piece(flat, offset, shape, back)
        return tuple(out)

    def allconcat(self, x, mesh_axis, concat_axis):
        on = self._on_axis(x, mesh_axis)
        if on is None:
            return self._trivial("allgather", (mesh_axis,), [x])[0]
        _, group, buf, back = on
        rec = self._record("allgather", (mesh_axis,), (_nbytes(buf),), buf.dtype)
        return _done(rec, back(_all_gather(buf.contiguous(), concat_axis, group)))

    def allconcat_many(self, *xs, mesh_axis, concat_axes):
        on = self._on_axis(xs[0], mesh_axis) if xs else None
        if on is None:
            return self._trivial("allgather", (mesh_axis,), xs)
        n, group = on[0], on[1]
        out: list = [None] * len(xs)
        for flat, members in _flat_buckets(xs):  # FSDP's flat parameter: one gather per dtype
            rec = self._record_bucket("allgather", (mesh_axis,), _sizes(members, flat), flat.dtype)
            gathered = _done(rec, _all_gather(flat, 0, group))
            for i, offset, shape, back in members:
                out[i] = _gathered_piece(gathered, n, offset, shape, concat_axes[i], back)
        return tuple(out)

    def reduce_scatter(self, x, mesh_axis, scatter_axis):
        on = self._on_axis(x, mesh_axis)
        if on is None:
            return self._trivial("reduce_scatter", (mesh_axis,), [x])[0]
        _, group, buf, back = on
        rec = self._record("reduce_scatter", (mesh_axis,), (_nbytes(buf),), buf.dtype)
        return _done(rec, back(_reduce_scatter(buf.contiguous(), "sum", scatter_axis, group)))

    def reduce_scatter_many(self, *xs, mesh_axis, scatter_axes):
        on = self._on_axis(xs[0], mesh_axis) if xs else None
        if on is None:
            return self._trivial("reduce_scatter", (mesh_axis,), xs)
        n, group = on[0], on[1]
        out: list = [None] * len(xs)
        for rows, members in _row_buckets(xs, n, scatter_axes):
            rec = self._record_bucket("reduce_scatter", (mesh_axis,),
                                      [(i, rows.shape[0] * math.prod(piece) * rows.element_size())
                                       for i, _, piece, _ in members], rows.dtype)
            mine = _done(rec, _reduce_scatter(rows.reshape(-1), "sum", 0, group))
            for i, offset, piece, back in members:
                out[i] = _scattered_piece(mine, offset, piece, scatter_axes[i], back)
        return tuple(out)

    def alltoall(self, x, mesh_axis, split_axis, concat_axis):
        on = self._on_axis(x, mesh_axis)
        if on is None:
            return self._trivial("alltoall", (mesh_axis,), [x])[0]
        n, group, buf, back = on
        rec = self._record("alltoall", (mesh_axis,), (_nbytes(buf),), buf.dtype)
        moved = buf.movedim(split_axis, 0).contiguous()  # piece j = rows [j*s, (j+1)*s)
        out = _done(rec, funcol.all_to_all_single(moved, None, None, group))
        return _exchanged(out, n, split_axis, concat_axis, back)


def _done(rec, value):
    """``value``, with the flight-recorder record ``rec`` (if any) finished: the call was issued."""
    if rec is not None:
        rec.finish()
    return value


__all__ = ["FunctionalSpmdMeshImpl"]


SpmdMeshImpl.functional_view = FunctionalSpmdMeshImpl

"""How the SPMD mesh issues its collectives: eagerly (``torch.distributed``) or as functional collectives.

:class:`~meshtorch.mesh.spmd.SpmdMeshImpl` writes each collective (all-reduce, all-gather,
reduce-scatter, all-to-all, the shift ops' point-to-point exchange, and the buckets of several values)
once: the packing into one flat buffer per dtype, the flight-recorder record and the unpacking of the
result. The one call that moves the bytes is made by a *strategy*, one of the two classes here:

- :class:`EagerCollectives`: ``torch.distributed.all_reduce`` and friends, which write into an output
  buffer and, with ``asynchronous`` (``async_op=True``), return a work handle that the mesh waits on at
  the first use of the result (DDP's overlapped buckets, FSDP's prefetched gathers);
- :class:`FunctionalCollectives`: PyTorch's *functional collectives*
  (``torch.distributed._functional_collectives``, the ops DTensor and TorchTitan's compiled models use),
  pure functions ``tensor -> tensor`` that ``torch.compile`` records as graph nodes
  (``_c10d_functional.all_reduce`` + ``wait_tensor``), so a compiled step holds its collectives in one
  graph and inductor places each wait as late as the graph allows. Outside a compiled graph the result
  is an ``AsyncCollectiveTensor`` waited for at first use. ``torch.distributed.all_reduce`` cannot be
  traced (it mutates a buffer and returns a work handle): each call would split the compiled program.

Every method returns ``(work, out)``: ``out`` the result buffer, ``work`` a handle to wait on before
reading it, or None when ``out`` can be read now. Both strategies exchange point-to-point with
``torch.distributed.batch_isend_irecv`` (functional collectives have no send/receive; in a compiled
program the shift ops are a graph break). Source: PyTorch ``torch.distributed`` and
``torch.distributed._functional_collectives`` (RFC pytorch/pytorch#93173).

The flight recorder (:mod:`meshtorch.mesh.recorder`) is written here, at the process-group call: every
call goes through :func:`issue`, which records the kind of the torch function actually called (its
entry in :data:`CALLED`), the bytes of the tensor actually handed to it and the mesh axes of the group
actually passed (a :class:`MeshGroup`), then makes the call; an asynchronous call's record is finished
when its work is waited for. So a strategy that computed a reduce-scatter as an all-reduce plus a slice
records an all-reduce, and one that bypassed :func:`issue` records nothing: either way the executed
collectives differ from the planned ones (``lowering.counters``), as PyTorch's NCCL flight recorder,
which records inside the process group, would show.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from meshtorch.core.collectives import KINDS

_is_compiling = torch.compiler.is_compiling
_OPS = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN}
# torch >= 2.5 names; the older ones warn about deprecation from 2.6 on
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_funcol_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _send_recv(ops) -> None:
    """``torch.distributed.batch_isend_irecv(ops)``, waited for (no call when ``ops`` is empty)."""
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


#: every process-group call a strategy makes -> (the collective kind it is, in the flight recorder's
#: terms; whether it takes ``group=``). :func:`issue` refuses any other function.
CALLED: dict[Callable, tuple[str, bool]] = {
    dist.all_reduce: ("allreduce", True), _all_gather: ("allgather", True),
    _reduce_scatter: ("reduce_scatter", True), dist.all_to_all_single: ("alltoall", True),
    dist.broadcast: ("broadcast", True), _send_recv: ("collective_permute", False),
    funcol.all_reduce: ("allreduce", True), _funcol_all_gather: ("allgather", True),
    _funcol_reduce_scatter: ("reduce_scatter", True), funcol.all_to_all_single: ("alltoall", True),
    funcol.broadcast: ("broadcast", True),
}


@dataclass(frozen=True, slots=True)
class MeshGroup:
    """This rank's process group along some mesh axes, as a strategy is handed it.

    Attributes:
        process_group: the ``torch.distributed`` group (``group=`` of every call made on it).
        ranks: its members' global ranks, in mesh-coordinate order along the axes.
        mesh_axes: the mesh axis indices it spans (the flight recorder names them).
        record: the mesh's recorder, ``record(kind, mesh_axes, parts, dtype, reduction, members,
            asynchronous) -> CollectiveRecord | None`` (:meth:`~meshtorch.mesh.base.MeshImpl._record`).
    """

    process_group: object
    ranks: tuple
    mesh_axes: tuple
    record: Callable


class _Timed:
    """A work handle whose ``wait`` also finishes the call's flight-recorder record (once)."""

    __slots__ = ("work", "rec")

    def __init__(self, work, rec):
        self.work, self.rec = work, rec

    def wait(self):
        done = self.work.wait()
        self.rec.finish()
        return done


def issue(fn: Callable, group: MeshGroup, wire: torch.Tensor, *args, reduction: str = "", parts=None, **kwargs):
    """Record the process-group call ``fn(*args, group=group.process_group, **kwargs)`` and make it.

    Args:
        fn: a function of :data:`CALLED`; its entry gives the recorded kind.
        group: the group called (its ``mesh_axes`` are recorded).
        wire: the tensor this processor contributes (its bytes and dtype are recorded).
        reduction: ``"SUM"``/``"MAX"``/``"MIN"`` for an all-reduce, else ``""`` (recorded).
        parts: a bucket's ``[(member index, bytes per processor)]``; recorded as the call's values when their
            bytes add up to ``wire``'s, else the call records one value of ``wire``'s bytes.
        kwargs: passed to ``fn``; ``async_op=True`` records the call as asynchronous, finished at its wait.

    Returns:
        ``fn``'s result; an asynchronous call's work handle is wrapped so that its ``wait`` finishes the record.

    Raises:
        ValueError: naming ``fn``, if it is no process-group call of :data:`CALLED`.
    """
    called = CALLED.get(fn)
    if called is None:
        raise ValueError(f"spmd_strategy.issue: {getattr(fn, '__name__', fn)!r} is no declared process-group "
                         f"call; add it to meshtorch.mesh.spmd_strategy.CALLED with the kind it records.")
    kind, takes_group = called
    if takes_group:
        kwargs["group"] = group.process_group
    if _is_compiling():  # tracing executes nothing: no record (a compiled run is counted from its plan)
        return fn(*args, **kwargs)
    nbytes = wire.numel() * wire.element_size()
    members = None
    if parts is not None and sum(b for _, b in parts) == nbytes:
        members, sizes = tuple(i for i, _ in parts), tuple(b for _, b in parts)
    else:
        sizes = (nbytes,)
    asynchronous = bool(kwargs.get("async_op", False))
    rec = group.record(kind, group.mesh_axes, sizes, wire.dtype, reduction, members, asynchronous)
    out = fn(*args, **kwargs)
    if rec is not None:
        if asynchronous and out is not None:
            return _Timed(out, rec)
        rec.finish()
    return out


class Collectives(abc.ABC):
    """The primitive calls of a strategy (see the module docstring); subclasses implement the collectives
    (an abstract base: a strategy missing one cannot be constructed). ``group`` is a :class:`MeshGroup`;
    ``parts``, a bucket's ``[(member index, bytes per processor)]`` for the flight recorder (:func:`issue`).

    Attributes:
        asynchronous: calls may return a work handle waited for at the first use of the result.
        traceable: ``torch.compile`` holds the calls inside one graph.
    """

    asynchronous: bool = False
    traceable: bool = False

    def is_async(self, kind: str, nbytes: int) -> bool:
        """Whether a ``kind`` call (``"allreduce"``, ``"allgather"``, ``"reduce_scatter"``, ``"broadcast"``)
        moving ``nbytes`` bytes per processor returns a work handle instead of a ready buffer."""
        return self.asynchronous

    @abc.abstractmethod
    def all_reduce(self, t: torch.Tensor, reduction: str, group: MeshGroup, owned: bool, parts=None):
        """Reduce ``t`` (any shape) over ``group`` with ``reduction`` (SUM, MAX, MIN); ``owned``: ``t``
        is a temporary the call may overwrite (else it is left unchanged). Output: ``t``'s shape."""
        raise NotImplementedError

    @abc.abstractmethod
    def all_gather(self, flat: torch.Tensor, n: int, group: MeshGroup, parts=None):
        """The 1-D ``flat`` of each of the ``n`` members of ``group`` concatenated: ``[n * elements]``."""
        raise NotImplementedError

    @abc.abstractmethod
    def reduce_scatter(self, rows: torch.Tensor, n: int, group: MeshGroup, parts=None):
        """Sum of the contiguous ``rows`` ``[n * s, ...]`` over ``group``; member ``c`` keeps rows
        ``[c * s, (c + 1) * s)``: output ``[s, ...]``."""
        raise NotImplementedError

    @abc.abstractmethod
    def all_to_all(self, rows: torch.Tensor, group: MeshGroup):
        """Contiguous ``rows`` ``[n * s, ...]``: piece ``j`` (rows ``[j * s, (j + 1) * s)``) goes to member
        ``j``; output the ``n`` received pieces stacked in member order, ``rows``' shape. Never asynchronous."""
        raise NotImplementedError

    @abc.abstractmethod
    def broadcast(self, t: torch.Tensor, root: int, group: MeshGroup):
        """The contiguous ``t`` of the member ``root`` (its index in ``group.ranks``) on every member; ``t``
        is left unchanged. Output: ``t``'s shape."""
        raise NotImplementedError

    def exchange(self, wire: torch.Tensor, sends: list[tuple[torch.Tensor, int]], recv: torch.Tensor | None,
                 source: int | None, group: MeshGroup):
        """Point-to-point (a collective-permute of this processor's ``wire`` along ``group``): send each
        ``(tensor, rank)`` of ``sends`` and receive into ``recv`` from rank ``source`` (None: nothing to
        receive), all in one batch, waited for before returning."""
        ops = [dist.P2POp(dist.isend, t, rank) for t, rank in sends]
        if source is not None:
            ops.append(dist.P2POp(dist.irecv, recv, source))
        issue(_send_recv, group, wire, ops)


def _group_rank(group: MeshGroup, member: int) -> int:
    """The group-local rank (``torch.distributed``'s, ranks sorted) of ``group.ranks[member]``."""
    return sorted(group.ranks).index(group.ranks[member])


class EagerCollectives(Collectives):
    """``torch.distributed``'s collectives into preallocated buffers; a call started asynchronously
    (``async_op=True``) is waited for at the first use of its result (see
    :class:`~meshtorch.mesh.spmd.SpmdMeshImpl`).

    Args:
        asynchronous: every all-reduce, all-gather, reduce-scatter and broadcast starts asynchronously.
        async_all_reduce_min_bytes: with ``asynchronous`` False, all-reduces (single or bucketed) of at least
            this many bytes per processor still start asynchronously, so a large gradient bucket overlaps
            the rest of the backward pass (DDP's reducer), while small calls, whose result is needed at once
            or whose cost is latency, stay blocking; None: none. The CPU default of
            :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` (docs/distributed.md has the measurements).

    Raises:
        ValueError: if ``async_all_reduce_min_bytes`` is negative.
    """

    def __init__(self, asynchronous: bool = False, async_all_reduce_min_bytes: int | None = None):
        self.asynchronous = bool(asynchronous)
        if async_all_reduce_min_bytes is not None and async_all_reduce_min_bytes < 0:
            raise ValueError(f"EagerCollectives: async_all_reduce_min_bytes must be >= 0 or None, "
                             f"got {async_all_reduce_min_bytes}.")
        self.async_all_reduce_min_bytes = async_all_reduce_min_bytes

    def is_async(self, kind, nbytes):
        if self.asynchronous:
            return True
        return (KINDS[kind].async_when_large and self.async_all_reduce_min_bytes is not None
                and nbytes >= self.async_all_reduce_min_bytes)

    def all_reduce(self, t, reduction, group, owned, parts=None):
        out = t if owned else t.clone()  # all_reduce works in place; never modify an input slot
        async_op = self.is_async("allreduce", out.numel() * out.element_size())
        return issue(dist.all_reduce, group, out, out, op=_OPS[reduction], async_op=async_op, reduction=reduction,
                     parts=parts), out

    def all_gather(self, flat, n, group, parts=None):
        out = torch.empty((n * flat.numel(),), dtype=flat.dtype, device=flat.device)
        return issue(_all_gather, group, flat, out, flat, async_op=self.asynchronous, parts=parts), out

    def reduce_scatter(self, rows, n, group, parts=None):
        out = torch.empty((rows.shape[0] // n, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        work = issue(_reduce_scatter, group, rows, out, rows, op=dist.ReduceOp.SUM,
                     async_op=self.asynchronous, parts=parts)
        return work, out

    def all_to_all(self, rows, group):
        out = torch.empty_like(rows)
        issue(dist.all_to_all_single, group, rows, out, rows)
        return None, out

    def broadcast(self, t, root, group):
        out = t.clone() if group.ranks[root] == dist.get_rank() else torch.empty_like(t)
        async_op = self.is_async("broadcast", out.numel() * out.element_size())
        return issue(dist.broadcast, group, t, out, group_src=_group_rank(group, root), async_op=async_op), out

    def __repr__(self):
        extra = ("" if self.async_all_reduce_min_bytes is None
                 else f", async_all_reduce_min_bytes={self.async_all_reduce_min_bytes}")
        return f"EagerCollectives(asynchronous={self.asynchronous}{extra})"


class FunctionalCollectives(Collectives):
    """``torch.distributed._functional_collectives``: no buffer is modified in place (no input is copied
    first) and no work handle is returned; the compiler, or the ``AsyncCollectiveTensor`` outside a
    compiled graph, places the wait."""

    traceable = True

    def all_reduce(self, t, reduction, group, owned, parts=None):
        return None, issue(funcol.all_reduce, group, t, t, reduction.lower(), reduction=reduction, parts=parts)

    def all_gather(self, flat, n, group, parts=None):
        return None, issue(_funcol_all_gather, group, flat, flat, 0, parts=parts)

    def reduce_scatter(self, rows, n, group, parts=None):
        return None, issue(_funcol_reduce_scatter, group, rows, rows, "sum", 0, parts=parts)

    def all_to_all(self, rows, group):
        return None, issue(funcol.all_to_all_single, group, rows, rows, None, None)

    def broadcast(self, t, root, group):
        return None, issue(funcol.broadcast, group, t, t, _group_rank(group, root))

    def __repr__(self):
        return "FunctionalCollectives()"


__all__ = ["CALLED", "Collectives", "EagerCollectives", "FunctionalCollectives", "MeshGroup", "issue"]

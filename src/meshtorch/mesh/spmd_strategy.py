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
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

_OPS = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN}
# torch >= 2.5 names; the older ones warn about deprecation from 2.6 on
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_funcol_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


class Collectives(abc.ABC):
    """The primitive calls of a strategy (see the module docstring); subclasses implement the collectives
    (an abstract base: a strategy missing one cannot be constructed).

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
    def all_reduce(self, t: torch.Tensor, reduction: str, group, owned: bool):
        """Reduce ``t`` (any shape) over ``group`` with ``reduction`` (SUM, MAX, MIN); ``owned``: ``t``
        is a temporary the call may overwrite (else it is left unchanged). Output: ``t``'s shape."""
        raise NotImplementedError

    @abc.abstractmethod
    def all_gather(self, flat: torch.Tensor, n: int, group):
        """The 1-D ``flat`` of each of the ``n`` members of ``group`` concatenated: ``[n * elements]``."""
        raise NotImplementedError

    @abc.abstractmethod
    def reduce_scatter(self, rows: torch.Tensor, n: int, group):
        """Sum of the contiguous ``rows`` ``[n * s, ...]`` over ``group``; member ``c`` keeps rows
        ``[c * s, (c + 1) * s)``: output ``[s, ...]``."""
        raise NotImplementedError

    @abc.abstractmethod
    def all_to_all(self, rows: torch.Tensor, group):
        """Contiguous ``rows`` ``[n * s, ...]``: piece ``j`` (rows ``[j * s, (j + 1) * s)``) goes to member
        ``j``; output the ``n`` received pieces stacked in member order, ``rows``' shape. Never asynchronous."""
        raise NotImplementedError

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recv: torch.Tensor | None, source: int | None):
        """Point-to-point: send each ``(tensor, rank)`` of ``sends`` and receive into ``recv`` from rank
        ``source`` (None: nothing to receive), all in one batch, waited for before returning."""
        ops = [dist.P2POp(dist.isend, t, rank) for t, rank in sends]
        if source is not None:
            ops.append(dist.P2POp(dist.irecv, recv, source))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()


class EagerCollectives(Collectives):
    """``torch.distributed``'s collectives into preallocated buffers; a call started asynchronously
    (``async_op=True``) is waited for at the first use of its result (see
    :class:`~meshtorch.mesh.spmd.SpmdMeshImpl`).

    Args:
        asynchronous: every all-reduce, all-gather and reduce-scatter starts asynchronously.
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
        return (kind == "allreduce" and self.async_all_reduce_min_bytes is not None
                and nbytes >= self.async_all_reduce_min_bytes)

    def all_reduce(self, t, reduction, group, owned):
        out = t if owned else t.clone()  # all_reduce works in place; never modify an input slot
        async_op = self.is_async("allreduce", out.numel() * out.element_size())
        return dist.all_reduce(out, op=_OPS[reduction], group=group, async_op=async_op), out

    def all_gather(self, flat, n, group):
        out = torch.empty((n * flat.numel(),), dtype=flat.dtype, device=flat.device)
        return _all_gather(out, flat, group=group, async_op=self.asynchronous), out

    def reduce_scatter(self, rows, n, group):
        out = torch.empty((rows.shape[0] // n, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        work = dist.reduce_scatter_tensor(out, rows, op=dist.ReduceOp.SUM, group=group, async_op=self.asynchronous)
        return work, out

    def all_to_all(self, rows, group):
        out = torch.empty_like(rows)
        dist.all_to_all_single(out, rows, group=group)
        return None, out

    def __repr__(self):
        extra = ("" if self.async_all_reduce_min_bytes is None
                 else f", async_all_reduce_min_bytes={self.async_all_reduce_min_bytes}")
        return f"EagerCollectives(asynchronous={self.asynchronous}{extra})"


class FunctionalCollectives(Collectives):
    """``torch.distributed._functional_collectives``: no buffer is modified in place (no input is copied
    first) and no work handle is returned; the compiler, or the ``AsyncCollectiveTensor`` outside a
    compiled graph, places the wait."""

    traceable = True

    def all_reduce(self, t, reduction, group, owned):
        return None, funcol.all_reduce(t, reduction.lower(), group)

    def all_gather(self, flat, n, group):
        return None, _funcol_all_gather(flat, 0, group)

    def reduce_scatter(self, rows, n, group):
        return None, _funcol_reduce_scatter(rows, "sum", 0, group)

    def all_to_all(self, rows, group):
        return None, funcol.all_to_all_single(rows, None, None, group)

    def __repr__(self):
        return "FunctionalCollectives()"


__all__ = ["Collectives", "EagerCollectives", "FunctionalCollectives"]

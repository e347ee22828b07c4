"""The flight recorder: every collective a mesh implementation actually executes, in a ring buffer.

Each collective call a mesh implementation makes (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute, broadcast and their buckets) appends one :class:`CollectiveRecord`: the kind it
ran, the mesh axes, the bytes each processor contributes (per value, so a bucket is one call of several
values), the dtype on the wire, the rank, and the wall time. The SPMD mesh records where its strategy
calls the process group (:func:`meshtorch.mesh.spmd_strategy.issue`: the kind of the ``torch.distributed``
or functional-collective function actually called, the bytes handed to it, the mesh axes of its group);
the placement mesh, which moves slices itself, records in each primitive
(:mod:`meshtorch.mesh.placement`); a collective over groups of one processor moves nothing and is
recorded by the mesh method that the program called. The record is made when the call starts and its time is filled in
when the call ends, so after a hang or a failure the last record of a rank still reads "not finished"
(:meth:`FlightRecorder.dump`, printed on a rank failure by :mod:`meshtorch.mesh.watchdog` and
:mod:`meshtorch.runtime.failures`). Peers: TorchTitan / PyTorch's NCCL flight recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE``: the last N collectives of each rank, dumped on a timeout), which
records at the same level (one entry per process-group call).

The executor tags each call with the program step that asked for it (:attr:`FlightRecorder.tag`: the
step's planned :class:`~meshtorch.lowering.counters.Collective` records), so
``lowering.counters`` can report the executed collectives per op in the planned format and a test can
compare what ran with what was planned (``Counters.diff``). A collective made outside a program step
(``export_full``'s gather of a fetched result) is recorded with no tag.

Time: for a blocking call, the seconds the call took; for an asynchronous one (the SPMD mesh with
``async_collectives``), from its issue to the end of the wait at the first use of its result (so it
includes the computation it overlapped; ``asynchronous`` is True). Recording costs a few microseconds
per call (a record, two clock reads, two appends), on by default; ``flight_recorder().enabled =
False`` (or ``MESHTORCH_FLIGHT_RECORDER=0``) turns it off, and then ``lowering.counters`` counts no
collectives (``plan_counters`` still does). While ``torch.compile`` traces a program the primitives
record nothing (a trace is not an execution); see :class:`~meshtorch.lowering.session.Session` for how
compiled runs are counted.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from dataclasses import dataclass

import torch

#: records kept per process (the ring buffer's length)
DEFAULT_CAPACITY = 4096
#: records per rank printed on a failure
DUMP_RECORDS = 8
_DTYPES: dict = {}  # torch dtype -> its name ("float32"), made once
_now = time.perf_counter


@dataclass(slots=True, eq=False)
class CollectiveRecord:
    """One collective call as executed.

    Attributes:
        seq: this process's running number of the call (0, 1, ...).
        kind: what ran: ``"allreduce"``, ``"allgather"``, ``"reduce_scatter"``, ``"alltoall"``,
            ``"collective_permute"``, ``"broadcast"``.
        mesh_axes: names of the mesh axes it communicated over.
        parts: bytes each processor contributed, per value moved (one entry for a single collective,
            one per value of a bucket call).
        members: for a bucket call, the index of each of ``parts`` among the bucket's values; None for
            a single collective.
        dtype: dtype on the wire (``"float32"``...).
        reduction: ``"SUM"``/``"MAX"``/``"MIN"`` for all-reduces and reduce-scatters, else ``""``.
        num_processors: processors of the mesh.
        rank: this process's rank (0 on a placement mesh, whose one process runs every processor).
        start: ``time.perf_counter()`` at the call.
        seconds: wall time (see the module docstring); None while the call has not finished, or for a
            record made from the plan of a compiled run (``source == "plan"``).
        asynchronous: issued with ``async_op=True`` (its time runs to the first use of its result).
        tag: the planned Collective records of the program step that made the call (None: not a step).
        source: ``"backend"`` (the mesh implementation recorded the call) or ``"plan"`` (a compiled run's
            collective, known from its plan, see :class:`~meshtorch.lowering.session.Session`).
    """

    seq: int
    kind: str
    mesh_axes: tuple
    parts: tuple
    members: tuple | None
    dtype: str
    reduction: str
    num_processors: int
    rank: int
    start: float
    seconds: float | None = None
    asynchronous: bool = False
    tag: tuple | None = None
    source: str = "backend"

    @property
    def bytes_per_processor(self) -> int:
        """Bytes each processor contributed to this call (all its values)."""
        return sum(self.parts)

    def finish(self) -> None:
        """Mark the call finished now (its ``seconds`` from ``start``); a second call changes nothing."""
        if self.seconds is None:
            self.seconds = _now() - self.start

    def __str__(self) -> str:
        ops = "" if not self.tag else " for " + ",".join(sorted({c.op for c in self.tag}))[:60]
        t = "not finished" if self.seconds is None and self.source == "backend" else (
            "untimed (compiled)" if self.seconds is None else f"{self.seconds * 1e3:.3f} ms")
        n = f" x{len(self.parts)}" if self.members is not None else ""
        red = f"[{self.reduction.lower()}]" if self.reduction and self.reduction != "SUM" else ""
        return (f"#{self.seq} rank {self.rank} {self.kind}{red}{n} over {','.join(self.mesh_axes) or '-'} "
                f"{self.bytes_per_processor} B {self.dtype} {t}{' async' if self.asynchronous else ''}{ops}")


class FlightRecorder:
    """The last ``capacity`` collective calls of this process (one per process, :func:`flight_recorder`).

    Attributes:
        enabled: record at all (default True unless ``MESHTORCH_FLIGHT_RECORDER=0``).
        tag: set by the executor around a program step's collective call (the step's planned records).
        sink: a list that also receives every record while set (a session collects one run's records
            there to count them; the ring buffer may drop old ones).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, enabled: bool = True):
        if int(capacity) < 1:
            raise ValueError(f"FlightRecorder: capacity must be >= 1 record, got {capacity}.")
        self.enabled = bool(enabled)
        self.tag: tuple | None = None
        self.sink: list | None = None
        self._ring: collections.deque = collections.deque(maxlen=int(capacity))
        self._seq = 0

    @property
    def capacity(self) -> int:
        return self._ring.maxlen

    def record(self, kind: str, mesh_axes: tuple, parts: tuple, dtype, reduction: str, num_processors: int,
               rank: int, members: tuple | None = None, asynchronous: bool = False) -> CollectiveRecord | None:
        """Append the record of a call starting now; returns it (call :meth:`CollectiveRecord.finish` when
        it ends), or None when disabled or while ``torch.compile`` traces (nothing executes then)."""
        if not self.enabled or torch.compiler.is_compiling():
            return None
        return self.new(kind, mesh_axes, parts, dtype, reduction, num_processors, rank, members, asynchronous)

    def new(self, kind, mesh_axes, parts, dtype, reduction, num_processors, rank, members=None,
            asynchronous=False) -> CollectiveRecord:
        """:meth:`record` without its checks (the caller made them: a mesh implementation's ``_record``)."""
        name = _DTYPES.get(dtype)
        if name is None:
            name = _DTYPES[dtype] = str(dtype).removeprefix("torch.")
        rec = CollectiveRecord(self._seq, kind, mesh_axes, parts, members, name, reduction, num_processors, rank,
                               _now(), None, asynchronous, self.tag)
        self._seq += 1
        self._ring.append(rec)
        if self.sink is not None:
            self.sink.append(rec)
        return rec

    def add(self, rec: CollectiveRecord) -> None:
        """Append a record made elsewhere (a compiled run's planned collective); its ``seq`` is set here."""
        if not self.enabled:
            return
        rec.seq = self._seq
        self._seq += 1
        self._ring.append(rec)
        if self.sink is not None:
            self.sink.append(rec)

    def records(self, last: int | None = None) -> list[CollectiveRecord]:
        """The records kept (oldest first); ``last``: only the newest ``last``."""
        out = list(self._ring)
        return out if last is None else out[len(out) - min(last, len(out)):]

    def clear(self) -> None:
        """Forget the records kept (the running number goes on)."""
        self._ring.clear()

    def dump(self, last: int = DUMP_RECORDS) -> str:
        """The newest ``last`` records, one line each (what this rank was doing), for a failure report."""
        recs = self.records(last)
        if not recs:
            return "meshtorch flight recorder: no collectives recorded" + ("" if self.enabled else " (disabled)")
        lines = [f"meshtorch flight recorder: last {len(recs)} of {self._seq} collective(s) of this process:"]
        lines += [f"  {r}" for r in recs]
        return "\n".join(lines)


_RECORDER = FlightRecorder(enabled=os.environ.get("MESHTORCH_FLIGHT_RECORDER", "1") not in ("0", "false", "off"))


def flight_recorder() -> FlightRecorder:
    """This process's :class:`FlightRecorder` (shared by every mesh implementation in the process)."""
    return _RECORDER


def print_last_collectives(file=None, last: int = DUMP_RECORDS) -> None:
    """Print :meth:`FlightRecorder.dump` to ``file`` (default stderr); never raises (failure paths call it)."""
    try:
        print(_RECORDER.dump(last), file=file or sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a failure report must not fail
        pass


def collective_report(records, top: int = 5) -> str:
    """Time per collective kind and mesh axes, then the ``top`` slowest calls, of ``records``.

    ``records``: :class:`CollectiveRecord` s (e.g. ``flight_recorder().records()``, or a run's).
    Untimed records (compiled runs, calls not finished) are counted but add no time. Returns a table:
    kind, mesh axes, calls, bytes per processor, total / mean milliseconds, share of the timed total.
    """
    rows: dict = {}
    timed = 0.0
    for r in records:
        row = rows.setdefault((r.kind, ",".join(r.mesh_axes)), [0, 0, 0.0, 0])
        row[0] += 1
        row[1] += r.bytes_per_processor
        if r.seconds is not None:
            row[2] += r.seconds
            row[3] += 1
            timed += r.seconds
    lines = [f"collective time by kind and mesh axes ({sum(v[0] for v in rows.values())} calls):",
             f"  {'collective':<16}{'mesh axes':<14}{'calls':>8}{'bytes/proc':>14}{'total ms':>12}"
             f"{'mean ms':>10}{'share':>8}"]
    for (kind, axes), (n, b, s, k) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        mean = f"{s / k * 1e3:.3f}" if k else "-"
        share = f"{100 * s / timed:.1f}%" if timed > 0 else "-"
        lines.append(f"  {kind:<16}{axes or '-':<14}{n:>8}{b:>14}{s * 1e3:>12.3f}{mean:>10}{share:>8}")
    slow = sorted((r for r in records if r.seconds is not None), key=lambda r: -r.seconds)[:top]
    if slow:
        lines.append(f"  slowest {len(slow)}:")
        lines += [f"    {r}" for r in slow]
    return "\n".join(lines)


__all__ = ["CollectiveRecord", "FlightRecorder", "collective_report", "flight_recorder", "print_last_collectives"]

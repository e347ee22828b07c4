"""An alpha-beta model of one step's time (:class:`CostModel`, :func:`estimate_time`).

The constants are either fixed orders of magnitude (:meth:`CostModel.cpu`, the GPU default) or measured on
the machine the plan is for (:mod:`meshtorch.runtime.calibrate`: GEMM rate, seconds per kernel call, each
collective's latency and bandwidth on the backend). Two execution models: an SPMD mesh runs its processors
in parallel (one step = one processor's work plus the collectives), a placement mesh simulates them in one
process one after another (``serial``: the sum over processors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshtorch.lowering.collectives import kind_of
from meshtorch.lowering.counters import Collective
from meshtorch.lowering.layout import Transform
from meshtorch.planning.memory import MemoryReport


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta model of one step's time on each processor (compute and communication add up).

    ``compute = flops_per_processor / flop_rate`` (the rate of ``compute_dtype``, :meth:`for_dtype`); each
    collective over a group of ``g`` processors (the product of its mesh-axis sizes) whose members each
    contribute ``b`` bytes costs ``latency + wire_bytes / bandwidth`` with the ring-algorithm wire bytes:

    ==================  =====================
    all-reduce          ``2 (g - 1) / g * b``
    all-gather          ``(g - 1) * b``
    all-to-all          ``(g - 1) / g * b``
    reduce-scatter      ``(g - 1) / g * b``
    collective-permute  ``b`` (a shift)
    ==================  =====================

    The latency is paid once per call the executor makes: the SPMD mesh sums a data-parallel step's gradients
    in buckets (:mod:`meshtorch.lowering.schedule`, one call of several values each), so
    :func:`estimate_time` charges the wire bytes per collective and the latency per call
    (:attr:`MemoryReport.collective_calls`).

    Defaults (order of magnitude of one data-centre GPU with NVLink-class links): ``flop_rate``
    1e14 FLOP/s, ``bandwidth`` 1e11 B/s, ``latency`` 1e-5 s per collective.
    :meth:`cpu` gives a multi-core CPU with a 10 GB/s interconnect (1e11, 1e10, 5e-5).
    Overlap of compute and communication, elementwise FLOPs and memory bandwidth are ignored.

    Measured models (:func:`meshtorch.runtime.calibrate.calibrate`) add:

    * ``kernel_overhead``: seconds per kernel call of a step (the executor's dispatch and the small
      kernels between the einsums), charged once per slicewise step per processor;
    * ``memory_bandwidth``: bytes/s of elementwise kernels, charged on the bytes the slicewise steps read and
      write (:attr:`MemoryReport.kernel_read_bytes` + :attr:`MemoryReport.kernel_bytes`: a fused step such as a
      softmax cross-entropy reads ``[batch, length, vocab]`` and writes ``[batch, length]``, and a layout that
      repeats the batch over a mesh axis reads the whole batch's on each processor of it), 0 to ignore them;
    * ``collectives``: ``((kind, latency_s, seconds_per_wire_byte), ...)`` measured per kind, which
      override ``latency``/``bandwidth`` for that kind;
    * ``spread``: the largest relative spread ``(max - min) / median`` of the measured constants over the
      calibration's repetitions (None: the constants were not measured), and ``busy``: other work competed
      while they were measured (:func:`meshtorch.planning.search.trust_line` states both under a ranking);
    * ``serial``: the processors run one after another in this process (a placement mesh): compute is every
      processor's work in turn (:attr:`MemoryReport.flops_serial`: train's sliced feeds keep even a replicated
      layout's replicas apart), and each collective's time is paid by every processor group of the mesh in
      turn.
    """

    flop_rate: float = 1e14
    bandwidth: float = 1e11
    latency: float = 1e-5
    kernel_overhead: float = 0.0
    memory_bandwidth: float = 0.0
    serial: bool = False
    collectives: tuple = ()
    name: str = ""
    flop_rates: tuple = ()
    compute_dtype: str = "float32"
    spread: float | None = None
    busy: bool = False

    @classmethod
    def cpu(cls) -> CostModel:
        return cls(flop_rate=1e11, bandwidth=1e10, latency=5e-5)

    def for_dtype(self, dtype) -> CostModel:
        """This model pricing the FLOPs in ``dtype`` (a ``torch.dtype`` or its name, e.g. the compute dtype of
        ``--precision bf16``): ``flop_rate`` becomes the rate measured for that dtype (``flop_rates``:
        ``((dtype name, FLOP/s), ...)``, from :mod:`meshtorch.runtime.calibrate`), or stays the float32 rate
        when none was measured (the fixed models; ``measured_dtype`` then says so). Bytes need no change: the
        planner counts every slot and collective in its own dtype (issue 31)."""
        name = str(dtype).replace("torch.", "")
        rate = dict(self.flop_rates).get(name)
        return replace(self, compute_dtype=name, flop_rate=self.flop_rate if rate is None else float(rate))

    def sharing_cores(self, processes: int, cores: int, measured_with: int = 1) -> CostModel:
        """This model for ``processes`` processes that share ``cores`` CPU cores (one process per processor, more
        processes than cores: the OS time-slices them), when its compute constants were measured with
        ``measured_with`` processes side by side on those cores: the FLOP rates and the elementwise bandwidth
        divided, and the per-kernel overhead multiplied, by ``max(1, processes / cores) / max(1, measured_with /
        cores)`` (each process gets ``cores / processes`` of a core). Collectives keep their measured constants.
        Unchanged for ``processes <= cores``."""
        scale = max(1.0, processes / max(1, cores)) / max(1.0, measured_with / max(1, cores))
        if scale <= 1.0:
            return self
        return replace(self, flop_rate=self.flop_rate / scale, memory_bandwidth=self.memory_bandwidth / scale,
                       kernel_overhead=self.kernel_overhead * scale,
                       flop_rates=tuple((k, v / scale) for k, v in self.flop_rates),
                       name=f"{self.name}; {processes} processes on {cores} cores: compute x{scale:.3g}")

    @property
    def measured_dtype(self) -> bool:
        """Whether ``flop_rate`` was measured in ``compute_dtype`` (always for float32)."""
        return self.compute_dtype == "float32" or self.compute_dtype in dict(self.flop_rates)

    def collective_time(self, c: Collective, group: int) -> float:
        """Seconds of one collective ``c`` over a group of ``group`` processors: latency plus the bytes each
        processor sends (the kind's declared ``wire_bytes``, ring algorithms) over the bandwidth.

        Raises:
            ValueError: ``c.kind`` is no declared collective (:mod:`meshtorch.lowering.collectives`).
        """
        return self.kind_time(c.kind, c.bytes_per_processor, group)

    def kind_time(self, kind: str, nbytes: int, group: int) -> float:
        """Seconds of one collective of ``kind`` over ``group`` processors that each contribute ``nbytes``
        (see :meth:`collective_time`).

        Raises:
            ValueError: ``kind`` is no declared collective (:mod:`meshtorch.lowering.collectives`).
        """
        if group <= 1:
            kind_of(kind)  # an undeclared kind is refused even over one processor
            return 0.0
        return self.kind_latency(kind) + self.wire_time(kind, nbytes, group)

    def kind_latency(self, kind: str) -> float:
        """Seconds one call of ``kind`` costs whatever it moves (alpha): the measured latency of that kind, else
        ``latency``. Paid once per process-group call, so a bucket of several values pays it once."""
        return next((alpha for k, alpha, _ in self.collectives if k == kind), self.latency)

    def wire_time(self, kind: str, nbytes: int, group: int) -> float:
        """Seconds to move what each of ``group`` processors sends in a collective of ``kind`` where each holds
        ``nbytes`` (the kind's declared ``wire_bytes``, linear in ``nbytes``, so a bucket's equals the sum over
        its members) over the kind's measured bandwidth, else ``bandwidth``; 0 for ``group`` <= 1.

        Raises:
            ValueError: ``kind`` is no declared collective (:mod:`meshtorch.lowering.collectives`).
        """
        if group <= 1:
            kind_of(kind)  # an undeclared kind is refused even over one processor
            return 0.0
        per_byte = next((b for k, _, b in self.collectives if k == kind), None)
        return _wire(kind, nbytes, group) * (1.0 / self.bandwidth if per_byte is None else per_byte)

    def times_paid(self, group: int, num_processors: int) -> int:
        """How many times one collective over ``group`` processors is paid in a step: once on an SPMD mesh,
        once per processor group (``num_processors // group``) when the processors run in turn (``serial``)."""
        return max(1, num_processors // max(group, 1)) if self.serial else 1


def _wire(kind: str, b: int, group: int) -> float:
    """Bytes each processor sends in a collective of ``kind`` over ``group`` processors that each hold ``b``
    (the kind's declared ``wire_bytes``, :mod:`meshtorch.lowering.collectives`)."""
    return kind_of(kind)[0].wire_bytes(b, group)


def estimate_time(report: MemoryReport, cost: CostModel | None = None) -> dict:
    """``{"compute_s", "comm_s", "total_s"}`` of one run under ``cost`` (default :class:`CostModel`).

    SPMD (``cost.serial`` False): one processor's einsum FLOPs over the FLOP rate, plus its kernel calls
    times ``kernel_overhead``, plus the bytes its slicewise steps read and write over ``memory_bandwidth``, plus
    each collective's wire time once and each collective *call*'s latency once: the calls the scheduled run
    makes (:meth:`MemoryReport.calls`), so the gradient sums of a data-parallel step that an SPMD mesh issues in
    two buckets pay the latency twice, not once per gradient (the bytes are the same). Placement (``serial``):
    the work of every processor one after another (:attr:`MemoryReport.flops_serial`), plus each collective once
    per processor group (the groups of a mesh axis run one after another in one process); the placement mesh
    makes no buckets, so one call per collective.
    """
    cost = cost or CostModel()
    if cost.serial:
        flops, calls = report.flops_serial, report.kernel_calls_serial
        moved = report.kernel_read_bytes_serial + report.kernel_bytes_serial
    else:
        flops, calls = report.flops_per_processor, report.kernel_steps
        moved = report.kernel_read_bytes + report.kernel_bytes
    compute = flops / cost.flop_rate + calls * cost.kernel_overhead
    if cost.memory_bandwidth:
        compute += moved / cost.memory_bandwidth

    comm = 0.0
    for c, n in report.counters.records.items():
        group = _group(report, c.mesh_axes)
        comm += n * cost.times_paid(group, report.num_processors) * cost.wire_time(c.kind, c.bytes_per_processor, group)
    for (kind, axes), n in priced_calls(report).items():
        group = _group(report, axes)
        comm += n * cost.times_paid(group, report.num_processors) * cost.kind_latency(kind)
    return {"compute_s": compute, "comm_s": comm, "total_s": compute + comm}


def _group(report: MemoryReport, mesh_axes) -> int:
    return math.prod(report.mesh_axis_sizes.get(a, 1) for a in mesh_axes)


def priced_calls(report: MemoryReport) -> dict[tuple[str, tuple[str, ...]], int]:
    """``{(kind, mesh axes): calls}`` whose latency :func:`estimate_time` charges for one step of ``report``: the
    collective calls the scheduled run makes (:meth:`MemoryReport.calls`; a gradient bucket is one call) over
    groups of more than one processor (a group of one moves nothing). A placement mesh (``serial``) pays each
    once per processor group on top (:meth:`CostModel.times_paid`)."""
    return {k: n for k, n in report.calls().items() if _group(report, k[1]) > 1}


def transform_time(transforms: Sequence[Transform], cost: CostModel | None = None,
                   mesh_axis_sizes: Sequence[int] = ()) -> float:
    """Communication seconds of a redistribution (:func:`~meshtorch.lowering.layout.plan_redistribute`'s
    transforms) under ``cost`` (default :class:`CostModel`), before the planner emits it.

    ``mesh_axis_sizes``: the mesh's axis sizes by axis index (``[d.size for d in spec.shape]``). Each
    collective transform costs :meth:`CostModel.kind_time` of its kind, its ``nbytes`` and the product of its
    mesh axes' sizes, paid :meth:`CostModel.times_paid` times, exactly as :func:`estimate_time` prices the
    same collective from the program's counters; a local slice moves nothing (its kernel call is compute,
    counted by :func:`estimate_time` with the other slicewise steps).

    Raises:
        ValueError: a transform names a mesh axis beyond ``mesh_axis_sizes``, or an undeclared kind.
    """
    cost = cost or CostModel()
    sizes = [int(s) for s in mesh_axis_sizes]
    total = 0.0
    for tr in transforms:
        if tr.collective is None:
            continue
        if any(not 0 <= a < len(sizes) for a in tr.mesh_axes):
            raise ValueError(f"transform_time: {tr.kind} over mesh axes {list(tr.mesh_axes)}, but mesh_axis_sizes "
                             f"gives {len(sizes)} axes ({sizes}).")
        group = math.prod(sizes[a] for a in tr.mesh_axes)
        total += cost.times_paid(group, math.prod(sizes)) * cost.kind_time(tr.kind, tr.nbytes, group)
    return total

"""An alpha-beta model of one step's time (:class:`CostModel`, :func:`estimate_time`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtorch.lowering.collectives import kind_of
from meshtorch.lowering.counters import Collective
from meshtorch.planning.memory import MemoryReport


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta model of one step's time on each processor (compute and communication add up).

    ``compute = flops_per_processor / flop_rate``; each collective over a group of ``g``
    processors (the product of its mesh-axis sizes) whose members each contribute ``b`` bytes
    costs ``latency + wire_bytes / bandwidth`` with the ring-algorithm wire bytes:

    =============  =====================
    all-reduce     ``2 (g - 1) / g * b``
    all-gather     ``(g - 1) * b``
    all-to-all     ``(g - 1) / g * b``
    reduce-scatter ``(g - 1) / g * b``
    receive/shift  ``b``
    =============  =====================

    Defaults (order of magnitude of one data-centre GPU with NVLink-class links): ``flop_rate``
    1e14 FLOP/s, ``bandwidth`` 1e11 B/s, ``latency`` 1e-5 s per collective.
    :meth:`cpu` gives a multi-core CPU with a 10 GB/s interconnect (1e11, 1e10, 5e-5).
    Overlap of compute and communication, elementwise FLOPs and memory bandwidth are ignored.
    """

    flop_rate: float = 1e14
    bandwidth: float = 1e11
    latency: float = 1e-5

    @classmethod
    def cpu(cls) -> CostModel:
        return cls(flop_rate=1e11, bandwidth=1e10, latency=5e-5)

    def collective_time(self, c: Collective, group: int) -> float:
        """Seconds of one collective ``c`` over a group of ``group`` processors: latency plus the bytes each
        processor sends (the kind's declared ``wire_bytes``, ring algorithms) over the bandwidth.

        Raises:
            ValueError: ``c.kind`` is no declared collective (:mod:`meshtorch.lowering.collectives`).
        """
        b = c.bytes_per_processor
        wire_bytes = kind_of(c.kind)[0].wire_bytes
        if group <= 1:
            return 0.0
        wire = wire_bytes(b, group)
        return self.latency + wire / self.bandwidth


def estimate_time(report: MemoryReport, cost: CostModel | None = None) -> dict:
    """``{"compute_s", "comm_s", "total_s"}`` of one run under ``cost`` (default :class:`CostModel`)."""
    cost = cost or CostModel()
    compute = report.flops_per_processor / cost.flop_rate
    comm = 0.0
    for c, n in report.counters.records.items():
        group = math.prod(report.mesh_axis_sizes.get(a, 1) for a in c.mesh_axes)
        comm += n * cost.collective_time(c, group)
    return {"compute_s": compute, "comm_s": comm, "total_s": compute + comm}

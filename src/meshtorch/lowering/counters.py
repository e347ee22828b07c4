"""Accounting of communication and FLOPs.

Every collective step the lowering emits carries a :class:`Collective` record: its kind, the
mesh axes it runs over, the bytes each processor contributes, and the op that caused it. The
same records are known from shapes and layout rules alone, so the cost of a run is available
*before* running (``Lowering.plan_counters``: the *planned* collectives).

``Lowering.counters`` holds the *executed* ones: the mesh implementations record every collective
call they make in the flight recorder (:mod:`meshtorch.mesh.recorder`), tagged with the step that
asked for it, and :meth:`Counters.from_records` turns a run's records back into this format (kind,
axes and bytes as executed; op and tensor from the step). When a run executes what was planned the
two are equal; :meth:`Counters.diff` lists where they are not (a backend that ran an all-reduce for
a planned reduce-scatter, a bucket that lost a member, a collective that moved other bytes).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    """One collective in the program.

    Attributes:
        kind: ``"allreduce"``, ``"allgather"``, ``"alltoall"``, ``"collective_permute"`` (shift), ...
        mesh_axes: names of the mesh axes it communicates over.
        op: name of the graph operation whose lowering emitted it.
        tensor: name of the tensor being communicated.
        bytes_per_processor: size in bytes of the slice each processor contributes.
        num_processors: processors taking part (the whole mesh).
        reduction: ``"SUM"``/``"MAX"``/``"MIN"`` for all-reduces, else ``""``.
    """

    kind: str
    mesh_axes: tuple[str, ...]
    op: str
    tensor: str
    bytes_per_processor: int
    num_processors: int
    reduction: str = ""

    @property
    def bytes(self) -> int:
        """Total bytes entering the collective, summed over processors."""
        return self.bytes_per_processor * self.num_processors


class Counters:
    """Running totals: collectives executed (with counts and bytes) and einsum FLOPs.

    ``records`` maps each distinct :class:`Collective` to the number of times it ran.
    ``einsum_flops`` counts global (whole-mesh) multiply-add FLOPs (2 per multiply-add).
    ``runs_from_plan``: how many of the ``runs`` were ``torch.compile`` d runs, whose collectives are
    counted from their plan (nothing observes them; see :class:`~meshtorch.lowering.session.Session`).
    """

    def __init__(self):
        self.records: dict[Collective, int] = defaultdict(int)
        self.einsum_flops = 0
        self.runs = 0
        self.runs_from_plan = 0

    @classmethod
    def from_records(cls, records, einsum_flops: int = 0, runs: int = 0) -> Counters:
        """Counters of executed collective calls (flight-recorder records, in call order).

        A record's kind, mesh axes, reduction and bytes are what the mesh implementation ran; its op and
        tensor come from its tag (the planned :class:`Collective` records of the step that made the
        call). A bucket call counts once per value it moved (its ``members``); a single call made under
        a bucket's tag (an implementation without bucket calls) counts for the bucket's members in turn.
        Records without a tag (an export's gather, outside any program step) are not counted.
        ``einsum_flops`` and ``runs`` are taken as given (FLOPs are not measured).
        """
        c = cls()
        c.einsum_flops, c.runs = einsum_flops, runs
        turn: dict = {}
        for r in records:
            tag = r.tag
            if not tag:
                continue
            if r.members is not None:
                pairs = [(tag[i] if i < len(tag) else tag[-1], b) for i, b in zip(r.members, r.parts, strict=True)]
            elif len(tag) == 1:
                pairs = [(tag[0], r.parts[0])]
            else:
                k = turn.get(id(tag), 0)
                turn[id(tag)] = k + 1
                pairs = [(tag[k % len(tag)], b) for b in r.parts]
            for planned, b in pairs:
                if (planned.kind == r.kind and planned.bytes_per_processor == b and planned.mesh_axes == r.mesh_axes
                        and planned.reduction == r.reduction and planned.num_processors == r.num_processors):
                    c.records[planned] += 1  # executed as planned: the same record (no new object per call)
                else:
                    c.records[Collective(r.kind, tuple(r.mesh_axes), planned.op, planned.tensor, b,
                                         r.num_processors, r.reduction)] += 1
        return c

    def diff(self, other: Counters, names: tuple[str, str] = ("planned", "executed")) -> list[str]:
        """Where the collectives of ``self`` and ``other`` differ: one line per record whose count
        differs (``names`` label the two sides); ``[]`` when they are equal. FLOPs are not compared."""
        out = []
        for k in sorted(set(self.records) | set(other.records), key=repr):
            a, b = self.records.get(k, 0), other.records.get(k, 0)
            if a != b:
                red = f"[{k.reduction.lower()}]" if k.reduction else ""
                out.append(f"{k.kind}{red} over {','.join(k.mesh_axes)} of {k.tensor!r} (op {k.op!r}, "
                           f"{k.bytes_per_processor} B/processor): {names[0]} {a}, {names[1]} {b}")
        return out

    def add(self, other: Counters, times: int = 1):
        for k, v in other.records.items():
            self.records[k] += v * times
        self.einsum_flops += other.einsum_flops * times
        self.runs += other.runs * times
        self.runs_from_plan += other.runs_from_plan * times

    def reset(self):
        self.records.clear()
        self.einsum_flops = 0
        self.runs = 0
        self.runs_from_plan = 0

    def collectives(self, kind: str | None = None, mesh_axes=None, op: str | None = None):
        """``[(Collective, count)]`` filtered by kind, mesh axes (tuple of names) and op name."""
        out = []
        for c, n in self.records.items():
            if kind is not None and c.kind != kind:
                continue
            if mesh_axes is not None and tuple(c.mesh_axes) != tuple(mesh_axes):
                continue
            if op is not None and c.op != op:
                continue
            out.append((c, n))
        return out

    def total_bytes(self, kind: str | None = None) -> int:
        return sum(c.bytes * n for c, n in self.records.items() if kind is None or c.kind == kind)

    def count(self, kind: str | None = None) -> int:
        return sum(n for c, n in self.records.items() if kind is None or c.kind == kind)

    def summary(self, detail: bool = False, header: str = "") -> str:
        """A readable table: one row per (collective kind, mesh axes), then per (layer or op family,
        kind, mesh axes) with counts and bytes; ``detail``: also one row per causing op. Columns are
        sized to their contents. ``header``: a line printed under the title (e.g. the mesh, layout
        and storage rules)."""
        compiled = f" ({self.runs_from_plan} compiled, counted from their plan)" if self.runs_from_plan else ""
        lines = [f"communication over {self.runs} run(s){compiled}:"] + ([f"  {header}"] if header else [])
        if not self.records:
            lines.append("  no collectives (everything local)")
        by_kind: dict = defaultdict(lambda: [0, 0])
        by_group: dict = defaultdict(lambda: [0, 0])
        for c, n in self.records.items():
            kind = c.kind + (f"[{c.reduction.lower()}]" if c.reduction and c.reduction != "SUM" else "")
            axes = ",".join(c.mesh_axes)
            for table, key in ((by_kind, (kind, axes)), (by_group, (op_group(c.op), kind, axes))):
                table[key][0] += n
                table[key][1] += c.bytes * n
        if self.records:
            rows = [(k, axes, str(n), _human(b)) for (k, axes), (n, b) in sorted(by_kind.items())]
            lines += _table(("collective", "mesh axes", "count", "bytes"), rows, "llrr")
            lines.append("  by layer (or op family) and collective:")
            rows = [(g, k, axes, str(n), _human(b))
                    for (g, k, axes), (n, b) in sorted(by_group.items(), key=lambda kv: (-kv[1][1], kv[0]))]
            lines += _table(("layer / op family", "collective", "mesh axes", "count", "bytes"), rows, "lllrr")
            if detail:
                lines.append("  by op:")
                rows = [(c.kind, ",".join(c.mesh_axes), c.op, f"x{n}", _human(c.bytes * n))
                        for c, n in sorted(self.records.items(), key=lambda kv: -kv[0].bytes * kv[1])]
                lines += _table(("collective", "mesh axes", "op", "count", "bytes"), rows, "lllrr")
        lines.append(f"  total: {self.count()} collective calls, {_human(self.total_bytes())}; einsum FLOPs: "
                     f"{self.einsum_flops:.3e}")
        return "\n".join(lines)

    def __repr__(self):
        return f"Counters({self.count()} collectives, {self.total_bytes()} bytes, {self.einsum_flops} flops)"


_SUFFIX = re.compile(r"(_grad\d*|_\d+)+$")


def op_group(op: str) -> str:
    """The layer or op family a collective's causing op belongs to: the first two levels of its name
    scope (``layer_0/attention/q_proj_grad1`` -> ``layer_0/attention``, ``layer_0/ffn/wi/kernel`` ->
    ``layer_0/ffn``, ``logits/kernel`` -> ``logits``), or for an op outside any scope its family
    (``reduce_sum_13`` -> ``reduce_sum``, ``gather_grad`` -> ``gather``)."""
    if "/" in op:
        return "/".join(op.split("/")[:-1][:2])
    return _SUFFIX.sub("", op) or op


def _table(headers, rows, align: str, indent: str = "  ") -> list[str]:
    """Lines of a table whose columns are as wide as their widest cell (``align``: ``l``/``r`` per column)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def fmt(r):
        return indent + "  ".join(f"{c:<{w}}" if a == "l" else f"{c:>{w}}"
                                  for c, w, a in zip(r, widths, align, strict=True)).rstrip()
    return [fmt(headers)] + [fmt(r) for r in rows]


def _human(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
    return str(b)

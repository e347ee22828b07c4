"""Planning before running: memory, FLOPs and communication of one run, and a layout search.

Everything here reads the lowered program (:class:`~meshtorch.lowering.Lowering`), never runs it,
so it works on a dry-run lowering (``Lowering(graph, impls, materialize=False)``) that allocates no
variable storage: a model too big for this machine can still be planned.

* :func:`memory_report` -> :class:`MemoryReport`: per processor, the bytes of every variable slice
  (parameters and optimizer slots), plan-time constants, an estimate of the peak bytes of live
  intermediate values while the planned steps of ``fetches`` execute in order, the FLOPs
  (einsum multiply-adds, global and per processor) and every collective with its bytes.
* :class:`CostModel` and :func:`estimate_time`: a simple alpha-beta model of one step's time.
* :func:`search_layouts`: enumerate layout rules for a mesh, drop the illegal ones and those over
  a memory limit, rank the rest by estimated time.

Mesh TensorFlow's ``auto_mtf`` chooses layouts with an integer linear program over a memory
estimate; we do an exhaustive search over one-dimension-per-mesh-axis assignments with an
explicit time model instead (simple, and exact for the small meshes it allows).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from meshtorch.core.errors import LayoutError
from meshtorch.core.graph import Mesh, Operation
from meshtorch.lowering import Lowering
from meshtorch.lowering.counters import Collective, Counters, _human

__all__ = ["CostModel", "MemoryReport", "estimate_time", "memory_report", "search_layouts", "graph_dimensions"]


@dataclass
class MemoryReport:
    """What one run of the fetches costs each processor, known before running.

    Byte figures are per processor (every processor holds equal slices by construction).

    Attributes:
        num_processors: processors of the mesh (the largest mesh if several).
        variables: ``{variable name: bytes of its slice}``.
        trainable_bytes: slices of trainable variables (the parameters).
        non_trainable_bytes: slices of the other variables (optimizer slots, step counter).
        constant_bytes: plan-time constants kept by the lowering (masks, offsets, imported tensors).
        peak_activation_bytes: estimated peak of live intermediate values (placeholder feeds,
            step outputs, collective buffers) while the planned steps run in order, each freed
            after its last use as ``Lowering.run`` does; views are counted as copies, so this
            errs high.
        peak_step: ``(index, op name)`` of the step at which the peak is reached.
        largest_slot_bytes: the largest single intermediate value.
        estimated_slots: intermediate slots whose size the lowering did not record and that
            were estimated (collective outputs from the collective's bytes; other outputs as
            their largest input).
        einsum_flops: global multiply-add FLOPs of the einsums (2 per multiply-add), as
            ``Lowering.plan_counters``.
        flops_per_processor: einsum FLOPs one processor executes: each einsum's FLOPs divided by
            the sizes of the mesh axes that split it (replicated work counts on every processor).
        counters: the planned :class:`~meshtorch.lowering.counters.Counters` (every collective).
        mesh_axis_sizes: ``{mesh axis name: size}``, for the cost model.
        layout: the layout rules, as text (for reports).
        estimated_time: seconds under a :class:`CostModel`, filled in by :func:`search_layouts`.
    """

    num_processors: int
    variables: dict[str, int]
    trainable_bytes: int
    non_trainable_bytes: int
    constant_bytes: int
    peak_activation_bytes: int
    peak_step: tuple[int, str]
    largest_slot_bytes: int
    estimated_slots: int
    einsum_flops: int
    flops_per_processor: int
    counters: Counters
    mesh_axis_sizes: dict[str, int] = field(default_factory=dict)
    layout: str = ""
    estimated_time: dict | None = None

    @property
    def variable_bytes(self) -> int:
        """All variable slices held by one processor."""
        return self.trainable_bytes + self.non_trainable_bytes

    @property
    def total_bytes(self) -> int:
        """Variables + constants + peak activations: the per-processor memory estimate."""
        return self.variable_bytes + self.constant_bytes + self.peak_activation_bytes

    def communication(self) -> dict[tuple[str, tuple[str, ...]], tuple[int, int]]:
        """``{(kind, mesh axes): (count, bytes per processor)}`` for one run."""
        out: dict = defaultdict(lambda: [0, 0])
        for c, n in self.counters.records.items():
            out[(c.kind, tuple(c.mesh_axes))][0] += n
            out[(c.kind, tuple(c.mesh_axes))][1] += c.bytes_per_processor * n
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}

    def summary(self) -> str:
        """A readable table of the report."""
        n = self.num_processors
        lines = [f"plan for {n} processor(s){' layout ' + repr(self.layout) if self.layout else ''} "
                 "(bytes per processor):",
                 f"  parameters (trainable variables)   {_human(self.trainable_bytes):>12}",
                 f"  other variables (optimizer state)  {_human(self.non_trainable_bytes):>12}",
                 f"  constants                          {_human(self.constant_bytes):>12}",
                 f"  peak activations (estimate)        {_human(self.peak_activation_bytes):>12}"
                 f"   at step {self.peak_step[0]} ({self.peak_step[1]})",
                 f"  total                              {_human(self.total_bytes):>12}",
                 f"  largest single activation          {_human(self.largest_slot_bytes):>12}"
                 + (f"   ({self.estimated_slots} slot size(s) estimated)" if self.estimated_slots else ""),
                 f"einsum FLOPs per step: {self.einsum_flops:.3e} global, {self.flops_per_processor:.3e} "
                 "per processor"]
        comm = self.communication()
        if not comm:
            lines.append("communication per step: none (everything local)")
        else:
            total = sum(b for _, b in comm.values())
            lines.append(f"communication per step: {sum(c for c, _ in comm.values())} collectives, "
                         f"{_human(total)} per processor")
            lines.append(f"  {'collective':<12}{'mesh axes':<16}{'count':>7}{'bytes/processor':>18}")
            for (kind, axes), (count, b) in comm.items():
                lines.append(f"  {kind:<12}{','.join(axes):<16}{count:>7}{_human(b):>18}")
        if self.estimated_time:
            t = self.estimated_time
            lines.append(f"estimated step time: {t['total_s'] * 1e3:.3f} ms (compute {t['compute_s'] * 1e3:.3f} ms, "
                         f"communication {t['comm_s'] * 1e3:.3f} ms)")
        return "\n".join(lines)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _tensor_slice_bytes(lowering: Lowering, t) -> int:
    return int(np.prod(lowering.slice_shape(t), dtype=np.int64)) * _itemsize(t.dtype)


def _value_bytes(v) -> float:
    """Per-processor bytes of a laid-out value (a list of per-processor slices, or one slice)."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, list | tuple) and v:
        return sum(_value_bytes(x) for x in v) / len(v)
    return 0


def _step_records(steps, out: dict):
    """``{output slot: Step}`` over a step list and its sub-programs."""
    for st in steps:
        for o in st.outputs:
            out[o] = st
        for _, sub in st.subprograms:
            _step_records(sub.listing, out)
    return out


class _Sizer:
    """Per-processor byte size of every slot of a lowering (recorded, or estimated)."""

    def __init__(self, lowering: Lowering):
        self.lw = lowering
        self.records = _step_records(lowering.steps, {})
        prog = lowering.program
        self.free = {v.slot for v in prog.variables.values()} | set(prog.constants)  # counted elsewhere
        self.axis_sizes = {d.name: d.size for impl in lowering.mesh_to_impl.values() for d in impl.shape}
        self.cache: dict[int, int] = {}
        self.estimated = 0

    def __call__(self, slot: int) -> int:
        if slot in self.free:
            return 0
        b = self.lw.slot_bytes.get(slot)
        if b is not None:
            return b
        if slot not in self.cache:
            self.cache[slot] = self._estimate(slot)
            self.estimated += 1
        return self.cache[slot]

    def _estimate(self, slot: int) -> int:
        st = self.records.get(slot)
        if st is None:
            return 0
        c: Collective | None = st.collective
        if c is not None:
            group = math.prod(self.axis_sizes.get(a, 1) for a in c.mesh_axes)
            return c.bytes_per_processor * (group if c.kind == "allgather" else 1)
        return max((self(i) for i in st.inputs), default=0)


def _walk(steps, all_frees, size, records, live: int = 0) -> tuple[int, int, int]:
    """(peak live bytes, index of the peak step, largest slot) of executing ``steps`` in order
    (freeing ``all_frees[i]`` after step ``i``), starting with ``live`` bytes (the feeds) live."""
    peak = live
    peak_i, largest = -1, 0
    for i, (st, frees) in enumerate(zip(steps, all_frees, strict=True)):
        outs = st.outputs
        out_b = [size(o) for o in outs]
        largest = max([largest, *out_b])
        transient = 0
        for _, sub in st.subprograms:
            sub_peak, _, sub_largest = _walk(sub.steps, sub.frees, size, records)
            transient = max(transient, sub_peak)
            largest = max(largest, sub_largest)
        if live + sum(out_b) + transient > peak:
            peak, peak_i = live + sum(out_b) + transient, i
        live += sum(out_b)
        for f in frees:
            live -= size(f)
    return peak, peak_i, largest


def _split_factor(lowering: Lowering, op: Operation) -> int:
    """Product of the mesh-axis sizes splitting any input or output of ``op`` (an einsum splits
    its computation over each of them; operands split differently are all-gathered first)."""
    impl = lowering.mesh_impl(op)
    axes = {a for t in [*op.inputs, *op.outputs] for a in lowering.tensor_layout(t) if a is not None}
    return math.prod(impl.shape[a].size for a in axes)


def memory_report(lowering: Lowering, fetches) -> MemoryReport:
    """Memory, FLOPs and communication of one ``lowering.run(fetches)``, without running it.

    Args:
        lowering: a Lowering (``materialize=False`` is enough).
        fetches: what ``run`` would fetch (a Tensor/Operation or a list, e.g. ``[loss] + updates``).

    Returns:
        A :class:`MemoryReport` (bytes per processor; see its attributes for what is estimated).
        While-loop bodies count once for memory and zero times for FLOPs and communication, as in
        ``Lowering.plan_counters`` (the trip count is unknown before running).

    Raises:
        ValueError / TypeError: as ``Lowering.run`` for fetches that are not part of the lowering.
    """
    fetches = list(fetches) if isinstance(fetches, list | tuple) else [fetches]
    prog = lowering.plan(fetches)
    size = _Sizer(lowering)
    variables, trainable, other = {}, 0, 0
    for var in lowering.variables:
        b = _tensor_slice_bytes(lowering, var.outputs[0])
        variables[var.name] = b
        if var.trainable:
            trainable += b
        else:
            other += b
    constants = int(sum(_value_bytes(v) for v in lowering.session.constant_values.values()))
    inputs = sum(size(s) for _, s in prog.placeholders)
    peak, peak_i, largest = _walk(prog.steps, prog.frees, size, size.records, live=inputs)
    largest = max([largest, *(size(s) for _, s in prog.placeholders)])
    peak_op = "<feeds>" if peak_i < 0 else prog.steps[peak_i].op
    ops = {op.name: op for op in lowering.graph.operations}
    local_flops = 0
    for st in prog.steps:
        if st.flops:
            op = ops.get(st.op)
            local_flops += st.flops // (_split_factor(lowering, op) if op is not None else 1)
    impls = list(lowering.mesh_to_impl.values())
    return MemoryReport(
        num_processors=max((i.size for i in impls), default=1), variables=variables, trainable_bytes=trainable,
        non_trainable_bytes=other, constant_bytes=constants, peak_activation_bytes=peak,
        peak_step=(peak_i, peak_op), largest_slot_bytes=largest, estimated_slots=size.estimated,
        einsum_flops=prog.counters.einsum_flops, flops_per_processor=local_flops,
        counters=lowering.plan_counters(fetches), mesh_axis_sizes=dict(size.axis_sizes),
        layout="; ".join(str(i.layout_rules) for i in impls if str(i.layout_rules)))


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
        """Seconds of one collective ``c`` over a group of ``group`` processors."""
        b = c.bytes_per_processor
        if group <= 1:
            return 0.0
        wire = {"allreduce": 2 * (group - 1) / group * b, "allgather": (group - 1) * b,
                "alltoall": (group - 1) / group * b}.get(c.kind, b)
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


def graph_dimensions(graph) -> list[str]:
    """Names of every dimension of every tensor of ``graph``, in order of first appearance."""
    names: dict[str, None] = {}
    for op in graph.operations:
        for t in op.outputs:
            for d in t.shape:
                names.setdefault(d.name, None)
    return list(names)


def candidate_layouts(dim_names: Sequence[str], mesh_axes: Sequence[str], dim_sizes: dict | None = None,
                      axis_sizes: dict | None = None) -> list[str]:
    """All layout rules giving each mesh axis at most one dimension (each dimension at most one
    axis), in order of ``dim_names`` per axis (the all-replicated ``""`` last).

    With sizes (``dim_sizes``: name -> set of sizes; ``axis_sizes``: axis -> size), dims not
    divisible by an axis are skipped, and of the rules that differ only by swapping mesh axes of
    equal size (``batch:data;heads:model`` vs ``heads:data;batch:model`` on a 2x2 mesh) only the
    first is kept: the cost model cannot tell them apart.
    """
    out, seen = [], set()
    options = [[*dim_names, None] for _ in mesh_axes]
    for combo in itertools.product(*options):
        used = [d for d in combo if d is not None]
        if len(used) != len(set(used)):
            continue
        if axis_sizes:
            key = frozenset((d, axis_sizes[a]) for d, a in zip(combo, mesh_axes, strict=True) if d is not None)
            if key in seen:
                continue
            seen.add(key)
        if dim_sizes and axis_sizes and any(
                d is not None and any(s % axis_sizes[a] for s in dim_sizes.get(d, ()))
                for d, a in zip(combo, mesh_axes, strict=True)):
            continue
        out.append(";".join(f"{d}:{a}" for d, a in zip(combo, mesh_axes, strict=True) if d is not None))
    return out


def _rule_pairs(rules: str) -> list[tuple[str, str]]:
    return [tuple(p.split(":")) for p in rules.replace(",", ";").split(";") if p.strip()]


def _rules_str(pairs, dim_names: Sequence[str], axes: Sequence[str]) -> str:
    """Canonical rule text: by mesh axis, then by the dims' order in the graph."""
    def pos(seq, x):
        return list(seq).index(x) if x in seq else len(seq)

    pairs = sorted(pairs, key=lambda p: (pos(axes, p[1]), pos(dim_names, p[0]), p))
    return ";".join(f"{d}:{a}" for d, a in pairs)


def _default_fetches(built):
    if isinstance(built, tuple):
        return built[2]
    fetches = [built.loss]
    fetches += list(getattr(built, "updates", []) or [])
    return fetches


def search_layouts(build_fn: Callable, mesh_shape, candidate_rules: Sequence[str] | None = None,
                   memory_limit_bytes: int | None = None, fetches_fn: Callable | None = None,
                   cost: CostModel | None = None, max_candidates: int = 256,
                   refine: int | None = None) -> list[tuple[str, MemoryReport]]:
    """Rank layout rules for a model on a mesh by estimated step time (best first).

    Args:
        build_fn: ``build_fn()`` returns the model: a tuple ``(graph, mesh, fetches)``, or an
            object with ``.graph``, ``.mesh`` and ``.loss`` (and optionally ``.updates``), such as
            :class:`~meshtorch.models.transformer.LMGraph`. Called once; every candidate lowers
            the same graph (dry run, no variable storage).
        mesh_shape: e.g. ``"data:2,model:2"`` (at most 3 axes for the default candidates).
        candidate_rules: layout-rule strings to try; default :func:`candidate_layouts` of the
            graph's dimension names over the mesh axes (the replicated layout included).
        memory_limit_bytes: drop layouts whose per-processor ``MemoryReport.total_bytes`` exceeds it.
        fetches_fn: ``fetches_fn(model) -> fetches`` (default: the tuple's third item, or
            ``[model.loss] + model.updates``).
        cost: the :class:`CostModel` (default ``CostModel()``).
        max_candidates: try at most this many candidates (in enumeration order).
        refine: then improve the best ``refine`` layouts greedily: add the one ``dim:axis`` rule
            (several dims may share an axis, e.g. ``heads:model;d_ff:model``) that lowers the
            estimated time most (or, over the memory limit, the memory), until none does. 0: off;
            default 3, or 0 when ``candidate_rules`` are given (only those are tried).

    Returns:
        ``[(layout rules, MemoryReport)]`` of every legal layout tried that fits the limit (one
        of each set equal up to swapping mesh axes of one size), sorted by
        ``report.estimated_time["total_s"]`` (ties:
        smaller ``total_bytes``). Illegal layouts (``LayoutError`` from the lowering: size not
        divisible, a dimension an op needs whole split, two dims of one tensor on one axis) are left out.

    Raises:
        ValueError: a default search on a mesh of more than 3 axes, or no legal candidate fits.
    """
    from meshtorch.mesh.placement import PlacementMeshImpl

    built = build_fn()
    graph, mesh = (built[0], built[1]) if isinstance(built, tuple) else (built.graph, built.mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"search_layouts: build_fn must give a Mesh, got {mesh!r}.")
    fetches = fetches_fn(built) if fetches_fn is not None else _default_fetches(built)
    cost = cost or CostModel()
    probe = PlacementMeshImpl(mesh_shape, "")
    axis_sizes = {d.name: d.size for d in probe.shape}
    default_candidates = candidate_rules is None
    if default_candidates:
        if len(axis_sizes) > 3:
            raise ValueError(f"search_layouts: the default exhaustive search allows at most 3 mesh axes, "
                             f"got {list(axis_sizes)}; pass candidate_rules.")
        sizes: dict[str, set] = defaultdict(set)
        for op in graph.operations:
            for t in op.outputs:
                for d in t.shape:
                    sizes[d.name].add(d.size)
        candidate_rules = candidate_layouts(graph_dimensions(graph), list(axis_sizes), sizes, axis_sizes)
    limit = memory_limit_bytes
    if refine is None:
        refine = 3 if default_candidates else 0
    scored: dict[str, MemoryReport | None] = {}

    def score(rules: str) -> MemoryReport | None:
        if rules not in scored:
            try:
                lw = Lowering(graph, {mesh: PlacementMeshImpl(mesh_shape, rules)}, materialize=False)
            except LayoutError:
                scored[rules] = None
                return None
            rep = memory_report(lw, fetches)
            rep.layout = rules
            rep.estimated_time = estimate_time(rep, cost)
            scored[rules] = rep
        return scored[rules]

    def rank(rep: MemoryReport):  # layouts over the limit rank after every layout within it
        over = limit is not None and rep.total_bytes > limit
        return (over, rep.total_bytes if over else 0, rep.estimated_time["total_s"], rep.total_bytes)

    for rules in list(candidate_rules)[:max_candidates]:
        score(rules)
    dim_names = graph_dimensions(graph)
    seeds = sorted((r for r in scored.values() if r is not None), key=rank)[:refine]
    for rep in seeds:  # greedy: add one more dim:axis rule while that lowers the rank
        while True:
            pairs = _rule_pairs(rep.layout)
            used = {d for d, _ in pairs}
            nbrs = [score(_rules_str(pairs + [(d, a)], dim_names, list(axis_sizes)))
                    for d in dim_names if d not in used for a in axis_sizes]
            nbrs = [r for r in nbrs if r is not None and rank(r) < rank(rep)]
            if not nbrs:
                break
            rep = min(nbrs, key=rank)
    results, seen = [], set()
    for rules, r in sorted(((k, r) for k, r in scored.items() if r is not None), key=lambda kr: rank(kr[1])):
        groups = defaultdict(set)
        for d, a in _rule_pairs(rules):
            groups[a].add(d)
        key = frozenset((axis_sizes.get(a, a), frozenset(ds)) for a, ds in groups.items())
        if key not in seen and (limit is None or r.total_bytes <= limit):
            seen.add(key)
            results.append((rules, r))
    if not results:
        raise ValueError(f"search_layouts: no legal layout on mesh {mesh_shape!r} fits "
                         f"{'the memory limit ' + _human(limit) if limit else 'the graph'}.")
    results.sort(key=lambda r: (r[1].estimated_time["total_s"], r[1].total_bytes))
    return results

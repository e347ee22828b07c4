"""Memory, FLOPs and communication of one run of a lowered program, before running it.

:func:`memory_report` -> :class:`MemoryReport`: per processor, the bytes of every variable slice
(parameters and optimizer slots), plan-time constants, an estimate of the peak bytes of live
intermediate values while the planned steps of ``fetches`` execute in order, the FLOPs (einsum
multiply-adds, global and per processor) and every collective with its bytes. It reads a planned
program (:func:`meshtorch.lowering.stages.plan`: no backend, no variable storage), never runs it; a
:class:`~meshtorch.lowering.Lowering` is accepted too (its program and its session's schedule are read).

Under storage rules (FSDP / ZeRO-3, ``MeshSpec(..., storage="d_model:data")``) variables and
optimizer slots are counted as the shards they are stored as; the gathered full weights and the
unreduced (partial-sum) gradients are intermediate values, counted in the peak activations.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from meshtorch.core.layout import TensorLayout
from meshtorch.lowering.collectives import kind_of
from meshtorch.lowering.counters import Collective, Counters, _human
from meshtorch.lowering.donate import donated_mask, donates_input
from meshtorch.lowering.layout import slice_nbytes
from meshtorch.lowering.plans import Processes
from meshtorch.lowering.program import Program, TensorSlot
from meshtorch.lowering.stages import op_mesh_axes, schedule
from meshtorch.planning.pipeline import PipelinePlan, pipeline_plan

__all__ = ["MemoryReport", "memory_report"]


@dataclass
class MemoryReport:
    """What one run of the fetches costs each processor, known before running.

    Byte figures are per processor (every processor holds equal slices by construction).

    Attributes:
        num_processors: processors of the mesh (the largest mesh if several).
        variables: ``{variable name: bytes of its slice}``.
        trainable_bytes: slices of trainable variables (the parameters), in their storage layout.
        non_trainable_bytes: slices of the other variables (optimizer slots, step counter).
        gradient_bytes: the gradients the fetched updates apply, one per trainable variable assigned
            by a fetched ``Assign``, each in its variable's storage layout and dtype (what the
            update reads: a shard under storage rules). They are intermediate values, so they are
            also part of ``peak_activation_bytes`` (not added again to ``total_bytes``); 0 when no
            update of a trainable variable is fetched.
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
        collective_calls: ``{(kind, mesh axes): calls}``: the collective calls the scheduled run makes, a bucket
            step (:mod:`meshtorch.lowering.schedule`, the gradient buckets of an SPMD mesh) one call of its
            members' kind (:func:`collective_calls`); None (a report built by hand): one call per planned
            collective of ``counters``. The cost model charges each call's latency once.
        mesh_axis_sizes: ``{mesh axis name: size}``, for the cost model.
        layout: the layout rules, as text (for reports).
        storage: the storage rules, as text ("" when variables are stored in the compute layout).
        estimated_time: seconds under a :class:`CostModel`, filled in by :func:`search_layouts`.
        kernel_steps: slicewise steps of the run (kernel calls of one processor).
        kernel_calls_serial / flops_serial: kernel calls and einsum FLOPs of a one-process simulation of the
            mesh (a placement mesh) as ``meshtorch train`` runs it: one processor's times the processors (split
            values, collective outputs and updated variables are not shared between replicas, and train feeds
            each processor its own slice of the batch, so even a replicated layout runs every processor's
            kernels).
        kernel_bytes / kernel_bytes_serial: bytes the slicewise steps write per processor / in a one-process
            simulation (the memory traffic of the elementwise work between the einsums).
        kernel_read_bytes / kernel_read_bytes_serial: bytes the slicewise steps read (their inputs' slices), per
            processor / in a one-process simulation: a fused step's work scales with what it reads (a softmax
            cross-entropy reads ``[batch, length, vocab]`` logits and writes ``[batch, length]``), and under a
            layout that repeats the batch over a mesh axis every processor of it reads the whole batch's.
        pipeline: for a pipelined graph (one with a ``pipeline_schedule``), its
            :class:`~meshtorch.planning.pipeline.PipelinePlan` (bubble fraction, collectives over the stage
            axis, stacked vs other weights per processor); None otherwise.
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
    collective_calls: dict[tuple[str, tuple[str, ...]], int] | None = None
    layout: str = ""
    estimated_time: dict | None = None
    gradient_bytes: int = 0
    storage: str = ""
    kernel_steps: int = 0
    kernel_calls_serial: int = 0
    kernel_bytes: int = 0
    kernel_bytes_serial: int = 0
    kernel_read_bytes: int = 0
    kernel_read_bytes_serial: int = 0
    flops_serial: int = 0
    pipeline: PipelinePlan | None = None
    remat: str | None = None  # set by the search when it needed a heavier ``--remat`` than asked to fit a limit
    #: set by :func:`~meshtorch.planning.budget.fit_memory_limit` when the plan fits a limit only with the weight
    #: gathers of :data:`~meshtorch.planning.budget.LEAN_GATHERS` (no kept forward gather, no prefetch)
    lean_gathers: bool = False

    @property
    def parameter_bytes(self) -> int:
        """The parameters' slices (``trainable_bytes``)."""
        return self.trainable_bytes

    @property
    def optimizer_state_bytes(self) -> int:
        """Optimizer slots and step counters (``non_trainable_bytes``)."""
        return self.non_trainable_bytes

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state per processor (what FSDP divides by the data axis)."""
        return self.trainable_bytes + self.gradient_bytes + self.non_trainable_bytes

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

    def calls(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """``{(kind, mesh axes): calls}`` of one run: :attr:`collective_calls`, or one call per planned collective
        of :attr:`counters` when that is None."""
        if self.collective_calls is not None:
            return dict(self.collective_calls)
        return {k: n for k, (n, _) in self.communication().items()}

    def summary(self) -> str:
        """A readable table of the report."""
        n = self.num_processors
        lines = [f"plan for {n} processor(s){' layout ' + repr(self.layout) if self.layout else ''}"
                 f"{' storage ' + repr(self.storage) if self.storage else ''} (bytes per processor):",
                 f"  parameters (trainable variables)   {_human(self.trainable_bytes):>12}",
                 f"  gradients (in peak activations)    {_human(self.gradient_bytes):>12}",
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
            count = sum(c for c, _ in comm.values())
            calls = sum(self.calls().values())
            in_calls = f" in {calls} calls (buckets)" if calls != count else ""
            lines.append(f"communication per step: {count} collectives{in_calls}, {_human(total)} per processor")
            lines.append(f"  {'collective':<16}{'mesh axes':<16}{'count':>7}{'bytes/processor':>18}")
            for (kind, axes), (count, b) in comm.items():
                lines.append(f"  {kind:<16}{','.join(axes):<16}{count:>7}{_human(b):>18}")
        if self.pipeline is not None:
            lines.extend(self.pipeline.lines())
        if self.estimated_time:
            t = self.estimated_time
            lines.append(f"estimated step time: {t['total_s'] * 1e3:.3f} ms (compute {t['compute_s'] * 1e3:.3f} ms, "
                         f"communication {t['comm_s'] * 1e3:.3f} ms)")
        return "\n".join(lines)


def slot_slice_bytes(slot: TensorSlot, spec) -> int:
    """Per-processor bytes of a program value (a variable, placeholder or result) in its layout on ``spec``."""
    return slice_nbytes(spec.slice_shape(slot.shape, TensorLayout(slot.layout)), slot.dtype)


def constant_bytes(program: Program, specs: dict) -> int:
    """Per-processor bytes of ``program``'s constants (run counters excluded) on ``{mesh name: MeshSpec}``, from
    their shapes: per-processor constants are made on the meta device (:class:`~meshtorch.lowering.plans.Processes`),
    imported tensors counted as their slices."""
    def one(kind, mesh, data) -> float:
        spec = specs[mesh]
        if kind == "pnum":
            view = Processes(spec)
            return _value_bytes([data(view, p) for p in range(spec.size)])
        full, layout = data
        sizes = [n // (1 if a is None else spec.shape[a].size) for n, a in zip(full.shape, layout, strict=True)]
        return math.prod(sizes) * full.element_size()
    return int(sum(one(*c) for c in program.constants.values() if c[0] != "run_counter"))


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
    """Per-processor byte size of every slot of a program (recorded, or estimated)."""

    def __init__(self, program: Program, specs: dict):
        self.slot_bytes = program.slot_bytes
        self.records = _step_records(program.steps, {})
        self.free = {v.slot for v in program.variables.values()} | set(program.constants)  # counted elsewhere
        self.axis_sizes = {d.name: d.size for spec in specs.values() for d in spec.shape}
        self.cache: dict[int, int] = {}
        self.estimated = 0

    def __call__(self, slot: int) -> int:
        if slot in self.free:
            return 0
        b = self.slot_bytes.get(slot)
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
        if c is not None:  # the kind's declared shape rule, in bytes
            group = math.prod(self.axis_sizes.get(a, 1) for a in c.mesh_axes)
            return kind_of(c.kind)[0].output_bytes(c.bytes_per_processor, group)
        return max((self(i) for i in st.inputs), default=0)


def _workspace(st, in_b: list[int], out_b: list[int]) -> int:
    """Bytes a collective step holds beyond its outputs while it runs: the buffers
    :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` packs and unpacks (flat buckets, copies that move the
    gathered or scattered tensor axis to the front), as each kind declares it
    (:mod:`meshtorch.lowering.collectives`). Kernels' own temporaries are not modelled."""
    if st.kind in ("slicewise", "call"):
        return 0
    c, bucket = kind_of(st.kind)
    return (c.bucket_workspace if bucket else c.workspace)(st.params, in_b, out_b)


def _walk(steps, all_frees, size, records, live: int = 0) -> tuple[int, int, int]:
    """(peak live bytes, index of the peak step, largest slot) of executing ``steps`` in order
    (freeing ``all_frees[i]`` after step ``i``), starting with ``live`` bytes (the feeds) live."""
    peak = live
    peak_i, largest = -1, 0
    for i, (st, frees) in enumerate(zip(steps, all_frees, strict=True)):
        outs = st.outputs
        in_place = donated_mask(st)  # in-place updates: these outputs are the variables' own storage
        out_b = [0 if k < len(in_place) and in_place[k] else size(o) for k, o in enumerate(outs)]
        largest = max([largest, *out_b])
        transient = 0
        for _, sub in st.subprograms:
            sub_peak, _, sub_largest = _walk(sub.steps, sub.frees, size, records)
            transient = max(transient, sub_peak)
            largest = max(largest, sub_largest)
        transient = max(transient, _workspace(st, [size(s) for s in st.inputs], out_b))
        if live + sum(out_b) + transient > peak:
            peak, peak_i = live + sum(out_b) + transient, i
        live += sum(out_b)
        for f in frees:
            if any(in_place) and donates_input(st) and f == st.inputs[0]:
                continue  # a donated all-reduce: its output (counted 0 above) holds the input's bytes on
            live -= size(f)
    return peak, peak_i, largest


def collective_calls(steps) -> dict[tuple[str, tuple[str, ...]], int]:
    """``{(kind, mesh axes): calls}`` of scheduled ``steps`` (a :class:`~meshtorch.lowering.plans.Plan`'s, after
    the scheduling passes of :mod:`meshtorch.lowering.schedule` that the executor runs too): each collective step
    is one call, a bucket step one call of its members' kind (the mesh implementation's bucket method moves
    them as one flat buffer per dtype: one call for a bucket of one dtype). Steps inside a loop body count zero
    times, as the counters do."""
    calls: dict = defaultdict(int)
    for st in steps:
        if st.planned:
            c = st.planned[0]
            calls[(c.kind, tuple(c.mesh_axes))] += 1
    return dict(calls)


def _split_factor(spec, axes) -> int:
    """Product of the sizes of mesh ``axes`` (those splitting any input or output of an op: an einsum splits
    its computation over each of them; operands split differently are all-gathered first)."""
    return math.prod(spec.shape[a].size for a in axes)


def memory_report(program, fetches=None, given: tuple = (), stash: tuple = ()) -> MemoryReport:
    """Memory, FLOPs and communication of one run of a planned program's fetches, without running it.

    Args:
        program: a :class:`~meshtorch.lowering.program.Program` from :func:`meshtorch.lowering.stages.plan`
            (its fetch set and schedule options are the program's), or a
            :class:`~meshtorch.lowering.Lowering` (``materialize=False`` is enough; its session's schedule).
        fetches: with a Lowering, what ``run`` would fetch (a Tensor/Operation or a list, e.g.
            ``[loss] + updates``); with a Program, None.
        given, stash: with a Lowering, the slots of a :meth:`~meshtorch.lowering.Lowering.run_stashed` run:
            ``given`` values are handed in (their producing steps pruned; the caller holds them, so they are
            not counted), ``stash`` slots are kept to the end of the run (counted from their step on).

    Returns:
        A :class:`MemoryReport` (bytes per processor; see its attributes for what is estimated).
        While-loop bodies count once for memory and zero times for FLOPs and communication, as in
        ``Lowering.plan_counters`` (the trip count is unknown before running).

    Raises:
        ValueError / TypeError: as ``Lowering.run`` for fetches that are not part of the lowering; fetches
            given with a Program (plan them with ``plan(graph, fetches, spec)``).
    """
    if isinstance(program, Program):
        if fetches is not None or given or stash:
            raise ValueError("memory_report: a Program reports the fetch set it was planned for; plan these "
                             "fetches with meshtorch.lowering.stages.plan(graph, fetches, spec) instead.")
        return _report(program, schedule(program), program.specs, program.op_axes, program.pipeline)
    lw = program  # the Mesh TF-style facade: its program, its session's schedule
    fetches = list(fetches) if isinstance(fetches, list | tuple) else [fetches]
    plan = lw.plan(fetches, given, stash)
    return _report(lw.program, plan, {m.name: s for m, s in lw.mesh_to_spec.items()},
                   op_mesh_axes(lw.planner, lw.graph.operations), getattr(lw.graph, "pipeline_schedule", None))


def _report(program: Program, prog, specs: dict, op_axes: dict, pipeline) -> MemoryReport:
    """The report of ``prog`` (the fetch set's :class:`~meshtorch.lowering.plans.Plan`) of ``program``."""
    size = _Sizer(program, specs)
    variables, trainable, other = {}, 0, 0
    trainable_names = set(program.trainable)
    for name, slot in program.variables.items():
        b = slot_slice_bytes(slot, specs[slot.mesh])
        variables[name] = b
        if name in trainable_names:
            trainable += b
        else:
            other += b
    assigned = {name for name, _ in prog.assignments}
    gradient_bytes = sum(variables[n] for n in program.variables if n in trainable_names and n in assigned)
    constants = constant_bytes(program, specs)
    inputs = sum(size(s) for _, s in prog.placeholders)
    peak, peak_i, largest = _walk(prog.steps, prog.frees, size, size.records, live=inputs)
    largest = max([largest, *(size(s) for _, s in prog.placeholders)])
    peak_op = "<feeds>" if peak_i < 0 else prog.steps[peak_i].op
    local_flops = kernel_steps = kernel_bytes = kernel_read = 0
    for st in prog.steps:
        if st.flops:  # the einsum's work, divided by the axes that split it
            axes = op_axes.get(st.op)
            local_flops += st.flops // (_split_factor(specs[st.mesh], axes) if axes is not None else 1)
        if st.kind == "slicewise":
            kernel_steps += 1
            kernel_bytes += sum(size(s) for s in st.outputs)
            kernel_read += sum(size(s) for s in st.inputs)
    # a one-process simulation runs every processor's kernels: once any value is split, results stop being
    # shared between replicas (collective outputs, updated variables); and even a fully replicated program
    # gets one fed slice per processor from train's feed_slices=True batches, so its replicas share nothing
    # either (measured 2026-11-27: tiny preset, replicated on data:2,model:2, 325-450 ms per step with sliced
    # feeds, 113-115 ms with whole-batch feeds, 77-82 ms on one processor)
    serial = max((spec.size for spec in specs.values()), default=1)  # processors a one-process simulation runs
    impls = list(specs.values())
    counters = Counters()
    counters.add(prog.counters)
    return MemoryReport(
        num_processors=max((i.size for i in impls), default=1), variables=variables, trainable_bytes=trainable,
        non_trainable_bytes=other, constant_bytes=constants, peak_activation_bytes=peak,
        peak_step=(peak_i, peak_op), largest_slot_bytes=largest, estimated_slots=size.estimated,
        einsum_flops=prog.counters.einsum_flops, flops_per_processor=local_flops,
        counters=counters, mesh_axis_sizes=dict(size.axis_sizes), collective_calls=collective_calls(prog.steps),
        layout="; ".join(str(i.layout_rules) for i in impls if str(i.layout_rules)),
        gradient_bytes=gradient_bytes, storage="; ".join(str(i.storage_rules) for i in impls if str(i.storage_rules)),
        kernel_steps=kernel_steps, kernel_calls_serial=kernel_steps * serial, kernel_bytes=kernel_bytes,
        kernel_bytes_serial=kernel_bytes * serial, flops_serial=local_flops * serial,
        kernel_read_bytes=kernel_read, kernel_read_bytes_serial=kernel_read * serial,
        pipeline=pipeline_plan(program, variables, counters, peak, specs=specs, schedule=pipeline))

"""The pipeline lines of a plan (:class:`PipelinePlan`): bubble, collective-permutes, weights per processor.

A pipelined graph (``LMConfig(pipeline_stages=S, microbatches=M, pipeline_repeats=R)``) stacks its layers'
weights on a ``stage`` dimension and runs ``M*R + S - 1`` unrolled iterations, each a shift of the state
``[stage, micro_batch, length, d_model]`` along ``stage`` (a collective-permute when a mesh axis splits
``stage``, rule ``stage:<axis>``) and the block computed on every stage (GSPMD's and praxis's
``LayerwiseShardablePipelined``; the schedule is the graph's ``pipeline_schedule``). What this module adds to
a :class:`~meshtorch.planning.memory.MemoryReport`, read from the lowered program and never run:

* the bubble fraction ``(S-1)/(M*R+S-1)`` of the schedule: every stage computes in every iteration, so the
  bubble is work on empty slots, priced by the cost model like any work (the unrolled program holds
  ``M*R+S-1`` iterations, each one stage's block per processor: :func:`meshtorch.planning.estimate_time`
  charges ``(M*R+S-1)`` iterations, not ``M*R``);
* the collectives over the ``stage`` axis, per step and per iteration, with their bytes per processor;
* the weights per processor: the stacked ones (a ``stage`` dimension: ``1/S`` of the stack when ``stage`` is
  split over an axis of size ``S``) and the rest (embeddings, final norm, logits: replicated over the stage
  axis unless other rules split them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from meshtorch.core.errors import UsageError
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.core.schedules import ScheduleTable, build_schedule
from meshtorch.lowering.counters import Counters, _human

__all__ = ["STAGE_DIM", "PipelinePlan", "default_microbatches", "pipeline_candidates", "pipeline_plan",
           "schedule_flag", "schedule_table"]

#: the dimension a pipelined graph stacks its stages' weights and state on (layout rule ``stage:<axis>``)
STAGE_DIM = "stage"


@dataclass(frozen=True)
class PipelinePlan:
    """What a pipelined step costs each processor, known before running.

    Attributes:
        stages, microbatches, repeats: the schedule's ``S``, ``M``, ``R``.
        iterations: ``M*R + S - 1`` (the unrolled loop's length).
        bubble_fraction: ``(S-1) / (M*R + S - 1)``: the share of every stage's iterations without a microbatch.
        stage_axis: the mesh axis splitting ``stage`` (None: not split, every processor holds every stage and
            the shift is local).
        stage_split: that axis's size (1 if none).
        stage_collectives: ``{kind: (count per step, bytes per processor per step)}`` over ``stage_axis`` alone:
            ``collective_permute``: one shift per iteration after the first, in the forward pass
            and again (its transpose) in the backward pass, ``2 (M*R+S-2)`` per step, each the state slice
            ``[micro_batch, length, d_model]``; ``allreduce``: the masked sum that reads the outputs off the last
            stage and, in the backward pass, the gradients of what is replicated over the stage axis.
        stacked_bytes: per processor, the slices of the trainable variables that have a ``stage`` dimension.
        stacked_bytes_full: the same variables unsplit (the whole stack, every stage).
        other_bytes: per processor, the other trainable variables' slices.
        peak_activation_bytes: the plan's peak of live intermediate values (as the memory report).
        schedule: the named schedule's :class:`~meshtorch.core.schedules.ScheduleTable` (``--pipeline-schedule``,
            :meth:`with_schedule`), or None: the layout's own fill-drain order, whose every work item's stash
            lives until the backward pass.
    """

    stages: int
    microbatches: int
    repeats: int
    iterations: int
    bubble_fraction: float
    stage_axis: str | None
    stage_split: int
    stage_collectives: dict = field(default_factory=dict)
    stacked_bytes: int = 0
    stacked_bytes_full: int = 0
    other_bytes: int = 0
    peak_activation_bytes: int = 0
    schedule: ScheduleTable | None = None

    def with_schedule(self, table: ScheduleTable) -> PipelinePlan:
        """This plan under the named schedule ``table`` (same ``S``, ``M``, ``R``): its bubble, steps and
        in-flight microbatches replace the layout's in :meth:`lines`."""
        if (table.stages, table.microbatches, table.repeats) != (self.stages, self.microbatches, self.repeats):
            raise ValueError(f"schedule {table.name} is S={table.stages} M={table.microbatches} R={table.repeats}, "
                             f"the plan S={self.stages} M={self.microbatches} R={self.repeats}.")
        return replace(self, schedule=table)

    @property
    def in_flight(self) -> int:
        """The peak (virtual stage, microbatch) activations one processor holds: the schedule's largest
        :meth:`~meshtorch.core.schedules.ScheduleTable.in_flight`, else ``M R`` (every work item of the stage)."""
        return max(self.schedule.in_flight()) if self.schedule is not None else self.microbatches * self.repeats

    @property
    def schedule_activation_bytes(self) -> int:
        """Activations per processor under the schedule: :attr:`peak_activation_bytes` (the unrolled program's
        peak, which holds all ``M R`` work items' stashes) scaled by :attr:`in_flight` / ``M R``; an estimate
        that assumes the stash dominates the peak."""
        return self.peak_activation_bytes * self.in_flight // (self.microbatches * self.repeats)

    @property
    def parameter_bytes(self) -> int:
        """Trainable bytes per processor: the stacked share plus the rest."""
        return self.stacked_bytes + self.other_bytes

    def describe(self) -> str:
        """``"S=2 M=8 R=1 bubble 0.111"``: the schedule in one phrase (the search's table)."""
        return f"S={self.stages} M={self.microbatches} R={self.repeats} bubble {self.bubble_fraction:.3f}"

    def lines(self) -> list[str]:
        """The plan's pipeline section, one string per line."""
        S, M, R, it = self.stages, self.microbatches, self.repeats, self.iterations
        axis = f"split over mesh axis {self.stage_axis!r} ({self.stage_split})" if self.stage_axis else "not split"
        out = [f"pipeline: {S} stages x {R} repeat(s), {M} microbatches: {it} iterations (M*R+S-1) per forward pass,"
               f" bubble fraction (S-1)/(M*R+S-1) = {self.bubble_fraction:.3f}; stage {axis}"]
        if self.stage_axis and self.stage_collectives:
            for kind, (n, b) in sorted(self.stage_collectives.items()):
                what = (" (the shift: one per iteration after the first, forward and backward)"
                        if n == 2 * (it - 1) else "")
                out.append(f"  {kind} over {self.stage_axis}: {n} per step{what}, {_human(b)} per processor per step "
                           f"({_human(b // max(n, 1))} on average)")
        elif self.stage_axis:
            out.append(f"  no collective over {self.stage_axis}")
        share = f"1/{self.stage_split} of the stack" if self.stage_split > 1 else "the whole stack"
        out.append(f"  weights per processor: {_human(self.stacked_bytes)} stacked layers ({share}, "
                   f"{_human(self.stacked_bytes_full)} in all) + {_human(self.other_bytes)} other (embeddings, "
                   f"norms, logits) = {_human(self.parameter_bytes)}")
        out.append(f"  activations per processor: peak {_human(self.peak_activation_bytes)} (the memory report's "
                   "estimate over the unrolled iterations)")
        if self.schedule is not None:
            t = self.schedule
            out.append(f"  schedule {t.name} (docs/pipeline.md): {t.steps} steps of one action, bubble "
                       f"fraction {t.bubble_fraction():.3f} (its table); peak in-flight microbatches per stage "
                       f"{t.in_flight()} of {self.microbatches * self.repeats}: activations per processor "
                       f"~{_human(self.schedule_activation_bytes)} (the peak above x {self.in_flight}/"
                       f"{self.microbatches * self.repeats})")
        return out


def _stage_axis(specs) -> tuple[str | None, int]:
    for spec in specs:
        a = spec.tensor_dimension_to_mesh_axis(STAGE_DIM)
        if a is not None:
            return spec.shape[a].name, spec.shape[a].size
    return None, 1


def pipeline_plan(program, variables: dict[str, int], counters: Counters,
                  peak_activation_bytes: int = 0, specs: dict | None = None, schedule=None) -> PipelinePlan | None:
    """The :class:`PipelinePlan` of a planned pipelined graph, or None if the graph has no pipeline schedule.

    Args:
        program: the :class:`~meshtorch.lowering.program.Program` (:func:`meshtorch.lowering.stages.plan`), or a
            :class:`~meshtorch.lowering.Lowering` (a dry run is enough).
        variables: ``{variable name: bytes of its slice per processor}`` (:attr:`MemoryReport.variables`).
        counters: the planned collectives of one step (:meth:`Lowering.plan_counters`).
        peak_activation_bytes: the memory report's peak, repeated in the section.
        specs: ``{mesh name: MeshSpec}`` (default: the program's, or the lowering's).
        schedule: the ``pipeline_schedule`` (``stages``, ``microbatches``, ``repeats``, ``iterations()``,
            ``bubble_fraction()``; default: the program's ``pipeline``, or the lowering's graph's).
    """
    lowering = None if hasattr(program, "steps") and hasattr(program, "op_axes") else program
    if lowering is not None:  # a Lowering: its program, its graph's schedule and its specs
        program = lowering.program
        schedule = schedule or getattr(lowering.graph, "pipeline_schedule", None)
        specs = specs or {m.name: s for m, s in lowering.mesh_to_spec.items()}
    schedule = schedule or program.pipeline
    if schedule is None:
        return None
    axis, split = _stage_axis((specs or program.specs).values())
    per_kind: dict = defaultdict(lambda: [0, 0])
    if axis is not None:
        for c, n in counters.records.items():
            if tuple(c.mesh_axes) == (axis,):
                per_kind[c.kind][0] += n
                per_kind[c.kind][1] += n * c.bytes_per_processor
    stacked = full = other = 0
    trainable = set(program.trainable)
    for name, slot in program.variables.items():
        if name not in trainable:
            continue
        b = variables.get(name, 0)
        if any(d == STAGE_DIM for d, _ in slot.shape):
            stacked += b
            full += math.prod(n for _, n in slot.shape) * slot.dtype.itemsize
        else:
            other += b
    return PipelinePlan(
        stages=schedule.stages, microbatches=schedule.microbatches, repeats=schedule.repeats,
        iterations=schedule.iterations(), bubble_fraction=schedule.bubble_fraction(), stage_axis=axis,
        stage_split=split, stage_collectives={k: (v[0], v[1]) for k, v in per_kind.items()}, stacked_bytes=stacked,
        stacked_bytes_full=full, other_bytes=other, peak_activation_bytes=peak_activation_bytes)


def schedule_table(schedule) -> str:
    """The schedule as a Markdown table: one row per iteration, one column per stage, the microbatch a stage
    works on (``schedule.table()``) or ``-`` in a bubble; ``docs/pipeline.md`` shows it (a test compares)."""
    rows = schedule.table()
    S = schedule.stages
    head = "| iteration | " + " | ".join(f"stage {s}" for s in range(S)) + " |"
    rule = "|---:|" + "---:|" * S
    body = [f"| {t} | " + " | ".join("-" if m is None else str(m) for m in row) + " |" for t, row in enumerate(rows)]
    return "\n".join([head, rule, *body])


def schedule_flag(name: str, stages: int, microbatches: int, repeats: int,
                  flag: str = "--pipeline-schedule") -> ScheduleTable:
    """The :class:`~meshtorch.core.schedules.ScheduleTable` that ``flag NAME`` asks for a pipeline of ``S`` x ``M``
    x ``R`` (:func:`~meshtorch.core.schedules.build_schedule`).

    Raises:
        UsageError: one line naming ``flag``: no pipeline (``stages <= 1``) or a schedule that cannot run
            ``S``, ``M``, ``R`` (:func:`~meshtorch.core.schedules.check_schedule`).
    """
    if stages <= 1:
        raise UsageError(f"{flag} {name} needs a pipeline: add the layout rule stage:<mesh axis> (e.g. --mesh "
                         "pipe:2 --layout stage:pipe) or --pipeline-stages > 1.")
    try:
        table = build_schedule(name, stages, microbatches, repeats)
    except ValueError as e:
        raise UsageError(f"{flag} {name} with --pipeline-stages {stages}, --microbatches {microbatches}, "
                         f"--pipeline-repeats {repeats}: {e}") from None
    return table


def default_microbatches(batch_size: int, stages: int, repeats: int = 1) -> int | None:
    """The microbatches a layout search gives an ``S``-stage pipeline: the largest divisor of ``batch_size`` up
    to ``4 S`` (GPipe's bubble ``(S-1)/(M+S-1)`` is under 20% from ``M = 4 S``), at least ``S`` when
    ``repeats > 1`` (the circular schedule needs it); None if there is none."""
    fits = [m for m in range(1, min(batch_size, 4 * stages) + 1)
            if batch_size % m == 0 and (repeats == 1 or m >= stages)]
    return max(fits) if fits else None


def pipeline_candidates(config, mesh_shape, microbatches: int | None = None) -> list[tuple[str, object]]:
    """``[(mesh axis, pipelined LMConfig)]`` a layout search tries: for every mesh axis of size ``S > 1`` that
    divides ``config.num_layers``, ``config`` with ``pipeline_stages=S``, ``pipeline_repeats=num_layers/S`` (one
    layer per stage and repeat) and ``microbatches`` (None: :func:`default_microbatches`); axes where the batch
    or the schedule does not allow it (a config check fails) are left out. MoE configs have none."""
    if config.num_experts > 0:
        return []
    out = []
    for d in MeshSpec(mesh_shape).shape:
        S = d.size
        if S <= 1 or config.num_layers % S:
            continue
        R = config.num_layers // S
        M = microbatches if microbatches is not None else default_microbatches(config.batch_size, S, R)
        if M is None:
            continue
        try:
            out.append((d.name, replace(config, pipeline_stages=S, pipeline_repeats=R, microbatches=M)))
        except ValueError:  # LMConfig's pipeline checks: this axis cannot pipeline this model
            continue
    return out

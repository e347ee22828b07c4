"""``meshtorch train --pipeline-schedule 1f1b|interleaved-1f1b|zero-bubble``: training steps run by the stage
executor (:mod:`meshtorch.runtime.pipeline_exec`) in the schedule table's order (issue 32).

The LM is cut into one program per virtual stage (:func:`meshtorch.models.lm_stages.stage_programs`), each
lowered on the mesh *inside* a stage: ``--mesh`` without the axis of the layout's ``stage:<axis>`` rule, the
layout and storage without the rules naming it (``--mesh pipe:2,data:2 --layout "stage:pipe;batch:data"``:
every stage data parallel over ``data:2``). A step runs the table's forward and backward actions on the
step's ``--microbatches``, sums each weight's gradient over the microbatches, then runs every stage's optimizer
(``--optimizer``, ``--schedule``, ``--clip-norm`` over the global norm of all stages) on it, so the step equals
the unpipelined model's. In one process (a placement mesh) every rank's actions run there, step by step;
under ``torchrun`` / ``meshtorch launch`` with one process per pipeline rank (``--mesh pipe:S``), each
process runs its own row of the table and the activations and gradients travel by ``isend``/``recv``.

No process builds the unpipelined LM. Evaluation runs forward passes through the stages
(:meth:`PipelineTrainer.evaluate`); checkpoints are saved from and restored into the stages' variables
(:attr:`PipelineTrainer.state`, :class:`~meshtorch.runtime.pipeline_state.StageVariables`: the unpipelined LM's
names and format, under torchrun each process its own stages' slices), so a checkpoint is the unpipelined run's,
whichever schedule wrote it, and ``meshtorch sample`` decodes it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from meshtorch.checkpoint.hf import load_hf_weights
from meshtorch.core.errors import UsageError
from meshtorch.core.layout import LayoutRules
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.core.schedules import build_schedule
from meshtorch.models.hf import stage_parts
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.lm_stages import native_parts, stage_programs
from meshtorch.runtime.optimizers import make_optimizer
from meshtorch.runtime.pipeline_exec import action_flops, apply_updates, run_forward, run_rank, run_schedule
from meshtorch.runtime.pipeline_state import StageVariables
from meshtorch.runtime.pipeline_trace import action_costs, predicted_bubble, step_bubbles, write_chrome_trace

__all__ = ["EXECUTED", "PipelineTrainer", "check_flags", "inner_mesh", "plan_line", "unpipelined"]

#: the schedules ``meshtorch train`` runs with the stage executor (gpipe: the pipeline layout's own program)
EXECUTED = ("1f1b", "interleaved-1f1b", "zero-bubble")


def unpipelined(model):
    """The unpipelined LMConfig of the pipelined ``model`` (``pipeline_stages`` 0, one microbatch): the model whose
    variables the stages hold, which a checkpoint of the stage executor describes (its run record's config)."""
    return dataclasses.replace(model, pipeline_stages=0, microbatches=1, pipeline_repeats=1)


def _rules(text: str) -> list[tuple[str, str]]:
    return list(LayoutRules(text or "").pairs)


def inner_mesh(mesh: str, layout: str, storage: str) -> tuple[str, str, str, str]:
    """``(stage axis, mesh, layout, storage)`` inside one pipeline stage: the axis the layout's ``stage`` rule
    names, removed from ``mesh`` (``"pipe:2,data:2"`` -> ``"data:2"``) and the ``stage`` rule from ``layout``.

    Raises:
        UsageError: no ``stage`` rule, or another rule of ``--layout`` / ``--storage`` naming the stage axis.
    """
    rules = dict(_rules(layout))
    axis = rules.get("stage")
    if axis is None:
        raise UsageError("--pipeline-schedule needs the layout rule stage:<mesh axis> (e.g. --mesh pipe:2 --layout "
                         "stage:pipe).")
    for flag, text in (("--layout", layout), ("--storage", storage)):
        for dim, a in _rules(text):
            if a == axis and dim != "stage":
                raise UsageError(f"{flag}: rule {dim}:{a} splits {dim!r} over the stage axis {axis!r}; with "
                                 "--pipeline-schedule the stage axis holds the pipeline's ranks only (inside a "
                                 "stage use the other axes).")
    parts = [p for p in (mesh or "").split(",") if p.strip() and p.split(":")[0].strip() != axis]
    keep = ";".join(f"{d}:{a}" for d, a in _rules(layout) if d != "stage")
    return axis, ",".join(parts), keep, storage or ""


def check_flags(cfg, mesh_shape, world: int) -> None:
    """Refuse, in one line naming the flag, what the stage executor cannot run (``cfg``: the resolved
    :class:`~meshtorch.runtime.train_config.TrainConfig`; ``mesh_shape``: ``--mesh`` as a Shape; ``world``: the
    torchrun processes).

    Raises:
        UsageError: a stage axis whose size is not ``--pipeline-stages``; under torchrun a mesh with more than
            the stage axis; ``--dropout`` > 0, ``--experts``, ``--precision bf16`` or ``fp16`` (``tf32`` is
            float32: it runs), a ``--device`` other than the CPU.
    """
    name, S = cfg.pipeline_schedule, cfg.pipeline_stages
    flag = f"--pipeline-schedule {name}"
    axis, inner, _, _ = inner_mesh(cfg.mesh, cfg.layout, cfg.storage)
    size = mesh_shape.get_dim_by_name(axis).size if axis in mesh_shape.dimension_names else 1
    if size != S:
        raise UsageError(f"{flag}: --pipeline-stages {S} must equal the size {size} of the stage axis {axis!r} "
                         "(one pipeline rank per processor of it).")
    if world > 1 and (inner or world != S):
        raise UsageError(f"{flag} under torchrun runs one process per pipeline rank: give --mesh {axis}:{S} and "
                         f"{S} processes (got --mesh {cfg.mesh!r}, {world} processes).")
    bad = [("--dropout", (cfg.dropout or 0) > 0, "the stage programs' runs "
            "would draw other dropout masks than the unpipelined step"),
           ("--experts", (cfg.experts or 0) > 0, "MoE layers are not pipelined"),
           (f"--precision {cfg.precision}", cfg.precision in ("bf16", "fp16"), "the stage programs are float32 (no "
            "bfloat16/float16 compute, no loss scaling)"),
           ("--device", cfg.device not in (None, "cpu"), "the stage executor runs on the CPU so far")]
    for what, refused, why in bad:
        if refused:
            raise UsageError(f"{flag} cannot be combined with {what}: {why}; use --pipeline-schedule gpipe (the "
                             "pipeline layout) or drop the flag.")


class PipelineTrainer:
    """The stage programs of one process and the training step (:meth:`step`) over them.

    Args:
        cfg: the resolved TrainConfig (``pipeline_schedule`` one of :data:`EXECUTED`).
        model: the run's pipelined LMConfig, or an imported model's HFModelConfig (its ``pipeline_*`` fields give
            ``S``, ``M``, ``R``).
    """

    def __init__(self, cfg, model):
        S, M, R = model.pipeline_stages, model.microbatches, model.pipeline_repeats
        self.cfg, self.table = cfg, build_schedule(cfg.pipeline_schedule, S, M, R)
        self.axis, mesh, layout, storage = inner_mesh(cfg.mesh, cfg.layout, cfg.storage)
        self.config = unpipelined(model)
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if self.distributed else None
        self.programs = stage_programs(self.config, S, M, R, mesh, layout, storage, seed=cfg.seed, rank=rank,
                                       optimizer=lambda: make_optimizer(cfg), clip=bool(cfg.clip_norm),
                                       mode=cfg.executor, compile_backend=cfg.compile_backend,
                                       parts=stage_parts if isinstance(model, HFModelConfig) else native_parts)
        #: this process's stage variables as one lowering, for save / restore (the unpipelined LM's names)
        self.state = StageVariables(self.programs, rank, dist.get_world_size() if self.distributed else 1)
        #: ``--pipeline-trace``: per step, every rank's events (this process's ranks') since :attr:`origin`
        self.trace: list | None = [] if cfg.pipeline_trace else None
        if self.trace is not None and self.distributed:
            dist.barrier()  # the ranks' clocks start together (one host: the same monotonic clock anyway)
        self.origin = time.perf_counter_ns()

    def load_hf(self, path: str) -> None:
        """Read an imported model's weights from the Hugging Face directory ``path`` into this process's stages
        (:func:`meshtorch.checkpoint.hf.load_hf_weights`: each stage its own variables, each processor its slices;
        a tied ``embed`` into the first and the last stage)."""
        for p in self.programs:
            if p is not None:
                load_hf_weights(p.lowering, self.config, path, check=False, partial=True)

    def describe(self) -> str:
        """One line: the schedule, its table's bubble and in-flight microbatches, the mesh inside a stage."""
        t, (_, mesh, layout, _) = self.table, inner_mesh(self.cfg.mesh, self.cfg.layout, self.cfg.storage)
        return (f"pipeline schedule {t.name} (stage executor): {t.stages} ranks x {t.repeats} virtual stage(s), "
                f"{t.microbatches} microbatches, {t.steps} steps of one action, bubble fraction "
                f"{t.bubble_fraction():.3f}, peak in-flight microbatches per rank {t.in_flight()}; inside each "
                f"stage mesh {mesh or '(one processor)'!r} layout {layout!r}")

    def step(self, batch: torch.Tensor) -> list:
        """One training step on the token batch int64 ``[batch, length + 1]`` (inputs ``[:, :-1]``, targets
        ``[:, 1:]``): the schedule's forward and backward passes, then the optimizers. Returns what the
        unpipelined step's fetches ``[loss, gradient sum of squares]`` give (float32 scalars; the second NaN
        without ``--clip-norm``), on every rank."""
        ids, targets = batch[:, :-1], batch[:, 1:]
        run = (run_rank if self.distributed else run_schedule)(self.table, self.programs, ids, targets, self.axis)
        if self.trace is not None:
            self.trace.append([[(n, c, t0 - self.origin, t1 - self.origin) for n, c, t0, t1 in evs]
                               for evs in run.events])
        norm = apply_updates(self.programs, run.grads, self.cfg.clip_norm or None, self.distributed)
        loss = torch.tensor(float("nan") if run.loss is None else run.loss, dtype=torch.float64)
        if self.distributed:
            dist.broadcast(loss, self.table.rank_of(self.table.virtual_stages - 1))
        return [loss.float(), torch.tensor(norm * norm, dtype=torch.float32)]

    def evaluate(self, dataset, batches: int) -> float:
        """Mean validation cross-entropy (nats per token) over ``batches`` validation batches, forward passes
        through the stages only (:func:`~meshtorch.runtime.pipeline_exec.run_forward`; the batches
        :func:`meshtorch.runtime.train.evaluate` reads); under torchrun the last stage's rank broadcasts it."""
        total, n = 0.0, 0
        for b in dataset.batches(self.config.batch_size, seed=0, split="validation"):
            loss = run_forward(self.table, self.programs, b[:, :-1], b[:, 1:], self.distributed)
            total += 0.0 if loss is None else loss
            n += 1
            if n >= batches:
                break
        out = torch.tensor(total / max(n, 1), dtype=torch.float64)
        if self.distributed:
            dist.broadcast(out, self.table.rank_of(self.table.virtual_stages - 1))
        return out.item()

    def write_trace(self, path: str) -> str:
        """Write the recorded steps' Chrome / Perfetto trace to ``path``
        (:func:`~meshtorch.runtime.pipeline_trace.write_chrome_trace`; under torchrun every rank sends its
        timeline to rank 0, which writes; every rank must call this) and return one line: where, and the
        measured bubble fraction per rank (median over the steps after the first) beside the table's (unit
        actions) and the table timed by the measured actions (:func:`~meshtorch.runtime.pipeline_trace.
        predicted_bubble`). In one process the ranks run one after another, so no bubble is measured."""
        steps = self.trace or []
        if self.distributed:
            parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(steps, parts, dst=0)
            if dist.get_rank() != 0:
                return ""
            steps = [[parts[r][k][r] for r in range(len(parts))] for k in range(len(steps))]
        t = self.table
        write_chrome_trace(path, steps, t.name)
        line = (f"pipeline trace: {path} ({len(steps)} steps x {t.stages} ranks of {t.name}; open it in "
                "https://ui.perfetto.dev or chrome://tracing)")
        if not steps:
            return line
        if not self.distributed:
            return line + ("; one process runs the ranks one after another, so it shows each rank's order, not "
                           "a bubble (run one process per rank under torchrun to measure it)")
        timed = steps[1:] or steps  # the first step warms up
        measured = [statistics.median(step_bubbles(s)[r]["bubble"] for s in timed) for r in range(t.stages)]
        return (line + f"; measured bubble fraction per rank {' '.join(f'{b:.3f}' for b in measured)} (mean "
                f"{statistics.mean(measured):.3f}); the table predicts {t.bubble_fraction():.3f} with unit actions, "
                f"{predicted_bubble(t, action_costs(t, timed)):.3f} with the measured action times")

    def after_restore(self) -> None:
        """After :func:`meshtorch.checkpoint.restore` into :attr:`state`: ``global_step`` into every stage (under
        torchrun only rank 0 reads it)."""
        self.state.share_step()


def plan_line(name: str, model, mesh: str, layout: str, storage: str, layout_flops: int | None = None) -> str:
    """``meshtorch plan --pipeline-schedule NAME``'s line on the stage executor: planned einsum FLOPs per
    processor of each pipeline rank for one step (:func:`~meshtorch.runtime.pipeline_exec.rank_flops` over the
    mesh inside a stage; idle steps priced at zero), beside the pipeline layout program's ``layout_flops`` per
    processor (which computes its bubbles). ``model``: the pipelined LMConfig."""
    S, M, R = model.pipeline_stages, model.microbatches, model.pipeline_repeats
    table = build_schedule(name, S, M, R)
    _, inner, inner_layout, inner_storage = inner_mesh(mesh, layout, storage)
    unpiped = unpipelined(model)
    programs = stage_programs(unpiped, S, M, R, inner, inner_layout, inner_storage)
    n = MeshSpec(inner).size if inner else 1
    flops = action_flops(programs)
    per = [sum(flops(a) for a in row) // n for row in table.order]
    bubble = table.weighted(flops)[1]
    line = (f"  stage executor ({name}, meshtorch train --pipeline-schedule {name}): einsum FLOPs per processor per "
            f"step, by rank {' '.join(f'{f:.3e}' for f in per)} (idle steps priced at zero; each gradient action "
            f"is given its forward's stashed activations); bubble fraction with actions timed by their FLOPs "
            f"{bubble:.3f}")
    if layout_flops:
        line += (f"; the layout program (gpipe, bubbles computed) {layout_flops:.3e}: max rank / it "
                 f"{max(per) / layout_flops:.2f}")
    return line

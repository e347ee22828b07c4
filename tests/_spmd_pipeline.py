"""Run inside the 4 gloo processes of tests/test_pipeline.py (meshtorch.testing.spmd.run_spmd): the pipelined LM on
SpmdMeshImpl, one process per processor. Returns plain values; the parent compares them with the unpipelined LM
on one processor (it never trusts the workers' own comparisons)."""

from __future__ import annotations

from collections import Counter

#: (S, M, R, mesh, layout, storage) run on 4 ranks
SPMD_CASES = [(4, 4, 1, "pipe:4", "stage:pipe", ""),
              (2, 4, 2, "pipe:2,data:2", "stage:pipe;batch:data", "d_model:data")]


def pipeline_worker():
    """Per case: loss, {variable: full gradient}, executed {(kind, axes): (count, bytes)} of one step, and the
    bytes of the trainable variables' slices this rank holds."""
    import meshtorch as mtf
    import test_pipeline as P

    out = []
    for S, M, R, mesh_shape, layout, storage in SPMD_CASES:
        lm = P._build(P._config(S, M, R))
        lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.SpmdMeshImpl(mesh_shape, layout, storage=storage or None)})
        loss, grads = P._run(lm, lw)
        count, nbytes = Counter(), Counter()
        for c, n in lw.counters.records.items():
            count[c.kind, c.mesh_axes] += n
            nbytes[c.kind, c.mesh_axes] += n * c.bytes_per_processor
        held = sum(lw.variables[v].numel() * lw.variables[v].element_size() for v in lm.graph.trainable_variables)
        out.append((loss, grads, dict(count), dict(nbytes), held))
    return out


def parameter_bytes_worker(cases):
    """Per ``(S, mesh, layout)`` case: bytes of the trainable variables' slices this rank holds, for the LM of
    ``test_pipeline.memory_config(S)``."""
    import meshtorch as mtf
    import test_pipeline as P
    from meshtorch.models.transformer import build_lm

    out = []
    for S, mesh_shape, layout in cases:
        lm = build_lm(P.memory_config(S), train=False)
        lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.SpmdMeshImpl(mesh_shape, layout)})
        out.append(sum(lw.variables[v].numel() * lw.variables[v].element_size()
                       for v in lm.graph.trainable_variables))
    return out


def schedule_worker(cases, train=None):
    """With ``train`` = ``(root, flags)``: ``{"cases": ..., "train": train_worker(root, flags)}`` (one spawn of the
    ranks for both). Per ``(schedule, S, M, R)`` case (``S`` = the processes): this rank's run of the stage executor
    (:func:`meshtorch.runtime.pipeline_exec.run_rank`) on ``test_pipeline_executor``'s model and batch: loss (last
    stage's rank, else None), {variable: gradient} of its stages, its sends (the flight recorder's "send" records),
    peak stash, actions (as text) and its timeline (:attr:`~meshtorch.runtime.pipeline_exec.ScheduleRun.events`,
    nanoseconds since a barrier)."""
    import time

    import torch.distributed as dist

    import test_pipeline_executor as E
    from meshtorch.core.schedules import build_schedule
    from meshtorch.mesh.recorder import flight_recorder
    from meshtorch.models.lm_stages import stage_programs
    from meshtorch.runtime.pipeline_exec import SEND, run_rank

    out = []
    for name, S, M, R in cases:
        programs = stage_programs(E._cfg(S * R), S, M, R, E.MESH, E.LAYOUT, E.STORAGE, rank=dist.get_rank())
        flight_recorder().sink = records = []
        dist.barrier()
        origin = time.perf_counter_ns()
        try:
            run = run_rank(build_schedule(name, S, M, R), programs, *E._batch())
        finally:
            flight_recorder().sink = None
        r = dist.get_rank()
        sends = sum(rec.kind == SEND for rec in records)
        events = [(n, c, t0 - origin, t1 - origin) for n, c, t0, t1 in run.events[r]]
        out.append((run.loss, run.grads, sends, run.peak_stash[r], [str(a) for a in run.actions[r]], events))
    return out if train is None else {"cases": out, "train": train_worker(*train)}


def train_worker(root, flags):
    """``meshtorch train --pipeline-schedule 1f1b --mesh pipe:2`` for 2 steps in this rank (one process per pipeline
    rank; ``--pipeline-trace ROOT/trace.json``), then the run resumed from its checkpoint by ``--pipeline-schedule
    zero-bubble`` for a third: per run its
    losses, {variable: value} of this rank's stages (``res["lowering"]``: the stages' variables) and validation
    losses."""
    import torch.distributed as dist

    from meshtorch.runtime.train import main_train
    from meshtorch.runtime.train_config import TrainConfig

    assert dist.get_world_size() == 2
    out = []
    for steps, name, resume in ((2, "1f1b", False), (3, "zero-bubble", True)):
        trace = f"{root}/trace.json" if not resume else ""  # --pipeline-trace: written by rank 0
        res = main_train(TrainConfig(**flags, layers=2, steps=steps, runs_dir=root, run_name="gloo", mesh="pipe:2",
                                     layout="stage:pipe", microbatches=4, pipeline_schedule=name, resume=resume,
                                     pipeline_trace=trace))
        lw = res["lowering"]
        out.append((res["history"]["loss"], {n: lw.variable_value(n) for n in lw.variable_names},
                    res["history"]["val_loss"]))
    return out


def memory_worker(cfg_kw, cases):
    """Per ``(schedule, S, M, R)`` case: the peak bytes of live tensors (:class:`meshtorch.testing.live_tensors.
    LiveTensorBytes`, counting every op's outputs and the variables) of this rank's training step (stage executor
    and AdamW, :func:`meshtorch.runtime.pipeline_exec.run_rank` + ``apply_updates``), after one uncounted step."""
    import torch
    import torch.distributed as dist

    import test_pipeline_memory as T
    from meshtorch.core.schedules import build_schedule
    from meshtorch.models.lm_stages import stage_programs
    from meshtorch.models.transformer import preset
    from meshtorch.runtime.pipeline_exec import apply_updates, run_rank
    from meshtorch.testing.live_tensors import LiveTensorBytes

    out = []
    for name, S, M, R in cases:
        cfg = preset("tiny", **{**cfg_kw, "num_layers": S * R})
        programs = stage_programs(cfg, S, M, R, rank=dist.get_rank(), optimizer=T.adamw)
        table = build_schedule(name, S, M, R)
        g = torch.Generator().manual_seed(0)
        ids, targets = (torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.length), generator=g) for _ in "it")
        apply_updates(programs, run_rank(table, programs, ids, targets).grads)
        dist.barrier()
        with LiveTensorBytes() as live:
            live.track([p.lowering.store.values for p in programs if p is not None])
            apply_updates(programs, run_rank(table, programs, ids, targets).grads)
        dist.barrier()
        out.append(live.peak)
    return out


def gpipe_resume_worker(root, flags):
    """``meshtorch train --pipeline-schedule 1f1b --mesh pipe:2`` for 2 steps in this rank (one file per rank), then
    the run resumed under the GPipe layout (``--mesh pipe:2 --layout stage:pipe``, stacked variables) for a third:
    the resumed run's losses."""
    from meshtorch.runtime.train import main_train
    from meshtorch.runtime.train_config import TrainConfig

    losses = None
    for steps, schedule, resume in ((2, "1f1b", False), (3, None, True)):
        res = main_train(TrainConfig(**flags, steps=steps, runs_dir=root, run_name="gloo", mesh="pipe:2",
                                     layout="stage:pipe", microbatches=2, pipeline_schedule=schedule, resume=resume))
        losses = res["history"]["loss"]
    return losses

"""A 4-stage pipeline on 4 gloo ranks: meshtorch's pipelined LM vs ``torch.distributed.pipelining`` GPipe.

Model: :func:`meshtorch.models.transformer.build_lm` (default 4 layers, d_model 256, 4 heads x 64, d_ff 1024,
vocab 256, length 64, batch 16: 3.3M parameters), AdamW (no weight decay), ``--microbatches`` M (default 8),
``--stages`` S (default 4) gloo ranks with one CPU thread each (``meshtorch.testing.spmd.run_spmd``,
``MALLOC_MMAP_THRESHOLD_=131072`` so freed blocks leave the RSS). The jobs of ``--runs`` alternate ``--rounds``
times (meshtorch, meshtorch_noremat, torch, meshtorch, ...) so slow periods of a shared host hit all:

* ``meshtorch``: ``LMConfig(pipeline_stages=S, microbatches=M)`` on ``SpmdMeshImpl("pipe:S", "stage:pipe")``
  (``meshtorch train --mesh pipe:4 --layout stage:pipe --layers 4 --microbatches 8``): the layers' weights
  stacked on a ``stage`` dimension split over ``pipe``, M*R+S-1 unrolled iterations, the state shifted along
  ``stage`` by a collective-permute each iteration (GSPMD / praxis style), each iteration's block recomputed
  in the backward pass (the LM's default); embedding, final norm and logits replicated over ``pipe``.
* ``meshtorch_noremat``: the same with ``pipeline_remat=False`` (every block's activations kept, as GPipe does).
* ``torch``: the same architecture (:class:`meshtorch.testing.torch_lm.TorchLM`, the LM's plain-PyTorch twin)
  split by hand as the PyTorch pipelining tutorial and TorchTitan do (each rank keeps its layers, stage 0 the
  embeddings, the last stage the final norm and logits; :class:`StageLM`), wrapped in ``PipelineStage`` and
  run by ``ScheduleGPipe(stage, M, loss_fn)``; ``torch.optim.AdamW``.

All start from the same weights (the unpipelined meshtorch LM's initial values) and train on the same
batches, so their losses must agree (printed, max relative difference). Each job: a tiny warm-up model
(lazy allocations of torch and gloo), RSS reset, the model built, one warm-up step, then ``--steps`` timed
steps, each between two barriers. Printed: the median step time of each run over all rounds and ranks with
its spread (min-max) and the ratio to torch (goal <= 1.0); per rank the peak RSS growth (VmHWM after the
reset minus the RSS before the build: variables, activations, transients) and the bytes of the variables
(parameters, optimizer state) it holds; the share of the step each rank waits in point-to-point transfers
(torch: ``_wait_batch_p2p``; meshtorch: its collective-permutes, from the flight recorder); the measured
bubble; and the planner's predictions (:func:`meshtorch.planning.memory_report`, dry run) beside them.

Measured bubble. torch (GPipe): a rank idles in the fill and drain, so its bubble is its waiting time (plus
the transfers) over the step. meshtorch: every stage computes in every iteration (the bubble is work on
zeroed slots, not waiting), so :func:`measured_bubble` cuts each rank's step into iterations at its
collective-permutes and sums the iterations in which the schedule table gives that rank no microbatch:
over the pipeline loop (what the planner's ``(S-1)/(M*R+S-1)`` predicts) and over the whole step.

torch's other schedules (issue 32): ``torch_1f1b`` (``Schedule1F1B``), ``torch_interleaved``
(``ScheduleInterleaved1F1B``) and ``torch_zero_bubble`` (``ScheduleInterleavedZeroBubble``), the last two with
``--virtual-stages`` stages per rank (``StageLM`` per virtual stage, rank r holding r, S + r, ...), are printed
beside their tables (:mod:`meshtorch.core.schedules`: bubble, peak in-flight microbatches) and against GPipe.
meshtorch's runs of the same schedules: ``mt_gpipe``, ``mt_1f1b``, ``mt_interleaved``, ``mt_zero_bubble``, the
training step of ``meshtorch train --pipeline-schedule`` (:mod:`meshtorch.runtime.pipeline_exec`: one program
per virtual stage run in the table's order, then the meshtorch AdamW step of every stage), each against torch's
same schedule.

Run: ``python benchmarks/pipeline_vs_torch.py [--rounds 3] [--steps 3] [--stages 4] [--microbatches 8]
[--layers 4] [--runs meshtorch,meshtorch_noremat,torch,torch_1f1b,torch_interleaved,torch_zero_bubble]
[--virtual-stages 2]``
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from host import describe  # noqa: E402
from rss import peak_rss_bytes, reset_peak  # noqa: E402

from meshtorch.models.transformer import LMConfig, preset  # noqa: E402
from meshtorch.testing.torch_lm import TorchLM  # noqa: E402

MIB = 2 ** 20
LR = 1e-3


def config(kw: dict) -> LMConfig:
    """The unpipelined LM of the benchmark (``kw``: LMConfig fields overriding the defaults)."""
    base = dict(vocab_size=256, d_model=256, num_heads=4, d_kv=64, d_ff=1024, num_layers=4, length=64,
                batch_size=16)
    base.update(kw)
    return preset("tiny", **base)


#: meshtorch's runs: name -> per-iteration recompute (``LMConfig.pipeline_remat``; the default, True, keeps one
#: state per iteration; False keeps every block's activations, as ``ScheduleGPipe`` does)
MESHTORCH_RUNS = {"meshtorch": True, "meshtorch_noremat": False}


def pipelined(cfg: LMConfig, stages: int, microbatches: int, remat: bool = True) -> LMConfig:
    """``cfg`` as an S-stage pipeline: one layer per stage and repeat (R = layers / S, circular when R > 1)."""
    return replace(cfg, pipeline_stages=stages, microbatches=microbatches,
                   pipeline_repeats=cfg.num_layers // stages, pipeline_remat=remat)


def batches(cfg: LMConfig, n: int = 4) -> list:
    """``n`` fixed (inputs, targets) int64 ``[batch, length]`` pairs (targets: inputs shifted by one)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        seq = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def initial_state(cfg: LMConfig) -> dict:
    """``{torch name: tensor}`` of the unpipelined meshtorch LM's initial weights (both runs start there)."""
    import meshtorch as mtf
    from meshtorch.models.transformer import build_lm

    lm = build_lm(cfg, seed=0)
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec("", "")})
    return {n.replace("/", "."): lw.variable_value(n) for n in lw.variable_names}


def load_unpipelined_state(lw, lm, state: dict) -> None:
    """Set the pipelined lowering's variables from an unpipelined ``{torch name: tensor}`` state: the stacked
    ``stack/<kind>`` ``[stage, (repeat,) ...]`` gets layer ``r * S + s``'s ``<kind>`` at ``[s, r]``
    (:class:`meshtorch.layers.pipeline.StackedVariables`), every other variable its own tensor."""
    sched = lm.pipeline
    S, R = sched.stages, sched.repeats
    for name in lw.variable_names:
        if name.startswith("stack/") and f"layer_0.{name[len('stack/'):].replace('/', '.')}" in state:
            kind = name[len("stack/"):].replace("/", ".")
            rows = [torch.stack([state[f"layer_{sched.layer(s, r)}.{kind}"] for r in range(R)]) for s in range(S)]
            value = torch.stack(rows)
            lw.set_variable_value(name, value if R > 1 else value[:, 0])
        elif name.replace("/", ".") in state:
            lw.set_variable_value(name, state[name.replace("/", ".")])


_ITER = re.compile(r"/iter_(\d+)/shift(_grad)?$")


def measured_bubble(records, schedule, rank: int, step_s: float) -> tuple[float, float]:
    """``(bubble share of the pipeline loop, bubble share of the step)`` measured on ``rank`` in one step.

    Every stage computes in every iteration, so the bubble is the time of the iterations in which the schedule
    gives this rank's stage no microbatch. The flight recorder's collective-permutes over the stage axis
    (``records``; each tagged with its op, ``.../iter_<t>/shift`` in the forward pass, ``.../iter_<t>/shift_grad``
    in the backward pass) delimit the iterations: forward block ``t`` runs from the start of shift ``t`` to the
    start of shift ``t + 1``, its backward pass from the end of ``shift_grad`` ``t + 1`` to the start of
    ``shift_grad`` ``t``. The first and last iterations have no permute on one side; they are given the median
    time of the others. Returns nan, nan when the records do not show the iterations."""
    it = schedule.iterations()
    fwd, bwd = {}, {}
    for r in records:
        for c in r.tag or ():
            m = _ITER.search(c.op)
            if m:
                (bwd if m.group(2) else fwd)[int(m.group(1))] = r
    d = {}
    for t in range(1, it - 1):
        if t in fwd and t + 1 in fwd and t in bwd and t + 1 in bwd:
            f = fwd[t + 1].start - fwd[t].start
            b = bwd[t].start - (bwd[t + 1].start + bwd[t + 1].seconds)
            d[t] = f + b
    if not d:
        return float("nan"), float("nan")
    tau = statistics.median(d.values())
    times = [d.get(t, tau) for t in range(it)]
    table = schedule.table()
    bubble = sum(x for t, x in enumerate(times) if table[t][rank] is None)
    return bubble / sum(times), bubble / step_s


class StageLM(TorchLM):
    """Stage ``stage`` of ``stages`` of :class:`TorchLM`, split by hand (the PyTorch pipelining tutorial's and
    TorchTitan's manual split): layers ``stage * L/S .. (stage + 1) * L/S - 1``, the embeddings on stage 0,
    final norm and logits on the last stage; the others are deleted. ``forward``: int64 ids ``[mb, length]``
    (stage 0) or hidden states ``[mb, length, d_model]`` -> hidden states, or logits on the last stage."""

    def __init__(self, c: LMConfig, stage: int, stages: int):
        super().__init__(c)
        if c.num_layers % stages:
            raise ValueError(f"StageLM: {c.num_layers} layers do not split into {stages} stages.")
        per = c.num_layers // stages
        self.stage, self.stages = stage, stages
        self.owned = list(range(stage * per, (stage + 1) * per))
        for i in range(c.num_layers):
            if i not in self.owned:
                delattr(self, f"layer_{i}")
        if stage != 0:
            del self.embedding, self.pos_embedding
        if stage != stages - 1:
            del self.final_norm, self.logits

    def forward(self, x):
        if self.stage == 0:
            x = self.embedding[x] + self.pos_embedding[: x.shape[1]]
        for i in self.owned:
            x, _ = self.block(i, x)
        return self.head(x) if self.stage == self.stages - 1 else x


#: torch's runs: name -> our schedule name (:mod:`meshtorch.core.schedules`) of the torch class it runs
TORCH_RUNS = {"torch": "gpipe", "torch_1f1b": "1f1b", "torch_interleaved": "interleaved-1f1b",
              "torch_zero_bubble": "zero-bubble"}


#: meshtorch's stage executor (:mod:`meshtorch.runtime.pipeline_exec`, what ``meshtorch train --pipeline-schedule``
#: runs): name -> schedule; forward, backward (each gradient program recomputing its stage's forward pass) and AdamW
EXEC_RUNS = {"mt_gpipe": "gpipe", "mt_1f1b": "1f1b", "mt_interleaved": "interleaved-1f1b",
             "mt_zero_bubble": "zero-bubble"}
SCHEDULE_OF = {**TORCH_RUNS, **EXEC_RUNS}


def torch_local_stages(run: str, virtual: int) -> int:
    """Virtual stages per rank of a torch or executor run: ``virtual`` for the interleaved and zero-bubble ones,
    else 1."""
    return virtual if SCHEDULE_OF[run] in ("interleaved-1f1b", "zero-bubble") else 1


def _exec_job(cfg: LMConfig, stages: int, microbatches: int, state: dict | None, schedule: str = "gpipe",
              local: int = 1):
    """``(step_fn, waits, None)`` of this rank's stage programs run by
    :func:`meshtorch.runtime.pipeline_exec.run_rank` in ``schedule``'s order, then AdamW
    (:func:`~meshtorch.runtime.pipeline_exec.apply_updates`): the training step of ``meshtorch train
    --pipeline-schedule`` (the programs draw the unpipelined LM's initial values by name, seed 0, so ``state``
    is that already)."""
    import torch.distributed as dist

    import meshtorch as mtf
    from meshtorch.core.schedules import build_schedule
    from meshtorch.models.lm_stages import stage_programs
    from meshtorch.runtime.pipeline_exec import apply_updates, run_rank

    programs = stage_programs(cfg, stages, microbatches, local, rank=dist.get_rank(),
                              optimizer=lambda: mtf.optim.AdamWOptimizer(LR, weight_decay=0.0))
    table = build_schedule(schedule, stages, microbatches, local)
    waits = [0.0]

    def step(x, y):
        run = run_rank(table, programs, x, y)
        apply_updates(programs, run.grads)
        waits[0] += run.wait_s
        return run.loss

    def var_bytes():
        return sum(p.lowering.variable_value(n).numel() * 4 for p in programs if p is not None
                   for n in p.lowering.variable_names)

    step.var_bytes = var_bytes
    return step, waits, None


def _torch_job(cfg: LMConfig, stages: int, microbatches: int, state: dict | None, schedule: str = "gpipe",
               local: int = 1):
    """``(step_fn, waits, None)`` of this rank's stages under torch's ``schedule`` (our name: gpipe, 1f1b,
    interleaved-1f1b, zero-bubble) with ``local`` virtual stages per rank (rank r: r, S + r, ...); ``step_fn(x, y)``
    returns the loss on the last stage (None elsewhere); ``waits[0]`` accumulates the seconds spent waiting for
    transfers."""
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )
    from torch.distributed.pipelining import schedules as sched_mod

    rank = dist.get_rank()
    V = stages * local
    models = [StageLM(cfg, v, V) for v in range(rank, V, stages)]
    if state is not None:
        for model in models:
            own = dict(model.named_parameters())
            model.load_state_dict({k: v for k, v in state.items() if k in own})
    pstages = [PipelineStage(m, v, V, torch.device("cpu")) for m, v in zip(models, range(rank, V, stages),
                                                                           strict=True)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    if schedule in ("gpipe", "1f1b"):
        sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(pstages[0], n_microbatches=microbatches,
                                                                          loss_fn=loss_fn)
    else:
        cls = ScheduleInterleaved1F1B if schedule == "interleaved-1f1b" else ScheduleInterleavedZeroBubble
        sched = cls(pstages, n_microbatches=microbatches, loss_fn=loss_fn)
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    waits = [0.0]
    wait = sched_mod._wait_batch_p2p
    if not getattr(wait, "_timed", False):
        def timed_wait(work):
            t0 = time.perf_counter()
            try:
                return wait(work)
            finally:
                waits[0] += time.perf_counter() - t0
        timed_wait._timed = True
        sched_mod._wait_batch_p2p = timed_wait
    else:  # a second job in this process: reuse the wrapper's counter
        waits = wait._waits
    sched_mod._wait_batch_p2p._waits = waits

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == stages - 1:
            losses = []
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        return float(torch.stack(losses).mean()) if rank == stages - 1 else None

    def var_bytes():
        tensors = params + [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        return sum(t.numel() * t.element_size() for t in tensors)

    step.var_bytes = var_bytes
    return step, waits, None


def _meshtorch_job(cfg: LMConfig, stages: int, microbatches: int, state: dict | None, remat: bool = True):
    """``(step_fn, waits, bubble_fn)`` of this rank's share of the pipelined meshtorch LM."""
    import torch.distributed as dist

    import meshtorch as mtf
    from meshtorch.mesh.recorder import flight_recorder
    from meshtorch.models.transformer import build_lm

    lm = build_lm(pipelined(cfg, stages, microbatches, remat), seed=0,
                  optimizer=mtf.optim.AdamWOptimizer(LR, weight_decay=0.0))
    impl = mtf.SpmdMeshImpl(f"pipe:{stages}", "stage:pipe")
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl})
    if state is not None:
        load_unpipelined_state(lw, lm, state)
    fetches = [lm.loss] + lm.updates
    rec = flight_recorder()
    waits = [0.0]
    last: list = []

    def step(x, y):
        rec.sink = records = []
        try:
            out = lw.run(fetches, feeds={lm.inputs: x, lm.targets: y})
        finally:
            rec.sink = None
        mine = [r for r in records if r.kind in ("receive", "collective_permute") and r.seconds is not None]
        waits[0] += sum(r.seconds for r in mine)
        last[:] = [mine]
        return float(out[0]) if dist.get_rank() == stages - 1 else None

    def bubble(step_s):
        return measured_bubble(last[0], lm.pipeline, dist.get_rank(), step_s)

    def var_bytes():
        return sum(x.numel() * x.element_size() for v in lw.variables.values() for x in impl.local_slices(v))

    step.var_bytes = var_bytes

    return step, waits, bubble


def worker(run: str, cfg_kw: dict, stages: int, microbatches: int, steps: int, threads: int,
           virtual: int = 2) -> dict:
    """One gloo rank of ``run`` (``MESHTORCH_RUNS`` or ``TORCH_RUNS``): warm-up, RSS reset, build, timed steps;
    ``virtual``: virtual stages per rank of the interleaved and zero-bubble torch runs."""
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    torch.set_num_threads(threads)
    if run in MESHTORCH_RUNS:
        def job(*a):
            return _meshtorch_job(*a, remat=MESHTORCH_RUNS[run])
    elif run in SCHEDULE_OF:
        def job(*a):
            return (_torch_job if run in TORCH_RUNS else _exec_job)(*a, schedule=SCHEDULE_OF[run],
                                                                     local=torch_local_stages(run, virtual))
    else:
        raise ValueError(f"--runs: unknown run {run!r}; choose from {', '.join([*MESHTORCH_RUNS, *SCHEDULE_OF])}.")
    tiny = config(dict(vocab_size=32, d_model=16, num_heads=2, d_kv=8, d_ff=32, length=8, batch_size=microbatches,
                       num_layers=stages * (torch_local_stages(run, virtual) if run in SCHEDULE_OF else 1)))
    step, _, _ = job(tiny, stages, microbatches, None)
    x, y = batches(tiny, 1)[0]
    step(x, y)
    cfg = config(cfg_kw)
    data = batches(cfg)
    state = initial_state(cfg)
    base = reset_peak()
    step, waits, bubble = job(cfg, stages, microbatches, state)
    losses, times, wait_s, bubbles = [], [], [], []
    for s in range(steps + 1):
        x, y = data[s % len(data)]
        dist.barrier()
        w0, t0 = waits[0], time.perf_counter()
        losses.append(step(x, y))
        dist.barrier()
        t = time.perf_counter() - t0
        if s:  # the first step is a warm-up
            times.append(t)
            wait_s.append(waits[0] - w0)
            share = (waits[0] - w0) / t  # torch: the waits are the bubble (and the transfers)
            bubbles.append(bubble(t) if bubble is not None else (float("nan"), share))
    return {"growth": peak_rss_bytes() - base, "times": times, "waits": wait_s, "bubbles": bubbles,
            "var_bytes": step.var_bytes(),
            "losses": losses, "rank": dist.get_rank()}


def predicted(cfg: LMConfig, stages: int, microbatches: int, remat: bool = True) -> dict:
    """The planner's bubble fraction and per-rank total for the meshtorch run (dry run, nothing allocated)."""
    import meshtorch as mtf
    from meshtorch.models.transformer import build_lm
    from meshtorch.planning import plan_memory

    lm = build_lm(pipelined(cfg, stages, microbatches, remat), seed=0,
                  optimizer=mtf.optim.AdamWOptimizer(LR, weight_decay=0.0))
    rep = plan_memory(lm.graph, lm.mesh, [lm.loss] + lm.updates, f"pipe:{stages}", "stage:pipe")
    return {"bubble": rep.pipeline.bubble_fraction, "total": rep.total_bytes, "report": rep}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages = gloo ranks")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4,
                    help="a multiple of --stages (meshtorch: R = layers / stages, circular; torch: layers / stages "
                         "consecutive layers per stage)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per job (after one warm-up step)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two jobs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--runs", default="meshtorch,meshtorch_noremat,torch",
                    help="jobs per round, alternated: meshtorch (per-iteration recompute, the LM's default), "
                         "meshtorch_noremat (keeps every block's activations, as GPipe does), torch (ScheduleGPipe), "
                         "torch_1f1b (Schedule1F1B), torch_interleaved (ScheduleInterleaved1F1B), torch_zero_bubble "
                         "(ScheduleInterleavedZeroBubble); mt_gpipe, mt_1f1b, mt_interleaved, mt_zero_bubble: "
                         "meshtorch's stage executor in that schedule's order (meshtorch train --pipeline-schedule's "
                         "step, with AdamW)")
    ap.add_argument("--virtual-stages", type=int, default=2,
                    help="virtual stages per rank of torch_interleaved and torch_zero_bubble (--layers must be a "
                         "multiple of stages x this)")
    args = ap.parse_args(argv)
    for run in args.runs.split(","):
        if run not in MESHTORCH_RUNS and run not in SCHEDULE_OF:
            ap.error(f"--runs: unknown run {run!r}; choose from {', '.join([*MESHTORCH_RUNS, *SCHEDULE_OF])}.")
        if run in SCHEDULE_OF and args.layers % (args.stages * torch_local_stages(run, args.virtual_stages)):
            ap.error(f"--runs {run}: --layers {args.layers} must be a multiple of --stages x its virtual stages "
                     f"({args.stages} x {torch_local_stages(run, args.virtual_stages)}).")
    from meshtorch.testing.spmd import run_spmd

    cfg_kw = dict(num_layers=args.layers, d_model=args.d_model, d_ff=args.d_ff, batch_size=args.batch,
                  length=args.length)
    cfg = config(cfg_kw)
    S, M = args.stages, args.microbatches
    n_params = sum(v.numel() for v in initial_state(cfg).values())
    print(describe())
    print(f"LM: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads x {cfg.d_kv}, d_ff {cfg.d_ff}, "
          f"vocab {cfg.vocab_size}, length {cfg.length}, batch {cfg.batch_size}: {n_params / 1e6:.2f}M parameters; "
          f"AdamW; {S} stages on {S} gloo ranks x {args.threads} thread(s), {M} microbatches; all eager; "
          "host shared with other jobs", flush=True)
    runs = args.runs.split(",")
    results: dict = {r: [] for r in runs}
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    for rnd in range(args.rounds):
        for run in runs:
            res = run_spmd("pipeline_vs_torch:worker", args=(run, cfg_kw, S, M, args.steps, args.threads,
                                                                     args.virtual_stages),
                           nprocs=S, timeout_s=1800, dist_timeout_s=600, extra_path=[HERE], env=env).check().results
            results[run].append(res)
            t = [x for r in res for x in r["times"]]
            print(f"  round {rnd} {run}: step s median {statistics.median(t):.3f} (min {min(t):.3f}, max "
                  f"{max(t):.3f}); losses {[round(v, 5) for v in res[-1]['losses']]}", flush=True)
    print(f"\n{'run':<19}{'step s median':>14}{'spread':>14}{'RSS growth/rank MiB':>26}{'variables/rank MiB':>26}"
          f"{'wait/step per rank':>24}{'bubble/step per rank':>24}")
    med = {}
    for run, rounds in results.items():
        t = [x for res in rounds for r in res for x in r["times"]]
        med[run] = statistics.median(t)
        growth = [max(res[k]["growth"] for res in rounds) / MIB for k in range(S)]
        var = [rounds[0][k]["var_bytes"] / MIB for k in range(S)]
        wait = [statistics.median(w / s for res in rounds for w, s in zip(res[k]["waits"], res[k]["times"],
                                                                           strict=True)) for k in range(S)]
        loop = [statistics.median(b[0] for res in rounds for b in res[k]["bubbles"]) for k in range(S)]
        step = [statistics.median(b[1] for res in rounds for b in res[k]["bubbles"]) for k in range(S)]
        med[run + "_rss"], med[run + "_var"], med[run + "_loop"], med[run + "_step"] = growth, var, loop, step
        print(f"{run:<19}{med[run]:>14.3f}{f'{min(t):.3f}-{max(t):.3f}':>14}"
              f"{' '.join(f'{g:.1f}' for g in growth):>26}{' '.join(f'{v:.2f}' for v in var):>26}"
              f"{' '.join(f'{w:.2f}' for w in wait):>24}{' '.join(f'{b:.2f}' for b in step):>24}")
    for run in [r for r in runs if r in MESHTORCH_RUNS]:
        print(f"\n{run} (per-iteration recompute {'on' if MESHTORCH_RUNS[run] else 'off'}):")
        if "torch" in med:
            per_round = [statistics.median(x for r in a for x in r["times"]) / statistics.median(
                x for r in b for x in r["times"]) for a, b in zip(results[run], results["torch"], strict=True)]
            print(f"  {run} / torch step time (ratio of medians): {med[run] / med['torch']:.3f} (goal <= 1.0); per "
                  f"round (the jobs of one round ran back to back): {' '.join(f'{x:.2f}' for x in per_round)}, "
                  f"median {statistics.median(per_round):.3f}")
            ml, tl = results[run][0][S - 1]["losses"], results["torch"][0][S - 1]["losses"]
            err = max(abs(a - b) / abs(b) for a, b in zip(ml, tl, strict=True))
            print(f"  losses (last rank, round 0): {run} {[round(v, 5) for v in ml]}, torch "
                  f"{[round(v, 5) for v in tl]} (max rel. diff {err:.1e})")
        p = predicted(cfg, S, M, MESHTORCH_RUNS[run])
        loop = statistics.mean(med[run + "_loop"])
        print(f"  bubble fraction of the pipeline loop: planner {p['bubble']:.3f} = (S-1)/(M*R+S-1); measured "
              f"{loop:.3f} (mean over ranks; per rank {' '.join(f'{b:.3f}' for b in med[run + '_loop'])}; "
              f"measured / planner {loop / p['bubble']:.2f})")
        print(f"  bubble share of the whole step: {run} {statistics.mean(med[run + '_step']):.3f}"
              + (f", torch (waits) {statistics.mean(med['torch_step']):.3f}" if "torch" in med else "")
              + " (mean over ranks)")
        growth, var = max(med[run + "_rss"]), max(med[run + "_var"])
        rep = p["report"]
        print(f"  per-rank memory: planner total {p['total'] / MIB:.2f} MiB vs measured peak RSS growth (max over "
              f"ranks) {growth:.2f} MiB (planner / measured {p['total'] / MIB / growth:.2f}); planner variables "
              f"{rep.variable_bytes / MIB:.2f} MiB vs held variable slices {var:.2f} MiB (planner / measured "
              f"{rep.variable_bytes / MIB / var:.3f})")


    torch_schedules(results, med, S, M, args.virtual_stages)
    for run in [r for r in runs if r in EXEC_RUNS]:
        planned = executor_memory(cfg, S, M, SCHEDULE_OF[run], torch_local_stages(run, args.virtual_stages))
        got, plan, p0 = med[run + "_rss"], [p["total"] / MIB for p in planned], planned[0]
        held = " ".join(f"{p['sends_held'] / MIB:.2f}" for p in planned)
        print(f"\n{run} per-rank memory (MiB): planner (meshtorch.runtime.pipeline_exec.rank_memory) "
              f"{' '.join(f'{p:.1f}' for p in plan)}; measured peak RSS growth {' '.join(f'{g:.1f}' for g in got)}; "
              f"measured / planner {' '.join(f'{g / p:.2f}' for g, p in zip(got, plan, strict=True))}; planner "
              f"parts of rank 0: variables {p0['variables'] / MIB:.1f}, gradients {p0['gradients'] / MIB:.1f}, "
              f"stash {p0['stash'] / MIB:.1f} x {p0['in_flight']} in flight, sends {p0['sends'] / MIB:.1f} (held at "
              f"the peak per rank {held}), transient "
              f"{p0['transient'] / MIB:.1f}; peak at {', '.join(p['peak_at'] for p in planned)}")


def executor_memory(cfg: LMConfig, stages: int, microbatches: int, schedule: str, local: int) -> list[dict]:
    """The planner's per-rank bytes of the stage executor's step (:func:`meshtorch.runtime.pipeline_exec.rank_memory`
    of every rank's stage programs with AdamW, as :func:`_exec_job` builds them)."""
    import meshtorch as mtf
    from meshtorch.core.schedules import build_schedule
    from meshtorch.models.lm_stages import stage_programs
    from meshtorch.runtime.pipeline_exec import rank_memory

    programs = stage_programs(cfg, stages, microbatches, local,
                              optimizer=lambda: mtf.optim.AdamWOptimizer(LR, weight_decay=0.0))
    return rank_memory(build_schedule(schedule, stages, microbatches, local), programs)


def torch_schedules(results: dict, med: dict, S: int, M: int, virtual: int) -> None:
    """Each torch run beside its schedule's table (:func:`meshtorch.core.schedules.build_schedule`): step time
    over GPipe's (median of the per-round ratios), the table's bubble and peak in-flight microbatches per rank
    against the measured waiting share and peak RSS growth, and its losses against GPipe's."""
    from meshtorch.core.schedules import build_schedule

    for run in [r for r in results if r in SCHEDULE_OF]:
        R = torch_local_stages(run, virtual)
        table = build_schedule(SCHEDULE_OF[run], S, M, R)
        print(f"\n{run} ({SCHEDULE_OF[run]}, {R} virtual stage(s) per rank): table: {table.steps} steps, bubble "
              f"{table.bubble_fraction():.3f}, peak in-flight (stage, microbatch) per rank {table.in_flight()}; "
              f"measured: waiting share per rank {' '.join(f'{b:.2f}' for b in med[run + '_step'])}, peak RSS "
              f"growth per rank MiB {' '.join(f'{g:.1f}' for g in med[run + '_rss'])}")
        twin = next((t for t, n in TORCH_RUNS.items() if n == SCHEDULE_OF[run]), None)
        if run in EXEC_RUNS and twin in results:
            per_round = [statistics.median(x for r in a for x in r["times"]) / statistics.median(
                x for r in b for x in r["times"]) for a, b in zip(results[run], results[twin], strict=True)]
            ml, tl = results[run][0][S - 1]["losses"], results[twin][0][S - 1]["losses"]
            err = max(abs(a - b) / abs(b) for a, b in zip(ml, tl, strict=True))
            print(f"  / {twin} (the same schedule) step time: per round "
                  f"{' '.join(f'{x:.2f}' for x in per_round)}, median {statistics.median(per_round):.3f}; losses "
                  f"{[round(v, 5) for v in ml]} vs {[round(v, 5) for v in tl]} (max rel. diff {err:.1e})")
        if run in TORCH_RUNS and run != "torch" and "torch" in results:
            per_round = [statistics.median(x for r in a for x in r["times"]) / statistics.median(
                x for r in b for x in r["times"]) for a, b in zip(results[run], results["torch"], strict=True)]
            ml, tl = results[run][0][S - 1]["losses"], results["torch"][0][S - 1]["losses"]
            err = max(abs(a - b) / abs(b) for a, b in zip(ml, tl, strict=True))
            print(f"  / torch GPipe step time: per round {' '.join(f'{x:.2f}' for x in per_round)}, median "
                  f"{statistics.median(per_round):.3f}; losses max rel. diff to GPipe's {err:.1e}")


if __name__ == "__main__":
    main()

"""Where a pipeline rank's memory goes: the stage executor's live tensor bytes at the peak of a training step, by
holder, against the planner (:func:`meshtorch.runtime.pipeline_exec.rank_memory`) and the peak RSS growth.

Same model, ranks and process setup as ``benchmarks/pipeline_vs_torch.py``'s ``mt_*`` runs (4 layers, d_model 256,
S = 4 gloo ranks x 1 thread, M = 8, AdamW, ``MALLOC_MMAP_THRESHOLD_=131072``): per rank a tiny warm-up model, RSS
reset, the stage programs built (RSS after the build), one step (the benchmark's warm-up step), then one step
under :class:`meshtorch.testing.live_tensors.LiveTensorBytes` (every ATen op's outputs counted until their
storage dies). At the step's peak of live tensor bytes the storages are split by holder: the variables, the
summed weight gradients, the stage inputs / forward stashes / received output gradients of the microbatches in
flight, the sends not yet waited for (``isend`` buffers), and the rest (the running action's values). Printed
per rank: the peak RSS growth (VmHWM after the reset minus the RSS before the build) and its split into the RSS
the build adds and the rest; the live tensor peak and its parts; the planner's total and parts.

Run: ``python benchmarks/pipeline_memory.py [--schedules gpipe,1f1b] [--stages 4] [--microbatches 8] [--layers 4]``
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from host import describe  # noqa: E402
from pipeline_vs_torch import LR, MIB, batches, config, executor_memory  # noqa: E402
from rss import peak_rss_bytes, reset_peak, rss_bytes  # noqa: E402

PARTS = ("variables", "gradients", "in_flight", "sends", "other")
PLAN_PARTS = ("variables", "gradients", "stash", "sends_held", "transient")


def _holders(ex, programs) -> dict:
    """``{storage key: holder}`` of what the executor ``ex`` and the stage ``programs`` hold now."""
    from torch.utils._pytree import tree_leaves

    from meshtorch.testing.live_tensors import LiveTensorBytes

    key, out = LiveTensorBytes.key, {}

    def put(tensors, name):
        for t in tensors:
            if hasattr(t, "untyped_storage"):
                out.setdefault(key(t), name)

    put(tree_leaves([p.lowering.store.values for p in programs if p is not None]), "variables")
    put(tree_leaves(ex.run.grads), "gradients")
    put(tree_leaves([ex.acts, ex.grads_in, ex.saved]), "in_flight")
    put([v for _, v in ex.pending.values()], "sends")
    return out


def worker(cfg_kw: dict, schedule: str, stages: int, microbatches: int) -> dict:
    """One gloo rank: warm-up, RSS reset, build, one step, one step counted by LiveTensorBytes."""
    import torch
    import torch.distributed as dist

    import meshtorch as mtf
    from meshtorch.core.schedules import build_schedule
    from meshtorch.models.lm_stages import stage_programs
    from meshtorch.runtime import pipeline_exec
    from meshtorch.testing.live_tensors import LiveTensorBytes

    torch.set_num_threads(1)
    opt = lambda: mtf.optim.AdamWOptimizer(LR, weight_decay=0.0)  # noqa: E731
    r = dist.get_rank()

    def step(programs, table, x, y):
        pipeline_exec.apply_updates(programs, pipeline_exec.run_rank(table, programs, x, y).grads)

    tiny = config(dict(vocab_size=32, d_model=16, num_heads=2, d_kv=8, d_ff=32, length=8, batch_size=microbatches,
                       num_layers=stages))
    step(stage_programs(tiny, stages, microbatches, rank=r, optimizer=opt),
         build_schedule(schedule, stages, microbatches), *batches(tiny, 1)[0])
    cfg = config(cfg_kw)
    data = batches(cfg, 2)
    base = reset_peak()
    programs = stage_programs(cfg, stages, microbatches, rank=r, optimizer=opt)
    table = build_schedule(schedule, stages, microbatches)
    built = rss_bytes()
    step(programs, table, *data[0])
    dist.barrier()
    growth = peak_rss_bytes() - base  # the build and one step, as pipeline_vs_torch.py's (before the counting)

    state = {"ex": None, "phase": "forward/backward", "parts": {}, "phase_at_peak": ""}
    init = pipeline_exec._DistExecutor.__init__

    def remember(self, *a, **k):
        init(self, *a, **k)
        state["ex"] = self

    class Live(LiveTensorBytes):
        def _update(self):
            before = self.peak
            super()._update()
            if self.peak > before and state["ex"] is not None:
                held = _holders(state["ex"], programs)
                parts = dict.fromkeys(PARTS, 0)
                for k, b in self.at_peak.items():
                    parts[held.get(k, "other")] += b
                state["parts"], state["phase_at_peak"] = parts, state["phase"]

    pipeline_exec._DistExecutor.__init__ = remember
    live = Live()
    try:
        with live:
            live.track([p.lowering.store.values for p in programs if p is not None])
            run = pipeline_exec.run_rank(table, programs, *data[1])
            state["phase"] = "optimizer"
            pipeline_exec.apply_updates(programs, run.grads)
    finally:
        pipeline_exec._DistExecutor.__init__ = init
    dist.barrier()
    return {"rank": r, "growth": growth, "build": built - base, "live_peak": live.peak,
            "parts": state["parts"], "phase": state["phase_at_peak"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    from meshtorch.testing.spmd import run_spmd

    S, M = args.stages, args.microbatches
    cfg_kw = dict(num_layers=args.layers)
    print(describe())
    print(f"load average before: {os.getloadavg()}")
    for sched in args.schedules.split(","):
        res = sorted(run_spmd("pipeline_memory:worker", args=(cfg_kw, sched, S, M), nprocs=S, timeout_s=1200,
                              dist_timeout_s=600, extra_path=[HERE],
                              env={"MALLOC_MMAP_THRESHOLD_": "131072"}).check().results, key=lambda d: d["rank"])
        planned = executor_memory(config(cfg_kw), S, M, sched, 1)
        print(f"\n{sched} (MiB per rank)")
        for d, p in zip(res, planned, strict=True):
            parts = " ".join(f"{k} {d['parts'].get(k, 0) / MIB:.2f}" for k in PARTS)
            plan = " ".join(f"{k} {p[k] / MIB:.2f}" for k in PLAN_PARTS)
            print(f"  rank {d['rank']}: RSS growth {d['growth'] / MIB:.2f} (build {d['build'] / MIB:.2f}); live "
                  f"tensor peak {d['live_peak'] / MIB:.2f} in the {d['phase']} ({parts}); planner "
                  f"{p['total'] / MIB:.2f} ({plan}, in flight {p['in_flight']}); live / planner "
                  f"{d['live_peak'] / p['total']:.3f}; RSS growth / planner {d['growth'] / p['total']:.3f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

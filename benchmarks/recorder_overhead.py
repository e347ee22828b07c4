"""Cost of the flight recorder: data-parallel step time with collective recording on and off.

N gloo processes (``--procs``, default 4) train a data-parallel model (``batch:all``): ``--model mlp``
is the MNIST MLP of benchmarks/spmd_vs_ddp.py (2 gradient all-reduces per step), ``--model lm`` a small
transformer LM (one all-reduce per weight: many small collectives per step, the worst case for a
per-call cost). Blocks of steps alternate recording on / off (``flight_recorder().enabled``; the order
flips every block, the host is shared), and the script reports the median step time of each and the
median of the per-block-pair ratios on / off (goal <= 1.02). Also printed: the cost of one record
(``record`` + ``finish``) in a tight loop, in microseconds, and the recording work of one step timed alone
(calls per step x that cost + the session's counting of the step's records): on a shared host the
interleaved ratio's spread can exceed the effect, and that estimate is the noise-free bound.

Run: ``python benchmarks/recorder_overhead.py [--procs 4] [--model mlp|lm] [--steps 20] [--blocks 8] [--placement]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def worker(model: str, steps: int, blocks: int, hidden: int, batch: int, placement: int = 0) -> dict:
    """One rank's timings; ``placement`` > 0: in this one process, on a placement mesh of that many processors."""
    sys.path.insert(0, HERE)
    import torch.distributed as dist

    import meshtorch as mtf
    from meshtorch.lowering.counters import Counters
    from meshtorch.mesh.recorder import flight_recorder

    torch.set_num_threads(1)
    if placement:
        impl = mtf.PlacementMeshImpl(f"all:{placement}", "batch:all")
    else:
        impl = mtf.SpmdMeshImpl(f"all:{dist.get_world_size()}", "batch:all")
    if model == "mlp":
        import mlp_model as M
        g, mesh, images, labels, loss, update, _, _ = M.build(hidden, batch, lr=0.1)
        x, y = M.examples(torch.arange(batch))
        lw = mtf.Lowering(g, {mesh: impl})
        feeds = {images: x, labels: y}
        fetches = list(update)
    else:
        from meshtorch.models.transformer import build_lm, preset
        cfg = preset("tiny", vocab_size=64, d_model=64, num_heads=4, d_kv=16, d_ff=128, num_layers=4, length=32,
                     batch_size=batch)
        lm = build_lm(cfg, seed=1)
        variables = lm.graph.trainable_variables
        updates = mtf.optim.SgdOptimizer(0.01).apply_grads(mtf.gradients([lm.loss], variables), variables)
        lw = mtf.Lowering(lm.graph, {lm.mesh: impl})
        ids = torch.randint(0, cfg.vocab_size, (batch, cfg.length + 1), generator=torch.Generator().manual_seed(0))
        feeds = {lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]}
        fetches = list(updates)
    rec = flight_recorder()
    for _ in range(3):  # warm up (plans, caches)
        lw.run(fetches, feeds=feeds)
    rec.sink = step_records = []
    lw.run(fetches, feeds=feeds)
    rec.sink = None
    per_step = len(step_records)
    times = {"on": [], "off": []}
    for b in range(blocks):
        for name in (("on", "off") if b % 2 == 0 else ("off", "on")):
            rec.enabled = name == "on"
            impl.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                lw.run(fetches, feeds=feeds)
            impl.barrier()
            times[name].append((time.perf_counter() - t0) / steps)
    rec.enabled = True
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        r = impl._record("allreduce", (0,), (4096,), torch.float32, "SUM")
        r.finish()
    record_us = (time.perf_counter() - t0) / n * 1e6
    # the session's per-run counting of one step's records (lowering.counters), best of 5 rounds
    count_us = min(_seconds(lambda: Counters.from_records(step_records, 0, 1), 200) for _ in range(5)) * 1e6
    return dict(times=times, per_step=per_step, record_us=record_us, count_us=count_us)


def _seconds(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--placement", action="store_true",
                    help="one process, a placement mesh of --procs processors (no gloo: less scheduling noise)")
    ap.add_argument("--model", choices=("mlp", "lm"), default="mlp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024, help="MLP hidden size")
    ap.add_argument("--batch", type=int, default=256, help="global batch (the LM: sequences)")
    args = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    from host import describe

    from meshtorch.testing.spmd import run_spmd

    if args.placement:
        res = worker(args.model, args.steps, args.blocks, args.hidden, args.batch, placement=args.procs)
    else:
        res = run_spmd("recorder_overhead:worker", args=(args.model, args.steps, args.blocks, args.hidden, args.batch),
                       nprocs=args.procs, timeout_s=1200, extra_path=[HERE]).check().results[0]
    on, off = res["times"]["on"], res["times"]["off"]
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    print(describe())
    where = f"placement mesh all:{args.procs} in 1 process" if args.placement else f"{args.procs} gloo processes"
    print(f"{args.model} data parallel, {where} x 1 thread, batch {args.batch}, "
          f"{res['per_step']} collective calls per step, {args.blocks} block pairs of {args.steps} steps (interleaved)")
    print("recording on,  ms/step per block:", ", ".join(f"{v * 1e3:.2f}" for v in on))
    print("recording off, ms/step per block:", ", ".join(f"{v * 1e3:.2f}" for v in off))
    print(f"median: on {statistics.median(on) * 1e3:.3f} ms, off {statistics.median(off) * 1e3:.3f} ms; "
          f"median of per-block ratios on/off = {statistics.median(ratios):.4f} (goal <= 1.02); "
          f"one record + finish: {res['record_us']:.2f} us")
    work_us = res["per_step"] * res["record_us"] + res["count_us"]
    print(f"recording work per step, timed alone: {res['per_step']} x {res['record_us']:.2f} us + counting "
          f"{res['count_us']:.1f} us = {work_us:.1f} us = {work_us * 1e-6 / statistics.median(off):.4%} of the median "
          f"step with recording off (the on/off ratio it predicts: {1 + work_us * 1e-6 / statistics.median(off):.4f})")
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"per-block ratios on/off: quartiles {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}, range {min(ratios):.3f} .. "
          f"{max(ratios):.3f}; min(on) / min(off) = {min(on) / min(off):.4f}")


if __name__ == "__main__":
    main()

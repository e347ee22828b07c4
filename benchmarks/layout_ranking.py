"""Does the cost model rank layouts the way the machine does? Predicted vs measured step time of every layout.

For an LM preset on a mesh, every legal layout of :func:`meshtorch.planning.search.candidate_layouts` is
(a) priced by :func:`meshtorch.planning.cost.estimate_time` with the calibrated cost model of the backend
(:mod:`meshtorch.runtime.calibrate`, cached per host/backend/threads; ``--calibrate`` measures again), and
(b) trained for a few AdamW steps, median step time after the warm-up steps: in this process on the
placement backend, or in ``--procs`` gloo processes (one per processor) on the gloo backend. Layouts are
measured in interleaved rounds (each round runs every layout once) to spread the machine's noise.

Prints a table and three figures: Kendall's tau between predicted and measured times (``scipy.stats``),
top-1 regret (measured time of the predicted best / best measured - 1), and the median of
``|predicted / measured - 1|``.

    python benchmarks/layout_ranking.py --backend gloo --mesh all:2 --preset small
    python benchmarks/layout_ranking.py --backend placement --mesh data:2,model:2 --preset small
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host import describe  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.data.sharding import local_batch_indices, local_feed  # noqa: E402
from meshtorch.models.transformer import build_lm, preset  # noqa: E402
from meshtorch.planning import memory_report  # noqa: E402
from meshtorch.planning.cost import estimate_time  # noqa: E402
from meshtorch.planning.search import candidate_layouts, graph_dimensions  # noqa: E402
from meshtorch.runtime.calibrate import calibrate  # noqa: E402


def _cfg(name: str, mesh: str, layout: str, batch: int | None):
    spec = mtf.MeshSpec(mesh, layout)
    return preset(name, vocab_size=256, vocab_multiple=spec.axis_size_for("vocab"), batch_size=batch)


def layouts_of(name: str, mesh: str, batch: int | None) -> list[str]:
    """Every legal layout of the preset on ``mesh`` (one of each set equal up to swapping equal-size axes)."""
    spec = mtf.MeshSpec(mesh)
    lm = build_lm(_cfg(name, mesh, "", batch))
    sizes: dict = {}
    for op in lm.graph.operations:
        for t in op.outputs:
            for d in t.shape:
                sizes.setdefault(d.name, set()).add(d.size)
    axes = {d.name: d.size for d in spec.shape}
    out = []
    for rules in candidate_layouts(graph_dimensions(lm.graph), list(axes), sizes, axes):
        try:
            lm = build_lm(_cfg(name, mesh, rules, batch), optimizer=mtf.optim.AdamWOptimizer(1e-3))
            mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec(mesh, rules)}, materialize=False)
        except mtf.LayoutError:
            continue
        out.append(rules)
    return out


def predict(name: str, mesh: str, rules: str, batch: int | None, cost) -> dict:
    lm = build_lm(_cfg(name, mesh, rules, batch), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec(mesh, rules)}, materialize=False)
    return estimate_time(memory_report(lw, [lm.loss] + lm.updates), cost)


def _steps(lm, lw, n: int, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    c = lm.config
    times = []
    for _ in range(n):
        b = torch.randint(0, c.vocab_size, (c.batch_size, c.length + 1), generator=g)
        feeds = {lm.inputs: b[:, :-1], lm.targets: b[:, 1:]}
        if lw.mesh_impl(lm.loss).size > len(lw.mesh_impl(lm.loss).local_pnums()):  # SPMD: this rank's rows
            feeds = {t: local_feed(lw, t, v[local_batch_indices(lw, t)]) for t, v in feeds.items()}
            t0 = time.perf_counter()
            lw.run([lm.loss] + lm.updates, feeds=feeds, feed_slices=True)[0].item()
        else:
            t0 = time.perf_counter()
            lw.run([lm.loss] + lm.updates, feeds=feeds)[0].item()
        times.append(time.perf_counter() - t0)
    return times


def measure_placement(name, mesh, rules, batch, steps, warmup) -> float:
    lm = build_lm(_cfg(name, mesh, rules, batch), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh, rules)})
    return statistics.median(_steps(lm, lw, warmup + steps)[warmup:])


def spmd_worker(name, mesh, layouts, batch, steps, warmup, threads):
    """One rank of the gloo measurement: the median step time of every layout (the slowest rank counts)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    out = {}
    for rules in layouts:
        lm = build_lm(_cfg(name, mesh, rules, batch), optimizer=mtf.optim.AdamWOptimizer(1e-3))
        lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.SpmdMeshImpl(mesh, rules)})
        dist.barrier()
        out[rules] = statistics.median(_steps(lm, lw, warmup + steps)[warmup:])
    return out


def kendall_tau(a, b) -> float:
    from scipy.stats import kendalltau  # benchmark-only dependency

    return float(kendalltau(a, b).statistic)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gloo", choices=["placement", "gloo"])
    ap.add_argument("--mesh", default=None, help="default: all:2 (gloo), data:2,model:2 (placement)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each layout's time is the median")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calibrate", action="store_true", help="measure the machine again before predicting")
    ap.add_argument("--max-layouts", type=int, default=40)
    args = ap.parse_args()
    mesh = args.mesh if args.mesh is not None else ("all:2" if args.backend == "gloo" else "data:2,model:2")
    torch.set_num_threads(args.threads)
    print(describe())
    t0 = time.perf_counter()
    cal = calibrate(args.backend, args.threads, force=args.calibrate)
    print(cal.summary())
    cost = cal.cost_model()
    layouts = layouts_of(args.preset, mesh, args.batch_size)[: args.max_layouts]
    print(f"{len(layouts)} legal layouts of the {args.preset!r} LM on mesh {mesh!r} ({args.backend}, "
          f"{args.threads} thread(s) per process); {args.rounds} interleaved rounds of {args.warmup} + "
          f"{args.steps} steps")
    pred = {r: predict(args.preset, mesh, r, args.batch_size, cost)["total_s"] for r in layouts}
    runs: dict = {r: [] for r in layouts}
    for _ in range(args.rounds):
        if args.backend == "placement":
            for r in layouts:
                runs[r].append(measure_placement(args.preset, mesh, r, args.batch_size, args.steps, args.warmup))
        else:
            from meshtorch.testing.spmd import run_spmd

            n = mtf.MeshSpec(mesh).size
            job = run_spmd("layout_ranking:spmd_worker", (args.preset, mesh, layouts, args.batch_size, args.steps,
                                                          args.warmup, args.threads),
                           nprocs=n, timeout_s=3600, extra_path=[os.path.dirname(os.path.abspath(__file__))]).check()
            for r in layouts:
                runs[r].append(max(res[r] for res in job.results))
    meas = {r: statistics.median(v) for r, v in runs.items()}
    print(f"{'layout':<52} {'predicted ms':>12} {'measured ms':>12} {'pred/meas':>9}  spread")
    for r in sorted(layouts, key=lambda r: meas[r]):
        print(f"{r or '(replicated)':<52} {pred[r] * 1e3:12.1f} {meas[r] * 1e3:12.1f} {pred[r] / meas[r]:9.2f}  "
              f"{min(runs[r]) * 1e3:.1f}-{max(runs[r]) * 1e3:.1f}")
    p, m = [pred[r] for r in layouts], [meas[r] for r in layouts]
    best_pred = min(layouts, key=lambda r: pred[r])
    regret = meas[best_pred] / min(m) - 1
    err = statistics.median(abs(a / b - 1) for a, b in zip(p, m, strict=True))
    print(f"Kendall tau {kendall_tau(p, m):.3f}; top-1 regret {100 * regret:.1f}% (predicted best "
          f"{best_pred or '(replicated)'!r}); median |predicted/measured - 1| {100 * err:.1f}%; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

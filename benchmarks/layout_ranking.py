"""Does the cost model rank layouts the way the machine does? Predicted vs measured step time of every layout.

For an LM preset on a mesh, every legal layout that ``--layout auto``'s search ranks
(:func:`meshtorch.runtime.plan_lm.plan_lm`, no storage rules or pipelines) and train's default layout are
(a) priced by :func:`meshtorch.planning.cost.estimate_time` with the calibrated cost model of the backend
(:mod:`meshtorch.runtime.calibrate`, cached per host/backend/threads; ``--calibrate`` measures again), and
(b) trained for a few AdamW steps, median step time after the warm-up steps: in this process on the
placement backend, or in ``--procs`` gloo processes (one per processor) on the gloo backend. Layouts are
measured in interleaved rounds (each round runs every layout once) to spread the machine's noise.

Prints a table and three figures: Kendall's tau between predicted and measured times (``scipy.stats``),
top-1 regret (measured time of the predicted best / best measured - 1), and the median of
``|predicted / measured - 1|``.

    python benchmarks/layout_ranking.py --backend gloo --mesh all:2 --preset small
    python benchmarks/layout_ranking.py --backend placement --mesh data:2,model:2 --preset small --auto

``--auto`` first runs ``--layout auto``'s measuring choice (:func:`meshtorch.runtime.autolayout.choose_layout`,
not cached; on gloo in the ranks of the mesh, as under torchrun) and reports its layout's time in the
interleaved measurement over the fastest's and the default layout's, and the time the choice took over 600
steps of the default layout.

``--breakdown`` (gloo) times each layout's steps again with the flight recorder on every rank and prints where a step
goes: collective calls executed / planned, seconds in collectives per rank, the transfer after the last rank reached
each call, and the spread of the ranks' arrival times (the synchronisation wait), summed over the step.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host import describe  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.lowering.stages import plan  # noqa: E402
from meshtorch.models.transformer import build_lm, preset  # noqa: E402
from meshtorch.planning import memory_report  # noqa: E402
from meshtorch.planning.cost import estimate_time, priced_calls  # noqa: E402
from meshtorch.runtime.autolayout import choose_layout, default_layout_for, time_steps  # noqa: E402
from meshtorch.runtime.calibrate import calibrate  # noqa: E402
from meshtorch.runtime.plan_lm import backend_options, plan_lm  # noqa: E402


def _cfg(name: str, mesh: str, layout: str, batch: int | None):
    spec = mtf.MeshSpec(mesh, layout)
    return preset(name, vocab_size=256, vocab_multiple=spec.axis_size_for("vocab"), batch_size=batch)


def layouts_of(name: str, mesh: str, batch: int | None, cost, backend: str = "placement") -> list[str]:
    """Every legal layout of the preset on ``mesh`` that ``--layout auto``'s search ranks (one of each set equal
    up to swapping equal-size axes; the greedy refinement's layouts with several dims on one axis included),
    in the cost model's order, and train's default layout for the mesh if the search did not rank it."""
    ranked = plan_lm(lambda m: preset(name, vocab_size=256, vocab_multiple=m, batch_size=batch), mesh, search=True,
                     cost=cost, print_fn=lambda *a: None, pipelines=False, options=backend_options(backend))
    out = [lay for lay, _ in ranked]
    default = default_layout_for(mesh)
    if _find(default, out) is None:
        out.append(default)
    return out


def _find(rules: str, layouts: list[str]) -> str | None:
    """The layout of ``layouts`` equal to ``rules`` up to the order of its rules, or None."""
    return next((lay for lay in layouts if mtf.LayoutRules(lay) == mtf.LayoutRules(rules)), None)


def report_of(name: str, mesh: str, rules: str, batch: int | None, backend: str):
    """The planned report of one AdamW step of the preset under ``rules``, with the schedule ``backend`` runs
    (:func:`~meshtorch.runtime.plan_lm.backend_options`: gloo's gradient buckets, one process per processor)."""
    lm = build_lm(_cfg(name, mesh, rules, batch), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    return memory_report(plan(lm.graph, [lm.loss] + lm.updates, mtf.MeshSpec(mesh, rules), backend_options(backend)))


def measure_placement(name, mesh, rules, batch, steps, warmup) -> float:
    lm = build_lm(_cfg(name, mesh, rules, batch), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh, rules)})
    return statistics.median(time_steps(lm, lw, steps, warmup=warmup))


def spmd_worker(name, mesh, layouts, batch, steps, warmup, threads):
    """One rank of the gloo measurement: the median step time of every layout (the slowest rank counts)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    out = {}
    for rules in layouts:
        lm, lw = _spmd_lm(name, mesh, rules, batch)
        dist.barrier()
        out[rules] = statistics.median(time_steps(lm, lw, steps, warmup=warmup))
    return out


def _spmd_lm(name, mesh, rules, batch):
    """(the LM with AdamW, its Lowering on this rank's SPMD mesh) under ``rules``."""
    lm = build_lm(_cfg(name, mesh, rules, batch), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    return lm, mtf.Lowering(lm.graph, {lm.mesh: mtf.SpmdMeshImpl(mesh, rules)})


def spmd_breakdown_worker(name, mesh, layouts, batch, steps, warmup, threads):
    """One rank of ``--breakdown``: per layout, ``steps`` timed steps (after ``warmup``), each as (seconds, [(kind,
    bytes per processor, start, seconds, asynchronous) of every collective call the flight recorder saw])."""
    import torch.distributed as dist

    from meshtorch.mesh.recorder import flight_recorder

    torch.set_num_threads(threads)
    out = {}
    for rules in layouts:
        lm, lw = _spmd_lm(name, mesh, rules, batch)
        dist.barrier()
        time_steps(lm, lw, warmup)
        out[rules] = []
        for i in range(steps):
            sink = flight_recorder().sink = []
            t = time_steps(lm, lw, 1, seed=i + 1)[0]
            flight_recorder().sink = None
            out[rules].append((t, [(r.kind, r.bytes_per_processor, r.start, r.seconds, r.asynchronous) for r in sink]))
    return out


def breakdown(results: list, layouts: list[str], planned: dict) -> None:
    """Print where each layout's gloo step goes (``--breakdown``), from every rank's flight records: the slowest rank's
    median step, collective calls executed (and planned), seconds in collectives per rank, the seconds after the last
    rank arrived at each call (the transfer) and the spread of the ranks' arrival times (the synchronisation wait),
    summed over the step's calls; medians over the steps. ``time.perf_counter`` is the host's monotonic clock, so
    the ranks' start times compare (one host only)."""
    print(f"{'layout':<40} {'step ms':>8} {'calls':>11} {'in coll. ms (ranks)':>22} {'transfer ms':>12} {'wait ms':>8}")
    for r in layouts:
        rows = []
        for steps in zip(*(res[r] for res in results), strict=True):
            calls = list(zip(*(c for _, c in steps), strict=True))
            rows.append((max(t for t, _ in steps), len(calls), [sum(x[3] for x in c) for _, c in steps],
                         sum(min(x[2] + x[3] for x in call) - max(x[2] for x in call) for call in calls),
                         sum(max(x[2] for x in call) - min(x[2] for x in call) for call in calls)))
        med = [statistics.median(row[i] for row in rows) for i in (0, 3, 4)]
        coll = "/".join(f"{statistics.median(row[2][k] for row in rows) * 1e3:.0f}" for k in range(len(results)))
        print(f"{r or '(replicated)':<40} {med[0] * 1e3:8.1f} {f'{rows[0][1]} / {planned[r]}':>11} {coll:>22} "
              f"{med[1] * 1e3:12.1f} {med[2] * 1e3:8.1f}")


def paired_steps(lms: list, steps: int, warmup: int = 1) -> list[list[float]]:
    """Head-to-head: ``steps`` paired rounds of one step of each of ``lms`` ((lm, lowering) pairs, all built before
    the first), in alternating order (A B, then B A: a load that drifts hits both alike), after ``warmup`` untimed
    steps each; seconds per step, per layout."""
    for lm, lw in lms:
        time_steps(lm, lw, 0, warmup=warmup)
    out = [[] for _ in lms]
    for i in range(steps):
        order = range(len(lms)) if i % 2 == 0 else reversed(range(len(lms)))
        for k in order:
            out[k] += time_steps(lms[k][0], lms[k][1], 1, seed=i + 1)
    return out


def paired_placement(name, mesh, layouts, batch, steps) -> list[list[float]]:
    lms = []
    for rules in layouts:
        lm = build_lm(_cfg(name, mesh, rules, batch), optimizer=mtf.optim.AdamWOptimizer(1e-3))
        lms.append((lm, mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh, rules)})))
    return paired_steps(lms, steps)


def spmd_paired_worker(name, mesh, layouts, batch, steps, threads):
    """One rank of the head-to-head (:func:`paired_steps`); every rank runs the same steps in the same order, so a
    step's time is the slowest rank's (the parent takes the maximum over ranks per step)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    lms = [_spmd_lm(name, mesh, rules, batch) for rules in layouts]
    dist.barrier()
    return paired_steps(lms, steps)


def verdict(auto: str, others: list[str], times: dict) -> str:
    """``--layout auto``'s choice against each of ``others`` on the head-to-head's paired steps: the median paired
    ratio (auto's step over the other's of the same round) with the sign test's one-sided 95% bounds
    (:class:`meshtorch.runtime.autorace.Paired`, the rule ``--layout auto`` decides by)."""
    from meshtorch.runtime.autorace import CONFIDENCE, Paired, paired_ratios

    lines = []
    for o in others:
        r = sorted(paired_ratios(times[o], times[auto]))
        p = Paired.of(times[o], times[auto])
        hi = f"{p.high:.3f}" if math.isfinite(p.high) else "inf"
        lines.append(f"  auto / {o or '(replicated)'}: median paired ratio {p.ratio:.3f} (one-sided "
                     f"{100 * CONFIDENCE:.0f}% upper bound {hi}; quartiles {r[len(r) // 4]:.3f}-"
                     f"{r[(3 * len(r)) // 4]:.3f}; {p.n} pairs)")
    return "\n".join(lines)


def spmd_auto_worker(name, mesh, batch, threads):
    """One rank of ``--layout auto`` under gloo (as ``meshtorch train --layout auto`` under torchrun: every rank
    measures the same candidates, the slowest rank's medians count): (the chosen layout, seconds it took, the
    lines it printed on rank 0: its table)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.barrier()
    t0 = time.perf_counter()
    said = []
    layout = choose_layout(lambda m: preset(name, vocab_size=256, vocab_multiple=m, batch_size=batch), mesh,
                           backend="gloo", threads=threads, world=dist.get_world_size(), cache=False,
                           print_fn=said.append if dist.get_rank() == 0 else (lambda *a: None))[0]
    return layout, time.perf_counter() - t0, said


def kendall_tau(a, b) -> float:
    """Kendall's tau-b of two equally long sequences (``scipy.stats.kendalltau`` when scipy is installed, else
    the same definition: (concordant - discordant) / sqrt((n0 - ties in a) (n0 - ties in b)))."""
    try:
        from scipy.stats import kendalltau  # benchmark-only dependency
    except ImportError:
        pairs = [(a[i] - a[j], b[i] - b[j]) for i in range(len(a)) for j in range(i)]
        s = sum((x > 0) - (x < 0) for x in (p * q for p, q in pairs))
        ta, tb = sum(p != 0 for p, _ in pairs), sum(q != 0 for _, q in pairs)
        return s / (ta * tb) ** 0.5 if ta and tb else float("nan")
    return float(kendalltau(a, b).statistic)


def ranking_quality(pred: dict, meas: dict, layouts: list[str]) -> tuple[float, float, float, str]:
    """(Kendall tau, top-1 regret, median |predicted / measured - 1|, the predicted best) of ``pred`` against
    ``meas`` (seconds per layout)."""
    p, m = [pred[r] for r in layouts], [meas[r] for r in layouts]
    best = min(layouts, key=lambda r: pred[r])
    return (kendall_tau(p, m), meas[best] / min(m) - 1,
            statistics.median(abs(a / b - 1) for a, b in zip(p, m, strict=True)), best)


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
    ap.add_argument("--breakdown", action="store_true",
                    help="gloo: also time each layout's steps with the flight recorder on every rank and print where "
                         "they go (collective calls, transfer after the last rank arrived, the ranks' arrival spread)")
    ap.add_argument("--verify-steps", type=int, default=20,
                    help="with --auto: paired steps of the head-to-head between auto's choice, the default layout and "
                         "the fastest measured (all built at once, one step each per round, alternating order); 0: "
                         "none")
    ap.add_argument("--auto", action="store_true",
                    help="also run --layout auto's choice (measuring, not cached) first, and report its "
                         "measured time over the fastest and over the default layout's, and its cost as a share of "
                         "a 600-step run of the default layout")
    args = ap.parse_args()
    mesh = args.mesh if args.mesh is not None else ("all:2" if args.backend == "gloo" else "data:2,model:2")
    torch.set_num_threads(args.threads)
    print(describe())
    t0 = time.perf_counter()
    cal = calibrate(args.backend, args.threads, force=args.calibrate)
    print(cal.summary())
    cost = cal.cost_model(processes=mtf.MeshSpec(mesh).size if args.backend != "placement" else None)
    layouts = layouts_of(args.preset, mesh, args.batch_size, cost, args.backend)[: args.max_layouts]
    default = _find(default_layout_for(mesh), layouts) or default_layout_for(mesh)
    if default not in layouts:
        layouts.append(default)
    auto = None
    if args.auto and args.backend == "placement":
        t_auto = time.perf_counter()
        auto = choose_layout(lambda m: preset(args.preset, vocab_size=256, vocab_multiple=m,
                                              batch_size=args.batch_size), mesh, threads=args.threads,
                             cache=False)[0]
        t_auto = time.perf_counter() - t_auto
    elif args.auto:  # gloo: --layout auto on the ranks of the SPMD mesh, as under torchrun
        from meshtorch.testing.spmd import run_spmd

        job = run_spmd("layout_ranking:spmd_auto_worker", (args.preset, mesh, args.batch_size, args.threads),
                       nprocs=mtf.MeshSpec(mesh).size, timeout_s=3600,
                       extra_path=[os.path.dirname(os.path.abspath(__file__))]).check()
        (auto, t_auto, said), *_ = job.results
        print("\n".join(said))  # rank 0's table (the ranks' stdout is not kept)
    if auto is not None:
        auto = _find(auto, layouts) or auto
        if auto not in layouts:
            layouts.append(auto)
    print(f"{len(layouts)} legal layouts of the {args.preset!r} LM on mesh {mesh!r} ({args.backend}, "
          f"{args.threads} thread(s) per process); {args.rounds} interleaved rounds of {args.warmup} + "
          f"{args.steps} steps")
    reports = {r: report_of(args.preset, mesh, r, args.batch_size, args.backend) for r in layouts}
    pred = {r: estimate_time(rep, cost)["total_s"] for r, rep in reports.items()}
    # the model before issue 36: each planned collective pays the latency (29 calls for batch:all's gradient sums)
    pred_per_sum = {r: estimate_time(replace(rep, collective_calls=None), cost)["total_s"]
                    for r, rep in reports.items()}
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
    if args.breakdown and args.backend == "gloo":
        from meshtorch.testing.spmd import run_spmd

        job = run_spmd("layout_ranking:spmd_breakdown_worker", (args.preset, mesh, layouts, args.batch_size,
                                                                args.steps, args.warmup, args.threads),
                       nprocs=mtf.MeshSpec(mesh).size, timeout_s=3600,
                       extra_path=[os.path.dirname(os.path.abspath(__file__))]).check()
        breakdown(job.results, layouts, {r: sum(priced_calls(reports[r]).values()) for r in layouts})
    print(f"{'layout':<52} {'predicted ms':>12} {'measured ms':>12} {'pred/meas':>9}  {'spread':<13} "
          f"{'calls':>5} {'per-sum ms':>10}")
    for r in sorted(layouts, key=lambda r: meas[r]):
        calls = f"{sum(priced_calls(reports[r]).values())}/{reports[r].counters.count()}"
        print(f"{r or '(replicated)':<52} {pred[r] * 1e3:12.1f} {meas[r] * 1e3:12.1f} {pred[r] / meas[r]:9.2f}  "
              f"{f'{min(runs[r]) * 1e3:.1f}-{max(runs[r]) * 1e3:.1f}':<13} {calls:>5} {pred_per_sum[r] * 1e3:10.1f}")
    tau, regret, err, best_pred = ranking_quality(pred, meas, layouts)
    tau0, regret0, err0, best0 = ranking_quality(pred_per_sum, meas, layouts)
    print(f"same measured times, latency per planned collective (calls/collectives above: the model before "
          f"pricing per bucket call): Kendall tau {tau0:.3f}; top-1 regret {100 * regret0:.1f}% (predicted best "
          f"{best0 or '(replicated)'!r}); median |predicted/measured - 1| {100 * err0:.1f}%")
    if auto is not None:
        fastest = min(layouts, key=lambda r: meas[r])
        print(f"--layout auto chose {auto!r}: measured {meas[auto] * 1e3:.1f} ms = {meas[auto] / meas[fastest]:.3f}x "
              f"the fastest ({fastest!r}, {meas[fastest] * 1e3:.1f} ms), {meas[auto] / meas[default]:.3f}x the default "
              f"layout ({default!r}, {meas[default] * 1e3:.1f} ms); choosing took {t_auto:.1f} s = "
              f"{100 * t_auto / (600 * meas[default]):.1f}% of 600 default steps ({600 * meas[default]:.0f} s)")
        vs = [r for r in dict.fromkeys([default, fastest]) if r != auto]
        if vs and args.verify_steps > 0:
            head = [auto] + vs
            if args.backend == "placement":
                times = dict(zip(head, paired_placement(args.preset, mesh, head, args.batch_size,
                                                        args.verify_steps), strict=True))
            else:
                from meshtorch.testing.spmd import run_spmd

                job = run_spmd("layout_ranking:spmd_paired_worker", (args.preset, mesh, head, args.batch_size,
                                                                     args.verify_steps, args.threads),
                               nprocs=mtf.MeshSpec(mesh).size, timeout_s=3600,
                               extra_path=[os.path.dirname(os.path.abspath(__file__))]).check()
                times = {r: [max(ts) for ts in zip(*(res[k] for res in job.results), strict=True)]
                         for k, r in enumerate(head)}
            print(f"head-to-head, {args.verify_steps} paired steps (auto's choice and "
                  f"{' and '.join(repr(v) for v in vs)} built at once, alternating order):")
            print(verdict(auto, vs, times))
    print(f"Kendall tau {tau:.3f}; top-1 regret {100 * regret:.1f}% (predicted best "
          f"{best_pred or '(replicated)'!r}); median |predicted/measured - 1| {100 * err:.1f}%; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

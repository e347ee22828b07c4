"""Interpretive overhead of a lowered program: program steps per training step, Python time per step.

For the ``tiny`` and ``small`` LM presets (``meshtorch.models.transformer.PRESETS``) with AdamW and
global-norm clipping (as ``benchmarks/lm_step.py`` builds its training step), on 1 processor and on
a 2x2 placement mesh (``data:2,model:2`` with ``batch:data;heads:model;d_ff:model;vocab:model``):

* **steps**: program steps of one training step (``lowering.run([loss] + updates)``): the step lines
  of ``lowering.program_str(fetches)`` (lines that start with a step index; nested sub-program lines
  are counted too), which lists the steps one run of ``fetches`` executes (before 2026-11-23 evening
  it listed the whole program, 5-7 lines more for these graphs).
* **(i) zero-FLOP configuration**: the preset's structure (layers, optimizer, clipping) with every
  dimension 1 or 2 (d_model 2, heads 2, d_kv 1, d_ff 2, vocab 4, length 2, batch 2), so kernels cost
  almost nothing: Python time per step = time per run / steps.
* **(ii) profiler**: the real preset; run time minus the time spent inside torch kernels (the sum of
  the self CPU time of the ``aten::`` ops that ``torch.profiler`` records), divided by the steps. The
  profiler slows every op, so this is given as a bracket: *low* = median run time without the
  profiler minus median kernel time under it (the kernel times include some profiler cost, so too
  low), *high* = median run time under the profiler minus its kernel time (includes the profiler's own
  Python-side cost, so too high).

Runs of all variants are interleaved (each repeat runs every variant ``--runs`` times, in turn), so
load from other processes hits them alike; figures are medians over repeats with the interquartile
range [first quartile, third quartile] and the minimum (the least disturbed repeat).

Also times planning (``mtf.Lowering(graph, {mesh: impl})``, which includes computing the initial
variable values, then ``plan_counters(fetches)``, which selects the training step's steps) for the
``base`` preset on 2x2.

Only public API is used (``build_lm``, ``mtf.Lowering``, ``run``, ``plan_counters``, ``program_str``),
so the benchmark keeps working when the lowering's internals change.

    PYTHONPATH=src python benchmarks/step_overhead.py [--repeats 7] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import time

import torch

import meshtorch as mtf
from meshtorch.models.transformer import PRESETS, build_lm

MESHES = {"1proc": ("", ""),
          "2x2": ("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model")}
ZERO_FLOP = dict(d_model=2, num_heads=2, d_kv=1, d_ff=2, vocab_size=4, length=2, batch_size=2)
# The "before" figures (issue 11, measured on main before the lowering rewrite): a 2-layer LM
# with almost no compute.
BEFORE = {"1proc": {"steps": 478, "ms_per_run": 8.8, "us_per_step": 18.0},
          "2x2": {"steps": 512, "ms_per_run": 23.0, "us_per_step": 46.0}}
_STEP_LINE = re.compile(r"^[\s|]*\d+ ")


@dataclasses.dataclass
class Variant:
    name: str
    preset: str
    mesh: str
    zero_flop: bool
    run: object
    steps: int


def count_steps(lowering, fetches) -> int:
    """Step lines of ``program_str(fetches)`` (see the module docstring)."""
    return sum(1 for line in lowering.program_str(fetches).splitlines() if _STEP_LINE.match(line))


def build_variant(preset: str, mesh: str, zero_flop: bool, seed: int = 0, mode: str = "codegen") -> Variant:
    cfg = PRESETS[preset]
    if zero_flop:
        cfg = dataclasses.replace(cfg, **ZERO_FLOP)
    opt = mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0)
    lm = build_lm(cfg, seed=seed, optimizer=opt, clip_norm=1.0)
    mesh_shape, layout = MESHES[mesh]
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}, mode=mode)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
    feeds = {lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]}
    fetches = [lm.loss] + lm.updates

    def run():
        lw.run(fetches, feeds=feeds)
    run()  # the first run selects the steps and caches the program (and compiles it, in mode "compile")
    name = f"{preset}{'/zero-flop' if zero_flop else ''} {mesh} {mode}"
    return Variant(name, preset, mesh, zero_flop, run, count_steps(lw, fetches))


def profiled_seconds(fn, runs: int) -> tuple[float, float]:
    """``(wall, kernel)`` seconds per call of ``fn`` under torch.profiler; kernel = the aten ops' self CPU time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(runs):
            fn()
        wall = time.perf_counter() - t0
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::"))
    return wall / runs, total_us * 1e-6 / runs


def measure(variants, repeats: int, runs: int, profile: bool) -> dict:
    """Per variant and repeat: seconds per run (mean of ``runs`` runs); under the profiler, wall and kernel."""
    wall = {v.name: [] for v in variants}
    kern = {v.name: [] for v in variants}
    pwall = {v.name: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            t0 = time.perf_counter()
            for _ in range(runs):
                v.run()
            wall[v.name].append((time.perf_counter() - t0) / runs)
        if profile:
            for v in variants:
                if not v.zero_flop:
                    w, k = profiled_seconds(v.run, runs)
                    pwall[v.name].append(w)
                    kern[v.name].append(k)
    return {"wall": wall, "kernel": kern, "profiled_wall": pwall}


def time_planning(preset: str, mesh: str, repeats: int) -> dict:
    cfg = PRESETS[preset]
    mesh_shape, layout = MESHES[mesh]
    lows, plans = [], []
    for _ in range(repeats):
        lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0), clip_norm=1.0)
        impl = mtf.PlacementMeshImpl(mesh_shape, layout)
        t0 = time.perf_counter()
        lw = mtf.Lowering(lm.graph, {lm.mesh: impl})
        t1 = time.perf_counter()
        lw.plan_counters([lm.loss] + lm.updates)
        t2 = time.perf_counter()
        lows.append(t1 - t0)
        plans.append(t2 - t1)
    return {"preset": preset, "mesh": mesh, "lowering_s": lows, "plan_counters_s": plans,
            "steps": count_steps(lw, [lm.loss] + lm.updates)}


def _stats(xs):
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats (medians and spread over these)")
    ap.add_argument("--runs", type=int, default=5, help="training steps per timed repeat")
    ap.add_argument("--plan-repeats", type=int, default=3, help="timed Lowering builds of the base preset (0: skip)")
    ap.add_argument("--no-profile", action="store_true", help="skip method (ii), the torch.profiler subtraction")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave the default)")
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    ap.add_argument("--modes", default="interpret,codegen",
                    help="executors to compare, interleaved: interpret (the step loop, as before the generated "
                         "functions), codegen (default executor), compile (torch.compile; tens of seconds each)")
    ap.add_argument("--meshes", default=",".join(MESHES), help=f"subset of {sorted(MESHES)}")
    ap.add_argument("--zero-flop-only", action="store_true", help="only the zero-FLOP configurations (method (i))")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    variants = []
    for preset in args.presets.split(","):
        for mesh in args.meshes.split(","):
            for zero_flop in ((True,) if args.zero_flop_only else (True, False)):
                for mode in args.modes.split(","):
                    variants.append(build_variant(preset, mesh, zero_flop, mode=mode))
    for v in variants:  # warm-up
        v.run()
    m = measure(variants, args.repeats, args.runs, not args.no_profile)
    rows = []
    for v in variants:
        wall = m["wall"][v.name]
        row = {"variant": v.name, "preset": v.preset, "mesh": v.mesh, "zero_flop": v.zero_flop, "steps": v.steps,
               "ms_per_run": _stats([1e3 * w for w in wall])}
        if v.zero_flop:
            row["us_per_step"] = _stats([1e6 * w / v.steps for w in wall])
            row["method"] = "(i) zero-FLOP: run time / steps"
        elif m["kernel"][v.name]:
            kern, pwall = m["kernel"][v.name], m["profiled_wall"][v.name]
            row["kernel_ms_per_run"] = _stats([1e3 * k for k in kern])
            row["profiled_ms_per_run"] = _stats([1e3 * w for w in pwall])
            low = (statistics.median(wall) - statistics.median(kern)) / v.steps
            high = statistics.median([w - k for w, k in zip(pwall, kern, strict=True)]) / v.steps
            row["us_per_step_bracket"] = [1e6 * low, 1e6 * high]
            row["method"] = "(ii) (run time - aten self CPU time) / steps: [low, high]"
        rows.append(row)
    plan = time_planning("base", "2x2", args.plan_repeats) if args.plan_repeats else None
    load_after = os.getloadavg()
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {cpu}, {os.cpu_count()} CPUs, load average "
          f"{load_before[0]:.1f} before / {load_after[0]:.1f} after; "
          f"{args.repeats} interleaved repeats x {args.runs} runs; median [quartiles] and min over repeats")
    print(f"{'variant':<34}{'steps':>6}{'ms/run':>34}{'kernel ms/run':>34}{'Python us/step':>34}  method")
    for r in rows:
        def fmt(s):
            return "" if s is None else f"{s['median']:8.2f} [{s['q1']:.2f}, {s['q3']:.2f}] min {s['min']:.2f}"
        if "us_per_step" in r:
            py = fmt(r["us_per_step"])
        else:
            py = "{:.2f} .. {:.2f}".format(*r["us_per_step_bracket"]) if "us_per_step_bracket" in r else ""
        print(f"{r['variant']:<34}{r['steps']:>6}{fmt(r['ms_per_run']):>34}{fmt(r.get('kernel_ms_per_run')):>34}"
              f"{py:>34}  {r.get('method', '')}")
    print("before (issue 11, 2-layer LM with almost no compute):")
    for mesh, b in BEFORE.items():
        print(f"  {mesh:<6} {b['steps']} steps, {b['ms_per_run']} ms/run, about {b['us_per_step']:.0f} us/step")
    if plan:
        lo, pc = _stats(plan["lowering_s"]), _stats(plan["plan_counters_s"])
        print(f"planning base on 2x2 ({plan['steps']} steps): mtf.Lowering {lo['median']:.2f} s "
              f"[{lo['min']:.2f}, {lo['max']:.2f}], then plan_counters {pc['median']:.3f} s")
    if args.json:
        out = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
               "loadavg_before": load_before, "loadavg_after": load_after, "repeats": args.repeats, "runs": args.runs,
               "rows": rows, "planning": plan, "before": BEFORE, "raw": m}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return rows, plan


if __name__ == "__main__":
    main()

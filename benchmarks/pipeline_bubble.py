"""The bubble fraction of the stage executor's schedules, measured from its per-action timeline, against the
closed formula and against the schedule table timed by the measured action durations (issue 32).

Model: ``pipeline_vs_torch.config`` (d_model 256, 4 heads x 64, d_ff 1024, length 64, batch 16) with vocab 32, so
the embedding and the logits are small beside a block and the stages cost about the same (the closed formulas
assume equal stages), one block per virtual stage. ``--stages`` S gloo ranks (one CPU thread each,
``meshtorch.testing.spmd.run_spmd``), each running :func:`meshtorch.runtime.pipeline_exec.run_rank` (the
forward and backward of ``meshtorch train --pipeline-schedule``; no optimizer) for each case of ``--cases``
(schedule, microbatches M, virtual stages per rank R), the cases alternated ``--rounds`` times inside one group of
processes so slow periods of a shared host hit all. Per step: a barrier, then the step; its timeline
(:attr:`~meshtorch.runtime.pipeline_exec.ScheduleRun.events`, nanoseconds since a barrier-aligned origin).

Printed per case, medians over the timed steps (after one warm-up step per case and round) with the spread
(min-max):

* ``measured``: :func:`meshtorch.runtime.pipeline_trace.step_bubbles` averaged over the ranks: per rank, the
  idle share of the step window (first action of any rank to last event of any rank), idle = the window less
  the rank's compute (its actions' time less its time blocked in ``recv`` and send waits);
* ``formula``: GPipe and 1F1B ``(S-1)/(M+S-1)``; interleaved 1F1B ``(S-1)/(R M+S-1)``; zero-bubble its table's
  unit-time bubble (``T_F = T_I = T_W``: ``(S-1)/(3 R M+S-1)``). With equal stages the first two hold for any
  backward / forward cost ratio (``tests/test_pipeline_trace.py`` checks 2x and 3x); the zero-bubble one only when
  ``F``, ``I`` and ``W`` cost the same;
* ``table@medians``: :meth:`~meshtorch.core.schedules.ScheduleTable.weighted` with each (virtual stage, kind) at
  its measured median compute time (:func:`~meshtorch.runtime.pipeline_trace.predicted_bubble`): what the table
  predicts for the stages' real costs (imbalance, ``B``/``F`` ratio) with free transfers;
* ``table@measured``: the same per step with each action at its own measured compute time in that step
  (:func:`~meshtorch.runtime.pipeline_trace.action_times`; the jitter of a loaded host included): the honest
  reference, what is left between it and the measured bubble being the transfers' latency, the ranks' start
  skew and the time a rank takes to wake from a finished ``recv``;
* ``blocked``: the share of the step the ranks spent blocked in ``recv`` and send waits (mean over ranks);
  ``latency``: the part of it after the message's ``isend`` was posted (:func:`latency_share`: transfer and
  wake-up, which the table does not price); the measured mean ``F``/``B``/``I``/``W`` compute times.

With S ranks on fewer than S free cores the ranks share cores: a rank blocked in ``recv`` (gloo polls) or one
whose neighbour computes on the same core slows down, so the bubble is not the schedule's alone.

Run: ``python benchmarks/pipeline_bubble.py [--stages 2] [--cases gpipe:4:1,...] [--steps 4] [--rounds 2]
[--trace-dir DIR]`` (DIR: one Chrome trace per case, its last round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from host import describe  # noqa: E402
from pipeline_vs_torch import batches, config  # noqa: E402

from meshtorch.core.schedules import build_schedule  # noqa: E402
from meshtorch.runtime.pipeline_trace import (  # noqa: E402
    action_costs,
    action_times,
    predicted_bubble,
    step_bubbles,
    write_chrome_trace,
)

DEFAULT_CASES = ("gpipe:4:1,1f1b:4:1,interleaved-1f1b:4:2,zero-bubble:4:1,zero-bubble:4:2,"
                 "gpipe:8:1,1f1b:8:1,interleaved-1f1b:8:2,zero-bubble:8:1,zero-bubble:8:2")


def formula(name: str, S: int, M: int, R: int) -> float:
    """The closed-form bubble fraction (zero-bubble: its table's, with unit-cost ``F``, ``I``, ``W``)."""
    if name == "zero-bubble":
        return (S - 1) / (3 * R * M + S - 1)
    return (S - 1) / (R * M + S - 1)


def worker(cases: list, cfg_kw: dict, steps: int, rounds: int) -> list:
    """This rank: per round and case, ``steps + 1`` steps of :func:`~meshtorch.runtime.pipeline_exec.run_rank`;
    returns ``[(round, case index, [this rank's events per timed step])]``, nanoseconds since an origin taken
    after a barrier."""
    import torch
    import torch.distributed as dist

    from meshtorch.models.lm_stages import stage_programs
    from meshtorch.runtime.pipeline_exec import run_rank

    torch.set_num_threads(1)
    r, S = dist.get_rank(), dist.get_world_size()
    built = {}
    for name, M, R in cases:
        cfg = config({**cfg_kw, "num_layers": S * R})
        built[(name, M, R)] = (stage_programs(cfg, S, M, R, rank=r), build_schedule(name, S, M, R), batches(cfg, 2))
    dist.barrier()
    origin = time.perf_counter_ns()
    out = []
    for rnd in range(rounds):
        for i, case in enumerate(cases):
            programs, table, data = built[case]
            timed = []
            for s in range(steps + 1):
                dist.barrier()
                run = run_rank(table, programs, *data[s % len(data)])
                if s:  # the first step warms up
                    timed.append([(n, c, t0 - origin, t1 - origin) for n, c, t0, t1 in run.events[r]])
            out.append((rnd, i, timed))
    return out


def latency_share(table, ranks: list) -> float:
    """The share of the step (mean over ranks) each rank spent in ``recv`` after the message's ``isend`` had been
    posted: ``recv end - max(recv start, the producing action's send end)`` summed over its receives, over the
    window of :func:`~meshtorch.runtime.pipeline_trace.step_bubbles`: the transfer and the receiver's wake-up,
    which the table (transfers free) does not count."""
    producer = {table.receiver(a): a for row in table.order for a in row if table.receiver(a) is not None}
    sent, recvs = {}, []
    for evs in ranks:
        inner = []
        for name, cat, t0, t1 in evs:
            if cat == "action":
                for _, c, s0, s1 in inner:
                    if c == "send":
                        sent[name] = s1
                    elif c == "recv":
                        recvs.append((name, s0, s1))
                inner = []
            else:
                inner.append((name, cat, t0, t1))
    names = {str(a): a for row in table.order for a in row}
    late = sum(t1 - max(t0, sent[str(producer[names[n]])]) for n, t0, t1 in recvs)
    return late / len(ranks) / step_bubbles(ranks)[0]["window_ns"]


def _spread(xs: list) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages = gloo ranks")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="schedule:M:R,...")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per case and round (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the cases")
    ap.add_argument("--trace-dir", default="", help="write each case's Chrome trace (last round) here")
    args = ap.parse_args(argv)
    cases = []
    for c in args.cases.split(","):
        name, M, R = c.split(":")
        build_schedule(name, args.stages, int(M), int(R))  # refuses a bad case before any process starts
        cases.append((name, int(M), int(R)))
    from meshtorch.testing.spmd import run_spmd

    S = args.stages
    cfg_kw = dict(vocab_size=32, d_model=args.d_model, d_ff=args.d_ff, batch_size=args.batch, length=args.length)
    print(describe())
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {os.getloadavg()[0]:.2f} (host "
          f"shared with other jobs); LM d_model {args.d_model}, d_ff {args.d_ff}, vocab 32, length {args.length}, "
          f"batch {args.batch}, one block per virtual stage; S={S} gloo ranks x 1 thread; {args.rounds} rounds x "
          f"{args.steps} timed steps", flush=True)
    res = run_spmd("pipeline_bubble:worker", args=(cases, cfg_kw, args.steps, args.rounds), nprocs=S,
                   timeout_s=1800, dist_timeout_s=600, extra_path=[HERE]).check().results
    print(f"\n{'schedule':>17} {'M':>2} {'R':>2} {'formula':>8} {'table@medians':>14} {'table@measured':>20} "
          f"{'measured (min-max)':>20} {'blocked':>8} {'latency':>8}  per-action ms F/B/I/W")
    for i, (name, M, R) in enumerate(cases):
        table = build_schedule(name, S, M, R)
        steps, last = [], None
        for k, (_, j, timed) in enumerate(res[0]):
            if j == i:  # res[r][k][2][s]: rank r's events of timed step s of this case and round
                last = [[res[r][k][2][s] for r in range(S)] for s in range(len(timed))]
                steps += last
        bub = [statistics.mean(b["bubble"] for b in step_bubbles(s)) for s in steps]
        blocked = [statistics.mean(b["blocked"] for b in step_bubbles(s)) for s in steps]
        late = [latency_share(table, s) for s in steps]
        costs = action_costs(table, steps)  # median compute seconds per (virtual stage, kind)
        pred = [predicted_bubble(table, action_times(table, s)) for s in steps]  # each step's own durations
        pred_med = predicted_bubble(table, costs)
        kinds = {}
        for (_, kind), sec in costs.items():
            kinds.setdefault(kind, []).append(sec * 1e3)
        ms = "/".join(f"{statistics.mean(kinds[k]):.1f}" if k in kinds else "-" for k in "FBIW")
        f, med = formula(name, S, M, R), statistics.median(bub)
        print(f"{name:>17} {M:>2} {R:>2} {f:>8.3f} {pred_med:>14.3f} {_spread(pred):>20} {_spread(bub):>20} "
              f"{statistics.median(blocked):>8.3f} {statistics.median(late):>8.3f}  {ms}; measured / formula "
              f"{med / f:.2f}, / table@measured {med / statistics.median(pred):.2f}", flush=True)
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            write_chrome_trace(os.path.join(args.trace_dir, f"{name}-S{S}-M{M}-R{R}.json"), last, name)


if __name__ == "__main__":
    main()

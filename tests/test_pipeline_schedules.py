"""Pipeline schedules as data (issue 32, :mod:`meshtorch.core.schedules`): each rank's order of actions against
``torch.distributed.pipelining``'s ``pipeline_order`` for the same ``S``, ``M``, ``R`` (built without a process
group), the timed table against an independent dependency check, the bubble fractions against the papers'
formulas, peak in-flight microbatches, ``meshtorch plan --pipeline-schedule`` and its refusals, and
``docs/pipeline.md``'s tables."""

from __future__ import annotations

import os
import re

import pytest
import torch.distributed.pipelining.schedules as ts

import meshtorch as mtf
from meshtorch.cli import main
from meshtorch.core.schedules import SCHEDULES, Action, ScheduleTable, build_schedule, check_schedule
from meshtorch.models.transformer import build_lm, preset
from meshtorch.runtime.plan_lm import plan_lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [(name, S, M, R) for S in (2, 4) for M in (4, 8)
         for name, R in (("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1),
                         ("zero-bubble", 2))]


def _torch_order(name, S, M, R) -> dict[int, list[str]]:
    """torch's per-rank compute actions (``F``/``B``/``I``/``W``; its idle slots and ``REDUCE_GRAD`` dropped), from
    its schedule classes' own order builders on objects made without stages or a process group."""
    if name in ("gpipe", "1f1b") and R == 1:
        o = object.__new__(ts.ScheduleGPipe if name == "gpipe" else ts.Schedule1F1B)
        o._num_stages, o._n_microbatches = S, M
        order = o._get_pipeline_order()
    else:
        cls = {"gpipe": ts.ScheduleLoopedBFS, "interleaved-1f1b": ts.ScheduleInterleaved1F1B,
               "zero-bubble": ts.ScheduleInterleavedZeroBubble}[name]
        o = object.__new__(cls)
        o.pp_group_size, o.n_local_stages, o._n_microbatches, o._stages = S, R, M, [None] * R
        o.number_of_rounds = max(1, M // S)  # as their __init__ sets them
        o.microbatches_per_round = M // o.number_of_rounds
        order = {r: o._calculate_single_rank_operations(r) for r in range(S)}
    out = {r: [str(a) for a in acts if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
           for r, acts in order.items()}
    if name == "1f1b":
        # torch's Schedule1F1B._get_pipeline_order (a description; its runtime loop is separate) numbers the last
        # rank's forwards from 1 when it has no warm-up forward (F1..FM): renumber them from 0, only there
        last = out[S - 1]
        fwd = [int(a[len(f"{S - 1}F"):]) for a in last if "F" in a]
        if fwd == list(range(1, M + 1)):
            out[S - 1] = [f"{S - 1}F{int(a[len(f'{S - 1}F'):]) - 1}" if "F" in a else a for a in last]
    return out


@pytest.mark.parametrize("name,S,M,R", CASES)
def test_each_ranks_order_is_torchs(name, S, M, R):
    t = build_schedule(name, S, M, R)
    assert {r: [str(a) for a in t.order[r]] for r in range(S)} == _torch_order(name, S, M, R)


def _check_timed(t: ScheduleTable):
    """Independent check of the timed table: every action once, each rank's in its order, and an action only after
    what it needs ran on an earlier step (F after the previous stage's F; B/I after its F and the next stage's B/I;
    W after its I)."""
    V = t.stages * t.repeats
    when: dict[tuple, int] = {}
    for step, row in enumerate(t.timed):
        assert len(row) == t.stages
        for r, a in enumerate(row):
            if a is not None:
                assert a.stage % t.stages == r and (a.stage, a.kind, a.microbatch) not in when
                when[(a.stage, a.kind, a.microbatch)] = step
    back = "I" if t.name == "zero-bubble" else "B"
    kinds = ["F", back] + (["W"] if t.name == "zero-bubble" else [])
    assert set(when) == {(v, k, m) for v in range(V) for k in kinds for m in range(t.microbatches)}
    for r in range(t.stages):
        steps = [when[tuple(a)] for a in t.order[r]]
        assert steps == sorted(steps)
    for (v, k, m), step in when.items():
        need = {"F": [(v - 1, "F", m)] if v else [],
                "W": [(v, "I", m)]}.get(k, [(v, "F", m)] + ([(v + 1, back, m)] if v < V - 1 else []))
        assert all(when[n] < step for n in need), (v, k, m)


@pytest.mark.parametrize("name,S,M,R", CASES)
def test_timed_table_bubble_in_flight_and_sends(name, S, M, R):
    t = build_schedule(name, S, M, R)
    _check_timed(t)
    # bubble: GPipe and 1F1B (S-1)/(M+S-1) (Huang et al. 2019; Narayanan et al. 2021); interleaved and looped:
    # (S-1)/(R M+S-1) (Narayanan et al. 2021, section 2.2); zero-bubble ZB-H1 with T_F = T_B = T_W = one step:
    # (S-1)(T_F+T_B-T_W) idle steps of 3 R M + that (Qi et al. 2024, section 3)
    if name == "zero-bubble":
        assert t.bubble_fraction() == pytest.approx((S - 1) / (3 * R * M + S - 1), abs=1e-12)
    else:
        assert t.bubble_fraction() == pytest.approx((S - 1) / (R * M + S - 1), abs=1e-12)
    # activations held: GPipe all M R work items; 1F1B S - r on rank r (<= S); interleaved 1F1B its warm-up
    # forwards plus one, (R-1) M/rounds + 2 (S-1-r) + 1 (Narayanan et al. 2021)
    per_round = M // max(1, M // S)
    expected = {"gpipe": [M * R] * S, "1f1b": [S - r for r in range(S)],
                "interleaved-1f1b": [min((R - 1) * per_round + 2 * (S - 1 - r) + 1, M * R) for r in range(S)]}
    if name in expected:
        assert t.in_flight() == expected[name]
    # and counted on torch's order: +1 at F, -1 at B (zero-bubble: at W, the last use of the stage's inputs)
    held = []
    for acts in _torch_order(name, S, M, R).values():
        n = peak = 0
        for a in acts:
            kind = re.sub(r"\d", "", a)
            n += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            peak = max(peak, n)
        held.append(peak)
    assert t.in_flight() == held
    # one send per microbatch and virtual-stage boundary, each way (neighbouring virtual stages are on neighbouring
    # ranks): 2 M (S R - 1)
    sends = t.sends()
    assert len(sends) == 2 * M * (S * R - 1)
    assert all(dst == (src + 1) % S if a.kind == "F" else dst == (src - 1) % S for _, src, dst, a in sends)


@pytest.mark.parametrize("name,S,M,R", CASES)
def test_sends_are_freed_at_the_first_action_that_proves_them_received(name, S, M, R):
    """``send_waits`` against a reachability walk of the step's happens-before graph (each rank's order, and an
    edge from each action that sends to another rank to the action that receives it): a rank frees a send at
    its first action whose ancestors include the send's receiving action, and only there (so its ``wait`` never
    waits on a receive not yet posted: no deadlock where gloo completes a send only once the receiver posts)."""
    t = build_schedule(name, S, M, R)
    V = S * R

    def receiving(a):  # the executor's messages: F(v) -> F(v+1), B/I(v) -> B/I(v-1), between different ranks
        to = (Action(a.stage + 1, "F", a.microbatch) if a.kind == "F" and a.stage < V - 1 else
              Action(a.stage - 1, a.kind, a.microbatch) if a.kind in ("B", "I") and a.stage > 0 else None)
        return to if to is not None and to.stage % S != a.stage % S else None

    preds = {}
    for acts in t.order:
        for k, a in enumerate(acts):
            preds.setdefault(a, set()).update([acts[k - 1]] if k else [])
            if receiving(a) is not None:
                preds.setdefault(receiving(a), set()).add(a)
    ancestors: dict = {}
    for row in t.timed:  # in time order: every predecessor's ancestors are known first
        for a in row:
            if a is not None:
                ancestors[a] = set().union(*([{p} | ancestors[p] for p in preds[a]] or [set()]))
    freed = 0
    for r, acts in enumerate(t.order):
        waiting = []
        for k, a in enumerate(acts):
            due = [s for s in waiting if receiving(s) in ancestors[a]]
            assert list(t.send_waits[r][k]) == due, (r, str(a))
            freed += len(due)
            waiting = [s for s in waiting if s not in due] + ([a] if receiving(a) is not None else [])
    assert freed > 0


def test_one_f_one_b_keeps_fewer_microbatches_than_gpipe():
    g, o = build_schedule("gpipe", 4, 8), build_schedule("1f1b", 4, 8)
    assert max(o.in_flight()) == 4 < max(g.in_flight()) == 8
    assert o.steps == g.steps  # same bubble, less memory


@pytest.mark.parametrize("name,S,M,R,match", [
    ("pipedream", 2, 4, 1, "unknown pipeline schedule"),
    ("1f1b", 2, 4, 2, "interleaved-1f1b"),
    ("interleaved-1f1b", 2, 4, 1, "repeats >= 2"),
    ("1f1b", 4, 2, 1, "microbatches >= stages"),
    ("zero-bubble", 4, 9, 1, "multiple of its rounds"),
    ("gpipe", 2, 0, 1, "microbatches must be an int >= 1"),
])
def test_bad_schedules_are_refused(name, S, M, R, match):
    with pytest.raises(ValueError, match=match):
        check_schedule(name, S, M, R)


def test_a_deadlocking_order_is_refused():
    t = ScheduleTable("gpipe", 2, 1, 1, ((Action(0, "F", 0), Action(0, "B", 0)),
                                         (Action(1, "B", 0), Action(1, "F", 0))))
    with pytest.raises(ValueError, match="deadlock"):
        _ = t.timed


def _parse_actions(text: str) -> list[list[str | None]]:
    rows = [line for line in text.splitlines() if re.match(r"^\| \d+ \|", line)]
    return [[None if c.strip() == "-" else c.strip() for c in row.strip("|").split("|")[1:]] for row in rows]


def _exit_status(argv) -> int:
    """``meshtorch`` ARGV's exit status: what main returns (a UsageError) or argparse's SystemExit code."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


PLAN = ["plan", "--preset", "tiny", "--d-model", "32", "--d-ff", "64", "--length", "16", "--hardware", "cpu"]


@pytest.mark.parametrize("name,S,M,R", [("1f1b", 2, 4, 1), ("interleaved-1f1b", 2, 4, 2)])
def test_plan_prints_the_named_schedule(capsys, name, S, M, R):
    argv = PLAN + ["--mesh", f"pipe:{S}", "--layout", "stage:pipe", "--layers", str(S * R), "--microbatches", str(M),
                   "--schedule", "--pipeline-schedule", name]
    assert main(argv) == 0
    out = capsys.readouterr().out
    t = build_schedule(name, S, M, R)
    assert _parse_actions(out) == [[None if a is None else str(a) for a in row] for row in t.timed]
    assert f"schedule {name}" in out and f"bubble fraction {(S - 1) / (R * M + S - 1):.3f} (its table)" in out


@pytest.mark.parametrize("extra,match", [
    (["--mesh", "pipe:2", "--layout", "stage:pipe", "--layers", "2", "--pipeline-schedule", "interleaved-1f1b"],
     "--pipeline-schedule interleaved-1f1b .*repeats >= 2"),
    (["--mesh", "data:2", "--layout", "batch:data", "--layers", "2", "--pipeline-schedule", "1f1b"],
     "--pipeline-schedule 1f1b needs a pipeline"),
    (["--mesh", "pipe:2", "--search", "--layers", "2", "--pipeline-schedule", "1f1b"],
     "--pipeline-schedule 1f1b plans one --layout"),
    (["--mesh", "pipe:2", "--layout", "stage:pipe", "--layers", "2", "--pipeline-schedule", "pipedream"],
     "--pipeline-schedule: invalid choice"),
])
def test_plan_refuses_bad_schedule_flags(capsys, extra, match):
    assert _exit_status(PLAN + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(match, err), err


def test_train_refuses_schedules_that_cannot_run_the_pipeline(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # were a schedule accepted, its run would write here
    argv = ["train", "--preset", "tiny", "--layers", "2", "--mesh", "pipe:2", "--layout", "stage:pipe",
            "--microbatches", "4", "--steps", "1", "--pipeline-schedule"]
    for name, match in (("interleaved-1f1b", "repeats >= 2"),):
        assert _exit_status(argv + [name]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("meshtorch train: error: --pipeline-schedule") and match in err[0]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_planner_memory_follows_the_schedule(name):
    """The plan's pipeline section under a schedule: its in-flight microbatches (M for GPipe, S for 1F1B) scale the
    unrolled program's activation peak (which holds all M)."""
    S, M = 2, 8
    cfg = preset("tiny", d_model=32, num_heads=2, d_kv=16, d_ff=64, length=16, vocab_size=64, num_layers=S,
                 batch_size=16, pipeline_stages=S, microbatches=M)
    lines: list[str] = []
    (_, rep), = plan_lm(cfg, f"pipe:{S}", "stage:pipe", print_fn=lines.append, pipeline_schedule=name)
    p = rep.pipeline
    assert p.schedule.name == name and p.in_flight == {"gpipe": M, "1f1b": S}[name]
    assert p.schedule_activation_bytes == p.peak_activation_bytes * p.in_flight // M
    assert f"peak in-flight microbatches per stage {p.schedule.in_flight()} of {M}" in "\n".join(lines)
    assert build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(1e-3)).pipeline.stages == S


def test_docs_show_each_schedules_table():
    """docs/pipeline.md shows each schedule's table as the code prints it (``ScheduleTable.markdown``)."""
    text = open(os.path.join(ROOT, "docs", "pipeline.md"), encoding="utf-8").read()
    found = re.findall(r"<!-- schedule ([\w-]+) S=(\d+) M=(\d+) R=(\d+) -->\n(.*?)\n<!-- /schedule -->", text, re.S)
    assert {f[0] for f in found} == set(SCHEDULES), [f[0] for f in found]
    for name, S, M, R, table in found:
        assert table.strip() == build_schedule(name, int(S), int(M), int(R)).markdown()
    m = re.search(r"<!-- schedules summary -->\n(.*?)\n<!-- /schedules summary -->", text, re.S)
    assert m, "docs/pipeline.md lost its schedules summary markers"
    rows = [r.strip("|").split("|") for r in m.group(1).splitlines()[2:]]
    assert len(rows) == len(CASES)
    for name, S, M, R, steps, bubble, flight in rows:
        S, M, R = int(S), int(M), int(R)
        t = build_schedule(name.strip(), S, M, R)
        assert (int(steps), float(bubble)) == (t.steps, round(t.bubble_fraction(), 3))
        assert [int(x) for x in flight.split(",")] == t.in_flight()


def test_weighted_table_prices_actions_by_their_cost():
    """``ScheduleTable.weighted``: with unit costs the table's steps and bubble; GPipe S=2 M=1 with F = 1 and B = 2
    by hand: rank 0 F [0, 1], rank 1 F [1, 2], B [2, 4], rank 0 B [4, 6]: makespan 6, bubble 1 - 6/12; idle
    steps cost nothing (a zero-cost action moves no clock)."""
    for name, S, M, R in CASES:
        t = build_schedule(name, S, M, R)
        span, bubble = t.weighted(lambda a: 1)
        assert (span, round(bubble, 12)) == (t.steps, round(t.bubble_fraction(), 12))
    assert build_schedule("gpipe", 2, 1).weighted(lambda a: 1 if a.kind == "F" else 2) == (6.0, 0.5)
    assert build_schedule("1f1b", 2, 4).weighted(lambda a: 0) == (0.0, 0.0)

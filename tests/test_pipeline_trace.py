"""The stage executor's timeline (:mod:`meshtorch.runtime.pipeline_trace`, issue 32): the bubble fraction measured
from per-rank action timelines and predicted from a schedule table, against the closed formulas (GPipe and 1F1B
``(S-1)/(M+S-1)``, Huang et al. 2019 / Narayanan et al. 2021; interleaved 1F1B ``(S-1)/(R M+S-1)``, Narayanan et
al. 2021 section 2.2; zero-bubble ZB-H1 with ``T_F = T_I = T_W``: ``(S-1)/(3 R M+S-1)``, Qi et al. 2024); the
Chrome trace's shape; ``meshtorch train --pipeline-trace`` refusals. The trace written by real gloo ranks is
checked in ``tests/test_pipeline_executor.py``'s gloo test (its ``meshtorch train`` run writes one)."""

from __future__ import annotations

import json
import re

import pytest

from meshtorch.cli import main as cli_main
from meshtorch.core.schedules import build_schedule
from meshtorch.runtime.pipeline_trace import (
    action_costs,
    action_times,
    chrome_trace,
    predicted_bubble,
    step_bubbles,
)

CASES = [(name, S, M, R) for S in (2, 4) for M in (4, 8)
         for name, R in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zero-bubble", 2))]


def _formula(name, S, M, R):
    if name == "zero-bubble":
        return (S - 1) / (3 * R * M + S - 1)
    return (S - 1) / (R * M + S - 1)


def _timeline(table, unit=1000):
    """Every rank's events as the executor records them had each action taken ``unit`` ns in its slot of the
    table (:attr:`~meshtorch.core.schedules.ScheduleTable.timed`): an action starts when the rank's previous one
    ended and, if its slot is later, is blocked in a ``recv`` until then; rank 1 also posts a send in each
    action. Starts at 5 * unit (an arbitrary common origin)."""
    ranks = [[] for _ in range(table.stages)]
    free = [5 * unit] * table.stages
    for t, row in enumerate(table.timed):
        for r, a in enumerate(row):
            if a is None:
                continue
            slot = 5 * unit + t * unit
            if slot > free[r]:
                ranks[r].append(("recv from rank 0", "recv", free[r], slot))
            if r == 1:
                ranks[r].append(("send to rank 0", "send", slot, slot + 1))
            ranks[r].append((str(a), "action", free[r], slot + unit))
            free[r] = slot + unit
    return ranks


@pytest.mark.parametrize("name,S,M,R", CASES)
def test_bubble_of_a_timeline_and_of_the_table_is_the_formula(name, S, M, R):
    """A timeline with one unit per slot measures the closed formula's bubble (mean over ranks); the table timed
    by that timeline's action costs predicts it; and for GPipe, 1F1B and interleaved 1F1B the formula holds for
    any backward / forward cost ratio (backward 2x and 3x forward, split evenly into I and W) with equal stages."""
    table = build_schedule(name, S, M, R)
    ranks = _timeline(table)
    bubbles = step_bubbles(ranks)
    assert len(bubbles) == S
    assert sum(b["bubble"] for b in bubbles) / S == pytest.approx(_formula(name, S, M, R), abs=1e-12)
    assert all(b["window_ns"] == len(table.timed) * 1000 for b in bubbles)
    costs = action_costs(table, [ranks, ranks])
    assert set(costs.values()) == {1e-6}
    assert predicted_bubble(table, costs) == pytest.approx(_formula(name, S, M, R), abs=1e-12)
    times = action_times(table, ranks)
    assert set(times) == {a for row in table.order for a in row} and set(times.values()) == {1e-6}
    assert predicted_bubble(table, times) == pytest.approx(_formula(name, S, M, R), abs=1e-12)
    if name != "zero-bubble":
        for back in (2.0, 3.0):
            ratio = {(a.stage, a.kind): {"F": 1.0, "B": back, "I": back / 2, "W": back / 2}[a.kind]
                     for row in table.order for a in row}
            assert predicted_bubble(table, ratio) == pytest.approx(_formula(name, S, M, R), abs=1e-12)


def test_chrome_trace_has_one_slice_per_action_in_table_order():
    """The Trace Event Format of two steps (JSON round trip): one process per rank named by it, per step a
    ``step k`` slice holding every action slice of the rank, in its row's order, with the receives inside
    them; times in microseconds."""
    table = build_schedule("1f1b", 2, 4)
    steps = [_timeline(table), [[(n, c, t0 + 10 ** 6, t1 + 10 ** 6) for n, c, t0, t1 in r] for r in _timeline(table)]]
    trace = json.loads(json.dumps(chrome_trace(steps, "1f1b")))
    ev = trace["traceEvents"]
    assert {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"} == {
        "pipeline rank 0 (1f1b)", "pipeline rank 1 (1f1b)"}
    for r in range(2):
        mine = sorted((e for e in ev if e["ph"] == "X" and e["pid"] == r), key=lambda e: (e["ts"], -e["dur"]))
        assert [e["name"] for e in mine if e["cat"] == "step"] == ["step 0", "step 1"]
        acts = [e for e in mine if e["cat"] == "action"]
        assert [e["name"] for e in acts] == [str(a) for a in table.order[r]] * 2
        for e in mine:
            if e["cat"] in ("recv", "send"):
                assert any(a["ts"] <= e["ts"] and e["ts"] + e["dur"] <= a["ts"] + a["dur"] for a in acts)
    last = steps[1][1][-1]  # rank 1's last action of step 1, in microseconds
    assert [e["ts"] for e in ev if e["name"] == last[0] and e["pid"] == 1][-1] == last[2] / 1e3


def test_action_costs_refuse_a_timeline_out_of_the_tables_order():
    table = build_schedule("1f1b", 2, 4)
    ranks = _timeline(table)
    ranks[1][-1], ranks[1][-3] = ranks[1][-3], ranks[1][-1]  # two actions of rank 1 swapped
    with pytest.raises(ValueError, match="rank 1 ran .* not its row of the 1f1b table"):
        action_costs(table, [ranks])


@pytest.mark.parametrize("extra,match", [
    (["--pipeline-schedule", "gpipe"], "--pipeline-trace needs the stage executor"),
    ([], "--pipeline-trace needs the stage executor"),
    (["--pipeline-schedule", "1f1b", "--pipeline-trace", "."], "--pipeline-trace '.' is a directory"),
])
def test_train_refuses_a_bad_pipeline_trace(capsys, tmp_path, monkeypatch, extra, match):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--preset", "tiny", "--layers", "2", "--mesh", "pipe:2", "--layout", "stage:pipe",
            "--microbatches", "4", "--steps", "1", "--pipeline-trace", "t.json"] + extra
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(re.escape(match), err[0]), err

"""``--layout auto``'s sequential race (issue 36, :func:`meshtorch.runtime.autorace.race`): while the challenger's
gain over the default is inside the margin, the candidates in contention take more interleaved steps until the
decision is clear or the budget is spent; a clearly faster challenger wins without more steps; a clearly slower
candidate drops out and gets no more steps; the seconds spent stay within the budget. Step times are faked and
the expected outcome computed independently with NumPy (linear-interpolated percentiles, medians, sums)."""

import itertools
import json
import os
import time

import numpy as np
import pytest

from meshtorch.runtime import autolayout
from meshtorch.runtime.autolayout import Candidate
from meshtorch.runtime.autorace import race


def _margin(a, b):
    """The gain needed, computed independently: max(5%, either one's interquartile range over its median)."""
    return max(0.05, *((np.percentile(t, 75) - np.percentile(t, 25)) / np.median(t) for t in (a, b)))


def _gain(default, other):
    return 1 - np.median(other) / np.median(default)


def _held(plans, log):
    """Candidates (the first the default) whose steps take ``plans[i]`` s (cycling), each with its first 3 timed
    steps already taken; ``log`` records which candidate ran each later step, in order."""
    out = []
    for i, plan in enumerate(plans):
        cycle = itertools.cycle(plan)
        c = Candidate(f"l{i}", "", None, False, 1.0, 0, default=i == 0)
        c.times = tuple(next(cycle) for _ in range(3))
        out.append((c, lambda i=i, cycle=cycle: log.append(i) or next(cycle)))
    return out


def test_race_extends_while_undecided_and_stops_at_the_budget():
    """The challenger is 3% faster, inside the 10% margin the default's steps spread: both take more steps, one
    each per round in alternating order (A B, B A, ...), until the next round would pass the budget (5% of 600
    steps of the default's median: 30 s); the gain is still inside the margin at the end."""
    log = []
    held = _held([[1.0, 0.9, 1.1], [0.97]], log)
    first = sum(sum(c.times) for c, _ in held)
    got = race(held, first, share=0.05)
    d, c = (np.array(c.times) for c, _ in held)
    assert got.stop == "budget" and got.rounds > 0 and len(d) == len(c) == 3 + got.rounds
    assert log == [0, 1, 1, 0] * (got.rounds // 2) + [0, 1] * (got.rounds % 2)
    budget = 0.05 * 600 * np.median(d)  # from the default's median, all its steps
    assert got.budget_s == pytest.approx(budget)
    assert d.sum() + c.sum() <= budget < d.sum() + c.sum() + np.median(d) + np.median(c)
    assert 0 < _gain(d, c) < _margin(d, c)


def test_race_a_clearly_faster_challenger_wins_without_extension():
    """A challenger 30% faster than the default with tight steps is beyond the margin after the first 3 steps:
    no more rounds run (though another candidate, 3% faster, is inside the margin), and the rule replaces the
    default."""
    log = []
    held = _held([[1.0, 1.01, 0.99], [0.7, 0.71, 0.69], [0.97], [1.3]], log)
    got = race(held, 0.0)
    d, c, close = held[0][0].times, held[1][0].times, held[2][0].times
    assert _gain(d, c) >= _margin(d, c) and 0 < _gain(d, close) < _margin(d, close)
    assert got.stop == "replaced" and got.rounds == 0 and log == []
    assert autolayout.decide([h[0] for h in held]).index == 1


def test_race_drops_a_clearly_slower_candidate_for_good():
    """Candidate 2 starts inside the margin (0.95 s against the default's ~1 s) and then steps at 2 s: it drops
    out at the first round where its gain is below -margin (found here independently with NumPy on the steps
    both had), and takes no step after; the default and candidate 1 (3% faster) race on to the budget."""
    log = []
    plan2 = [0.95] * 3 + [2.0] * 100
    held = _held([[1.0, 0.9, 1.1], [0.97], plan2], log)
    got = race(held, 0.0, share=0.1)
    d = held[0][0].times
    n = next(k for k in range(3, len(d) + 1) if _gain(d[:k], plan2[:k]) <= -_margin(d[:k], plan2[:k]))
    assert len(held[2][0].times) == n == got.dropped[2] and n > 3
    assert log.count(2) == n - 3
    assert len(d) == len(held[1][0].times) > n and got.stop == "budget"


def test_choose_layout_respects_the_budget_share(tmp_path, monkeypatch, capsys):
    """Through :func:`autolayout.choose_layout` with ``budget_share=0.05``: a default at 1 s and a challenger at
    0.97 s (both without spread: the 5% floor is the margin) race until the next round would pass 5% of 600
    default steps; every step's seconds (builds faked at ~0) sum within it, and the next round (with the real
    seconds spent ranking) would not, the table gives each candidate's steps
    and says the budget stopped the race, and the default is kept."""
    from meshtorch.models.transformer import preset
    from meshtorch.runtime import calibrate as cal_mod
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    cal = cal_mod.Calibration(host=cal_mod._host_key(), backend="placement", threads=1, gemm_flop_rate=5e10,
                              kernel_overhead=5e-6, memory_bandwidth=1e10, version=cal_mod.CALIBRATION_VERSION,
                              collectives={k: [1e-5, 1e-10] for k in cal_mod.KINDS})
    path = cal_mod.cache_path("placement", 1)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(cal.__dict__, f)
    steps = []

    def prepare(config, mesh, c, **kw):
        took = []
        steps.append((c, took))
        t = 1.0 if c.default else 0.97 if len(steps) == 2 else 5.0
        return lambda: took.append(t) or t

    monkeypatch.setattr(autolayout, "prepare_candidate", prepare)
    said, t0 = [], time.perf_counter()
    layout = autolayout.choose_layout(
        lambda m: preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                         vocab_size=256, vocab_multiple=m), "data:2,model:2", print_fn=said.append,
        candidates=1, budget_share=0.05)[0]
    real = time.perf_counter() - t0  # ranking and bookkeeping: counted against the budget too
    d, c = np.array(steps[0][1]), np.array(steps[1][1])
    total = sum(sum(t) for _, t in steps)
    assert steps[0][0].default and layout == steps[0][0].layout
    assert len(d) == len(c) > 3 and 0 < _gain(d, c) < _margin(d, c)
    assert total <= 0.05 * 600 * 1.0 < total + real + 1.97
    table = said[-1]
    assert "steps" in table.splitlines()[0] and f"{len(d):>6}  chosen (default)" in table
    assert "would exceed the budget" in table and "default kept" in table
    with pytest.raises(autolayout.UsageError, match="budget share must be > 0"):
        autolayout.choose_layout(lambda m: None, "data:2,model:2", budget_share=0)

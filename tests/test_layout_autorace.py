"""``--layout auto``'s sequential race (issue 36, :func:`meshtorch.runtime.autorace.race`) and its paired rule
(:func:`meshtorch.runtime.autorace.decide`): each interleaved round pairs the challenger's step with the default's;
the default is replaced when the sign test says the challenger is at least 5% faster at 95% (one-sided: the
upper bound of the median paired ratio at most 0.95); the ruled out (significantly not 5% faster) drop out;
undecided candidates race on to the budget. Step times are faked and the expected outcome computed
independently: the sign test's p-value from binomial coefficients, medians and percentiles with NumPy."""

import itertools
import json
import math
import os
import time

import numpy as np
import pytest

from meshtorch.runtime import autolayout
from meshtorch.runtime.autolayout import Candidate
from meshtorch.runtime.autorace import race


def _margin(a, b):
    """The old rule's gain needed (issue 36's first race): max(5%, either one's IQR over its median)."""
    return max(0.05, *((np.percentile(t, 75) - np.percentile(t, 25)) / np.median(t) for t in (a, b)))


def _gain(default, other):
    return 1 - np.median(other) / np.median(default)


def _sign_p(successes, n):
    """One-sided sign-test p-value: P(Binomial(n, 1/2) >= successes)."""
    return sum(math.comb(n, j) for j in range(successes, n + 1)) / 2 ** n


def _better(d, c):
    """Independently: the gain is 5% at 95% confidence: significantly more rounds at least 5% faster than not
    (sign test of the paired ratios against 0.95, p <= 5%)."""
    r = np.asarray(c[:len(d)]) / np.asarray(d[:len(c)])
    return _sign_p(int((r <= 0.95).sum()), len(r)) <= 0.05


def _ruled_out(d, c):
    """Independently: significantly more rounds above 0.95 than below (the gain is not 5%, p <= 12.5%, the
    most 3 rounds allow)."""
    r = np.asarray(c[:len(d)]) / np.asarray(d[:len(c)])
    return _sign_p(int((r > 0.95).sum()), len(r)) <= 0.125


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


LOAD = [1.0, 1.4, 0.8, 1.2, 0.9, 1.3, 0.85]  # a host whose load swings 0.8-1.4 s a step, round by round


def test_race_chooses_a_consistent_gain_the_spread_rule_kept():
    """A challenger 10% faster (ratios 0.88-0.92 in every round) on a host whose load swings each round: the old
    rule (gain beyond the steps' IQR over median) keeps the default, since the spread does not shrink with more
    steps; the paired rule replaces it at the first round where the sign test reaches 95% (5 pairs), found here
    independently; with 3 pairs it cannot, so the race extends (alternating A B / B A)."""
    log = []
    jitter = [0.9, 0.88, 0.92, 0.9, 0.91, 0.89, 0.9]
    held = _held([LOAD, [t * j for t, j in zip(LOAD, jitter, strict=True)]], log)
    got = race(held, 0.0)
    d, c = (np.array(h[0].times) for h in held)
    n = next(k for k in range(1, 30) if _better(d[:k], c[:k]))
    assert got.stop == "replaced" and len(d) == len(c) == n == 3 + got.rounds and got.rounds > 0
    assert log == [0, 1, 1, 0] * (got.rounds // 2) + [0, 1] * (got.rounds % 2)
    assert _gain(d, c) < _margin(d, c)  # the old spread rule would have kept the default
    decision = autolayout.decide([h[0] for h in held])
    assert decision.index == 1 and decision.reason.startswith("default replaced") and "gain >= " in decision.reason


def test_race_extends_a_challenger_faster_in_half_the_rounds_to_the_budget():
    """A challenger 10% faster in half the rounds and 10% slower in the others (its median of an odd count of
    rounds can be 10% faster): never significant either way, it races on until the next round would pass the
    budget (5% of 600 steps of the default's lower-quartile step), and the default is kept; the median alone
    (first 3 rounds: 0.9, 1.1, 0.9) would have replaced it."""
    log = []
    held = _held([[1.0], [0.9, 1.1]], log)
    assert _gain([1.0] * 3, [0.9, 1.1, 0.9]) >= 0.05
    got = race(held, sum(sum(h[0].times) for h in held), share=0.05)
    d, c = (np.array(h[0].times) for h in held)
    assert got.stop == "budget" and got.rounds > 0 and len(d) == len(c) == 3 + got.rounds
    budget = 0.05 * 600 * np.percentile(d, 25)  # the lower quartile of the default's steps
    assert got.budget_s == pytest.approx(budget)
    assert d.sum() + c.sum() <= budget < d.sum() + c.sum() + np.median(d) + np.median(c)
    assert not _better(d, c) and not _ruled_out(d, c)
    decision = autolayout.decide([h[0] for h in held])
    assert decision.index == 0 and decision.reason.startswith("default kept") and decision.undecided


def test_race_drops_a_small_gain_and_a_slower_candidate_for_good():
    """Candidate 1 is 3% faster in every round (below the 5% minimum) and candidate 2 starts close (0.93x) and
    then steps at 2x: each drops out at the first round where it is ruled out (found here independently with the
    sign test on the rounds it had) and takes no step after; with every other dropped the default is kept."""
    log = []
    plan2 = [t * 0.93 for t in LOAD[:3]] + [t * 2 for t in LOAD[3:]] + [1.7] * 100
    held = _held([LOAD, [t * 0.97 for t in LOAD], plan2], log)
    got = race(held, 0.0)
    d = held[0][0].times
    for i in (1, 2):
        t = held[i][0].times
        n = next(k for k in range(3, 40) if _ruled_out(d[:k], t[:k]))
        assert len(t) == n == got.dropped[i] and (n == 3) == (i == 1), i  # 1: at once (never 5% faster)
        assert log.count(i) == n - 3
    assert got.stop == "kept" and autolayout.decide([h[0] for h in held]).index == 0
    assert _gain(d, held[1][0].times) > 0  # faster by the median, but not by 5%


def test_choose_layout_respects_the_budget_share(tmp_path, monkeypatch, capsys):
    """Through :func:`autolayout.choose_layout` with ``budget_share=0.05``: a default at 1 s and a challenger
    faster (0.9 s) and slower (1.1 s) in alternate rounds (never decided) race until the next round would pass 5% of 600
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
        plan = itertools.cycle([1.0] if c.default else [0.9, 1.1] if len(steps) == 2 else [5.0])
        return lambda: took.append(next(plan)) or took[-1]

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
    assert len(d) == len(c) > 3 and not _better(d, c) and not _ruled_out(d, c)
    assert total <= 0.05 * 600 * 1.0 < total + real + 2.1
    table = said[-1]
    assert "steps" in table.splitlines()[0] and f"{len(d):>6}  chosen (default)" in table
    assert "would exceed the budget" in table and "default kept" in table
    with pytest.raises(autolayout.UsageError, match="budget share must be > 0"):
        autolayout.choose_layout(lambda m: None, "data:2,model:2", budget_share=0)


def test_a_median_gain_of_five_percent_within_the_noise_keeps_the_default():
    """The case measured on 4 gloo ranks sharing 2 cores (issue 36): 34 paired rounds whose median ratio is 0.95
    (5.0% faster by the median) but whose ratios scatter 0.85-1.05, so only a smaller gain is significant at 95%;
    another measurement of the same two layouts found the challenger 8% slower. The default stays (the old rule,
    median >= 5% and the upper bound below 1, replaced it); a challenger 10% faster in 30 of 34 rounds replaces
    it. Both outcomes found here independently with the sign test against 0.95."""
    rng = np.random.default_rng(0)
    d = 0.2 * (1 + 0.3 * rng.random(34))
    r = np.concatenate([np.full(17, 0.95), rng.uniform(0.85, 0.949, 8), rng.uniform(0.951, 1.05, 9)])
    rng.shuffle(r)
    assert np.median(r) == pytest.approx(0.95) and _sign_p(int((r < 1).sum()), 34) <= 0.05  # the old rule's case
    held = [Candidate("d", "", None, False, 1.0, 0, default=True, times=tuple(d)),
            Candidate("c", "", None, False, 1.0, 0, times=tuple(d * r))]
    got = autolayout.decide(held)
    assert not _better(d, d * r) and got.index == 0 and got.reason.startswith("default kept")
    r2 = np.where(np.arange(34) < 30, 0.9, 1.02)
    rng.shuffle(r2)
    held[1] = Candidate("c", "", None, False, 1.0, 0, times=tuple(d * r2))
    assert _better(d, d * r2) and autolayout.decide(held).index == 1

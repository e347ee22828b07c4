"""``meshtorch train --layout auto`` (issues 23, 36): the chosen layout is legal, fits --memory-limit per the
planner, is the default layout unless the fastest other measured candidate beats it beyond the noise of the steps
(the default always measured) and is what runs; a second run reads the choice from the cache;
``--trace-collectives`` reports the collectives that ran."""

import itertools
import json
import math
import os
import statistics

import pytest

import meshtorch as mtf
from _fixed_calibration import write_fixed_calibration
from meshtorch.cli import main
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import memory_report
from meshtorch.runtime import calibrate as cal_mod
from meshtorch.runtime.plan_lm import plan_lm

ARGS = ["train", "--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "", "--checkpoint-dir",
        "", "--steps", "2", "--eval-every", "2", "--mesh", "data:2,model:2"]


@pytest.fixture
def calibration(tmp_path, monkeypatch):
    """A cached calibration (fixed numbers, so nothing is measured)."""
    return write_fixed_calibration(tmp_path, monkeypatch)


def _tiny(multiple):
    return preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                  vocab_size=256, vocab_multiple=multiple)


def _total_bytes(layout, storage="", remat=None):
    spec = mtf.MeshSpec("data:2,model:2", layout, storage=storage or None)
    cfg = preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                 vocab_size=256, vocab_multiple=spec.axis_size_for("vocab"), remat=remat or "none")
    lm = build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: spec}, materialize=False)
    return memory_report(lw, [lm.loss] + lm.updates).total_bytes


def _chosen(out):
    """(layout, storage) of the start-up line."""
    line = next(ln for ln in out.splitlines() if ln.startswith("mesh 'data:2,model:2' layout"))
    layout = line.split("layout ")[1].split(" storage")[0].strip("'")
    storage = line.split(" storage ")[1].split(";")[0].strip("'")
    return layout, "" if storage.startswith("(") else storage


def test_layout_auto_picks_a_layout_that_fits_the_limit_and_runs_it(calibration, capsys):
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--trace-collectives"]) == 0
    out = capsys.readouterr().out
    free = _chosen(out)
    assert "--layout auto:" in out and "calibrated placement" in out
    assert "collective time by kind and mesh axes" in out
    # a limit below that layout's planned memory forces another one, which the planner says fits
    limit = _total_bytes(*free) - 1
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--memory-limit", str(limit)]) == 0
    tight = _chosen(capsys.readouterr().out)
    assert tight != free and _total_bytes(*tight) <= limit


def test_layout_auto_refusals(calibration, capsys):
    # data:2: the search that finds nothing under 1 KiB ranks fewer layouts than on data:2,model:2 (1.1 vs 3.7 CPU s)
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--memory-limit", "1KiB", "--mesh", "data:2"]) == 2
    err = capsys.readouterr().err
    assert "--layout auto" in err and "'data:2'" in err and "1.00 KiB" in err, err  # names the mesh and the limit
    assert main(ARGS + ["--storage", "auto", "--threads", "1"]) == 2
    assert "--storage auto needs --layout auto" in capsys.readouterr().err
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--auto-candidates", "-1"]) == 2
    assert "--auto-candidates must be >= 0" in capsys.readouterr().err


def test_layout_auto_with_microbatches_chooses_a_pipeline_when_only_it_fits(calibration, capsys, monkeypatch):
    """``--layout auto --microbatches M`` ranks pipelined layouts too (docs/pipeline.md): under a limit that only
    the pipelined layout meets without recomputation (the planner's ranking without the pipelines needs a
    heavier --remat), train picks ``stage:pipe`` with S x R = --layers and runs it; without a limit a non-pipelined
    choice drops --microbatches instead of failing."""
    from meshtorch.runtime.plan_lm import plan_lm
    argv = ARGS[:ARGS.index("--mesh")] + ["--mesh", "pipe:2", "--layers", "4", "--batch-size", "16", "--threads", "1",
                                          "--layout", "auto", "--microbatches", "8"]

    def config(multiple):
        return preset("tiny", num_layers=4, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=16,
                      vocab_size=256, vocab_multiple=multiple)

    quiet = dict(print_fn=lambda *a: None, cost=calibration.cost_model())
    ranked = plan_lm(config, "pipe:2", search=True, microbatches=8, **quiet)
    limit = int(min(r.total_bytes for _, r in ranked if r.pipeline is not None) * 1.05)
    said = []  # without pipelines nothing fits but with a heavier --remat (FSDP storage rules included)
    plan_lm(config, "pipe:2", search=True, memory_limit=limit, pipelines=False, cost=quiet["cost"],
            print_fn=said.append)
    assert any(line.startswith("no layout fits") and "with --remat none" in line for line in said), said
    assert plan_lm(config, "pipe:2", search=True, microbatches=8, memory_limit=limit, **quiet)[0][0] == "stage:pipe"
    assert main(argv + ["--memory-limit", str(limit)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("mesh 'pipe:2' layout"))
    assert "stage:pipe" in line
    assert main(argv) == 0, capsys.readouterr().err
    # without --microbatches the same limit needs recomputation: train takes the planner's --remat
    from meshtorch.runtime import train as train_mod
    built = []
    monkeypatch.setattr(train_mod, "build_lm", lambda c, *a, **k: built.append(c.remat) or build_lm(c, *a, **k))
    argv = argv[:argv.index("--microbatches")]
    assert main(argv + ["--memory-limit", str(limit)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "fits only with --remat" in out, out
    assert built and set(built) <= {"block", "selective"}, built


class _FakeTimer:
    """Stands in for :func:`autolayout.prepare_candidate`: the timed steps of the i-th prepared candidate take
    ``times[i]`` s (a number: every step; a list: step after step, cycling), ``rest`` s for candidates beyond
    ``times`` (so a test decides which is fastest); every candidate and the seconds of each of its steps
    (``steps[i]``) are recorded."""

    def __init__(self, times, rest=1.0):
        self.times, self.rest, self.calls, self.steps = times, rest, [], []

    def __call__(self, config, mesh_shape, c, **kw):
        self.calls.append(c)
        i = len(self.calls) - 1
        t = self.times[i] if i < len(self.times) else self.rest
        steps, took = itertools.cycle(t if isinstance(t, list) else [t]), []
        self.steps.append(took)
        return lambda: took.append(next(steps)) or took[-1]


def _same_layout(a, b, storage_a="", storage_b=""):
    from meshtorch.planning.search import layout_key
    return layout_key(a, storage_a, {"data": 2, "model": 2}) == layout_key(b, storage_b, {"data": 2, "model": 2})


def test_layout_auto_trains_with_the_fastest_measured_candidate(calibration, capsys, monkeypatch):
    """The challenger is the least median of each candidate's timed steps (as recorded by the fake): here the 3rd
    measured has it, while the least first step (the 4th's), the least single step (the 5th's) and the least mean
    (the 2nd's) point elsewhere; it replaces the default (2 s a step: far slower than the noise), train runs it,
    and the default layout was measured (first) also with --auto-candidates 1."""
    from meshtorch.runtime import autolayout
    from meshtorch.runtime.train_config import DEFAULT_LAYOUT
    steps = [[2.0, 2.0, 2.0], [0.38, 0.38, 0.38], [0.60, 0.35, 0.35], [0.29, 0.45, 0.44], [0.36, 0.10, 0.80]]
    timer = _FakeTimer(steps)
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert len(timer.calls) >= 5, len(timer.calls)
    assert _same_layout(timer.calls[0].layout, DEFAULT_LAYOUT, timer.calls[0].storage)
    assert all(len(t) >= 3 for t in timer.steps[:5])  # the others (1 s) leave after one step (> 3x 0.29 s)
    fastest = timer.calls[min(range(len(timer.calls)), key=lambda i: statistics.median(timer.steps[i]))]
    assert fastest is timer.calls[2]  # and not the least first, single or mean step:
    assert {min(range(5), key=lambda i: f(steps[i])) for f in (lambda s: s[0], min, statistics.mean)} == {1, 3, 4}
    assert _chosen(out) == (fastest.layout, fastest.storage)
    assert "default replaced: " in out and "gain >= " in out and "sign test" in out
    assert "predicted ms" in out and "measured ms" in out and "range ms" in out and "chosen" in out
    timer2 = _FakeTimer([0.3, 0.1])  # with 1 candidate the default layout is measured as well
    monkeypatch.setattr(autolayout, "prepare_candidate", timer2)
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--auto-candidates", "1"]) == 0
    out = capsys.readouterr().out
    assert _same_layout(timer2.calls[0].layout, DEFAULT_LAYOUT, timer2.calls[0].storage)
    assert _chosen(out) == (timer2.calls[1].layout, timer2.calls[1].storage)


def test_layout_auto_races_candidates_within_the_noise_on_for_more_steps(calibration, capsys, monkeypatch):
    """After 3 timed steps the cost model's first (2.9 s, 2.9 s, 2.9 s) looks faster than the default (2.8 s,
    3.0 s, 3.2 s), but their steps overlap: both run more rounds, the first's later steps take 4.0 s, and the
    default, the least median of all recorded steps, is chosen; a candidate clear of the noise runs no more.
    (Faked seconds this long keep the real seconds of ranking on a loaded host a small part of the budget.)"""
    from meshtorch.runtime import autolayout
    timer = _FakeTimer([[2.8, 3.0, 3.2], [2.9, 2.9, 2.9, 4.0, 4.0, 4.0, 4.0]], rest=8.0)
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--auto-candidates", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert len(timer.steps[0]) == len(timer.steps[1]) > 3
    assert all(len(t) == 3 for t in timer.steps[2:]), [len(t) for t in timer.steps]
    fastest = min(range(len(timer.calls)), key=lambda i: statistics.median(timer.steps[i]))
    assert fastest == 0 and _chosen(out) == (timer.calls[0].layout, timer.calls[0].storage)


def _sign_p(successes, n):
    """One-sided sign-test p-value, computed independently: P(Binomial(n, 1/2) >= successes)."""
    return sum(math.comb(n, j) for j in range(successes, n + 1)) / 2 ** n


def test_decide_keeps_the_default_unless_a_candidate_is_significantly_faster_on_paired_rounds():
    """:func:`autolayout.decide` on given step times (step i of each from the same round): the default is replaced
    only when the sign test on the rounds says the least median paired ratio of the others is at least 5% below 1
    at 95% (one-sided p <= 0.05 against 0.95, computed here independently); 3 rounds never suffice (p >= 1/8), ties
    and gains under 5% keep it, whatever the order; without a default the least median wins."""
    from meshtorch.runtime.autolayout import Candidate, decide

    def cand(name, times, default=False):
        return Candidate(name, "", None, False, 1.0, 0, default=default, times=tuple(times))
    tight, fast = [1.0, 1.01, 0.99], [0.70, 0.71, 0.69]  # 30% faster, but 3 rounds: p = 1/8
    assert _sign_p(3, 3) > 0.05
    for order in ([cand("c", fast), cand("d", tight, True)], [cand("d", tight, True), cand("c", fast)]):
        got = decide(order)
        assert order[got.index].default and got.reason.startswith("default kept") and got.undecided
    load = [1.0, 1.4, 0.8, 1.2, 0.9]  # 5 rounds under a swinging load, the challenger 30% faster in each
    assert _sign_p(5, 5) <= 0.05
    got = decide([cand("d", load, True), cand("x", [t * 0.9 for t in load[:4]] + [1.0]),
                  cand("c", [t * 0.7 for t in load])])
    assert got.index == 2 and got.reason.startswith("default replaced") and not got.undecided
    assert "gain >= 30.0% at 95%" in got.reason  # the bound: the least of 5 gains, all 30%
    for ties in ([0.5] * 5, [0.49] * 5):  # a tie, and 2% faster in every round: under the 5% minimum
        got = decide([cand("c", ties), cand("d", [0.5] * 5, True)])
        assert got.index == 1 and "default kept" in got.reason and not got.undecided  # ruled out
    wide = [0.6, 0.9, 1.3, 0.8, 0.85]  # 15% faster by the median ratio, but slower in one of 5 rounds: p = 6/32
    # Precondition on the data, not on meshtorch (as the two _sign_p lines above): it keeps this case "over 5% by
    # the median, not significant" if the numbers are edited; the assertion on decide() follows.
    assert 1 - statistics.median(wide) >= 0.05 and _sign_p(4, 5) > 0.05
    assert decide([cand("d", [1.0] * 5, True), cand("c", wide)]).index == 0
    assert decide([cand("a", [0.5] * 3), cand("b", [0.49] * 3)]).index == 1  # no default measured
    assert decide([cand("d", [1.0] * 3, True), cand("c", [0.2, math.inf, math.inf])]).index == 0  # gave up


def test_layout_auto_keeps_the_default_against_a_gain_within_the_noise(calibration, capsys, monkeypatch):
    """Through train: a candidate 3% faster than the default by the median, the default's steps spreading 10%
    (paired ratios 0.97, 1.08, 0.88 cycling), does not replace it: both race on (the default too) until the
    sign test rules it out (not 5% faster; found here independently), and the table says why the default was
    kept."""
    from meshtorch.runtime import autolayout
    timer = _FakeTimer([[1.0, 0.9, 1.1], 0.97], rest=3.0)
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    d, c = timer.steps[:2]
    r = [b / a for a, b in zip(d, c, strict=True)]
    n = next(k for k in range(3, 99) if _sign_p(sum(x > 0.95 for x in r[:k]), k) <= 0.125)
    assert len(d) == len(c) == n > 3 and "every other candidate dropped out" in out
    assert _chosen(out) == (timer.calls[0].layout, timer.calls[0].storage)
    assert "default kept: " in out and f"sign test, {n} pairs" in out


def test_layout_auto_races_the_default_and_a_challenger_while_undecided(calibration, capsys, monkeypatch):
    """After 3 timed steps the challenger (0.85 s) has the lesser median and is faster than every step of the
    default (0.90, 0.92, 1.20 s), but 3 paired rounds cannot make the sign test significant (p = 1/8 > 0.05): both
    run the extra rounds, the default's later steps take 0.80 s, and the default is kept (the least median of 3
    steps would have taken the challenger)."""
    from meshtorch.runtime import autolayout
    timer = _FakeTimer([[0.90, 0.92, 1.20, 0.80, 0.80, 0.80, 0.80], 0.85], rest=3.0)
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    first3 = [timer.steps[0][:3], timer.steps[1][:3]]
    assert min(first3[0]) > statistics.median(first3[1])
    assert len(timer.steps[0]) == len(timer.steps[1]) > 3
    assert statistics.median(timer.steps[0]) < statistics.median(timer.steps[1])
    assert _chosen(out) == (timer.calls[0].layout, timer.calls[0].storage)


def _band_calibration(cal, spread):
    """Rewrite the fixture's cached calibration with a measured ``spread`` (the trust band)."""
    from dataclasses import replace
    with open(cal_mod.cache_path("placement", 1), "w") as f:
        json.dump(replace(cal, spread={"gemm": spread}).__dict__, f)
    return replace(cal, spread={"gemm": spread}).cost_model()


def test_layout_auto_measures_every_layout_within_the_trust_band(calibration, capsys, monkeypatch):
    """With the calibration's spread at 30%, every layout the planner predicts within 30% of the best prediction
    is measured (predicted independently here by planning each layout), and the best --auto-candidates and the
    default too; none outside those is measured. The fastest measured runs, also when it is the last measured."""
    from meshtorch.runtime import autolayout
    from meshtorch.runtime.train_config import DEFAULT_LAYOUT
    cost = _band_calibration(calibration, 0.3)
    ranked = plan_lm(_tiny, "data:2,model:2", search=True, cost=cost, print_fn=lambda *a: None, pipelines=False)
    pred = {lay: r.estimated_time["total_s"] for lay, r in ranked}
    best = min(pred.values())
    within = {lay for lay, t in pred.items() if t <= 1.3 * best}
    assert 4 <= len(within) < len(pred), (len(within), len(pred))  # the band is what selects here, not k or all
    must = within | {lay for lay, _ in ranked[:3]}
    timer = _FakeTimer([], rest=0.2)
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    seen = [c.layout for c in timer.calls]
    for lay in must:
        assert any(_same_layout(lay, s) for s in seen), (lay, seen)
    for s in seen:
        assert any(_same_layout(s, lay) for lay in must | {DEFAULT_LAYOUT}), (s, must)
    assert "within 30% of the best" in out
    # the last measured is made the fastest: it is still measured, and chosen
    timer = _FakeTimer([0.2] * (len(seen) - 1), rest=0.1)
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--auto-candidates", "2"]) == 0, capsys.readouterr().err
    assert len(timer.calls) == len(seen)
    assert _chosen(capsys.readouterr().out) == (timer.calls[-1].layout, timer.calls[-1].storage)


def test_layout_auto_stops_measuring_when_the_budget_is_spent(calibration, capsys, monkeypatch):
    """The budget is 20% of 600 steps of the default layout (measured first): with the default at 0.2 s a step
    (24 s of measuring) and each of the 20 layouts in the band at 0.45 s a step (1.35 s for 3 timed steps), the
    candidates start while their seconds (and the real seconds spent ranking) fit: the last one started within
    the budget, the next would have exceeded it, the rest are listed as not measured, and the choice is the
    fastest measured (the default)."""
    from meshtorch.runtime import autolayout
    _band_calibration(calibration, 0.6)
    timer, ranking, measure = _FakeTimer([0.2], rest=0.45), [], autolayout._measure
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    monkeypatch.setattr(autolayout, "_measure", lambda *a, **k: ranking.append(k["spent"]) or measure(*a, **k))
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    n, budget, r = len(timer.calls), 0.2 * 600 * 0.2, ranking[0]  # the real seconds ranking took count too
    assert 2 <= n < 20, n
    assert r + 3 * 0.2 + 3 * 0.45 * (n - 2) <= budget < r + 3 * 0.2 + 3 * 0.45 * n + 0.1, (n, r)
    assert f"{20 - n} left unmeasured when the budget was spent" in out and "not measured" in out
    assert _chosen(out) == (timer.calls[0].layout, timer.calls[0].storage)


def test_select_caps_the_predicted_measuring_cost():
    """:func:`autolayout.select` from predictions alone: the default first, then in predicted order the best k
    and those within the band, while (1 + 3) steps of each at its predicted time fit 20% of 600 default steps."""
    from meshtorch.runtime.autolayout import Candidate, select

    def cand(name, t, default=False):
        return Candidate(name, "", None, False, t, 0, default=default)
    # the default's budget: 0.2 * 600 * 1.0 s = 120 s; each 1 s candidate costs (1 + 3) * 1 s = 4 s to measure:
    # the default and 29 of the 40 tied candidates (30 * 4 = 120 s), not a 30th (124 s)
    tied = [cand(f"l{i}", 1.0) for i in range(40)] + [cand("d", 1.0, default=True)]
    got = [c.layout for c in select(tied, 1, band=0.5)]
    assert got == ["d"] + [f"l{i}" for i in range(29)]
    default = cand("d", 1.0, default=True)
    cheap = [cand("a", 0.5), cand("b", 0.6), cand("c", 0.9), cand("e", 5.0), default]
    assert [c.layout for c in select(cheap, 1, band=0.25)] == ["d", "a", "b"]  # 0.9 > 1.25 x 0.5: outside
    assert [c.layout for c in select(cheap, 4, band=0.25)] == ["d", "a", "b", "c", "e"]  # the best 4 always


def test_layout_auto_second_run_uses_the_cache(calibration, capsys, monkeypatch):
    """A second run of the same job reads the choice back and measures nothing; another job measures."""
    from meshtorch.runtime import autolayout
    timer = _FakeTimer([0.3, 0.1, 0.2, 0.4])
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0
    first = _chosen(capsys.readouterr().out)
    assert first == (timer.calls[1].layout, timer.calls[1].storage)
    n = len(timer.calls)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert len(timer.calls) == n and "measured 0 candidates" in out and _chosen(out) == first
    timer.times = timer.times * 2
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--auto-candidates", "2"]) == 0
    assert len(timer.calls) > n  # another job (here: another candidate count) measures again


def test_layout_auto_measures_only_layouts_that_fit_the_limit(calibration, capsys, monkeypatch):
    """Under --memory-limit below the default layout's memory, neither it nor any candidate over the limit is
    measured (the planner's memory report of each measured layout checked independently)."""
    from meshtorch.runtime import autolayout
    from meshtorch.runtime.train_config import DEFAULT_LAYOUT
    timer = _FakeTimer([0.3, 0.2, 0.1, 0.4], rest=0.25)
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    limit = _total_bytes(DEFAULT_LAYOUT) - 1
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--memory-limit", str(limit)]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert timer.calls and "over --memory-limit" in out
    for c in timer.calls:
        assert not _same_layout(c.layout, DEFAULT_LAYOUT, c.storage)
        assert _total_bytes(c.layout, c.storage, c.remat) <= limit, (c.layout, c.storage)
    assert _chosen(out) == (timer.calls[2].layout, timer.calls[2].storage)  # 0.1 s; the others 0.2 s or more


def test_layout_auto_under_torchrun_every_rank_chooses_the_slowest_ranks_fastest(tmp_path):
    """2 gloo ranks measure the same candidates in the same order; rank 0 alone would pick the first, rank 1 the
    second, the slowest rank's medians (max over ranks) make the third fastest: both ranks train with it. The
    second call reads rank 0's cached choice on both ranks and measures nothing."""
    from meshtorch.testing.spmd import run_spmd
    times = [[0.1, 0.5, 0.3, 0.6], [0.9, 0.2, 0.3, 0.6]]
    res = run_spmd("_autolayout_jobs:agree", (str(tmp_path), times), nprocs=2, timeout_s=300,
                   extra_path=[os.path.dirname(os.path.abspath(__file__))]).check().results
    (first0, again0), (first1, again1) = res
    assert first0[1] == first1[1] and len(first0[1]) >= 3  # the same candidates, in the same order
    assert first0[0] == first1[0] == first0[1][2]
    assert again0 == again1 == (first0[0], [])


def test_layout_auto_ranks_decide_on_the_slowest_ranks_steps_alike(tmp_path):
    """2 gloo ranks: on rank 0 alone the challenger is 30% faster in every round (its first 5 rounds would
    replace the default), on rank 1 its first 5 rounds would keep it; the rule and the race run on the slowest
    rank's steps, so both ranks take the same number of steps and decide alike, with the same reason. Two cases
    in one process group: "kept": rank 1's challenger is as fast as the default by the median (0.7, 1.0, 1.1 s
    cycling) and the default stays; "raced": rank 1's challenger is slower in its first 2 rounds, then 0.7 s,
    and the race (more steps than 5, on both ranks alike) ends with the challenger significantly faster."""
    from meshtorch.runtime.autolayout import Candidate, decide
    from meshtorch.testing.spmd import run_spmd
    cases = {"kept": ([[1.0, 0.7], [1.0, [0.7, 1.0, 1.1]]], 0),
             "raced": ([[1.0, 0.7], [1.0, [1.05, 1.05, 0.7] + [0.7] * 20]], 1)}
    res = run_spmd("_autolayout_jobs:decide_alike", (str(tmp_path), [t for t, _ in cases.values()]), nprocs=2,
                   timeout_s=300, extra_path=[os.path.dirname(os.path.abspath(__file__))]).check().results
    for k, (name, (_, chosen)) in enumerate(cases.items()):
        (lay0, calls0, steps0, said0), (lay1, calls1, steps1, said1) = (res[0][k], res[1][k])
        assert calls0 == calls1 and lay0 == lay1 == calls0[chosen], name  # the default: measured first
        assert [len(t) for t in steps0] == [len(t) for t in steps1] and len(steps0[1]) > 5, name
        own = [decide([Candidate(lay, "", None, False, 1.0, 0, default=i == 0, times=tuple(t[:5]))
                       for i, (lay, t) in enumerate(zip(calls, steps, strict=True))]).index
               for calls, steps in ((calls0, steps0), (calls1, steps1))]
        assert own == [1, 0], name  # each rank's own first steps alone would decide differently
        reason = "default kept" if chosen == 0 else "default replaced"
        assert [ln for ln in said0 if reason in ln] == [ln for ln in said1 if reason in ln] != [], name


def test_layout_auto_interleaves_candidates_so_a_load_burst_hits_all_alike(calibration, capsys, monkeypatch):
    """A burst of load slows the first steps run (5x, as many as there are candidates): measured one candidate
    after another, the burst would fall on the first candidate alone and hand the choice to the second; in
    interleaved rounds it falls on round 1 of every candidate, and the intrinsically fastest (the first) still
    wins."""
    from meshtorch.runtime import autolayout
    base, clock, calls = [0.1, 0.15, 0.2, 0.25], [0], []

    def prepare(config, mesh_shape, c, **kw):
        calls.append(c)
        t = base[len(calls) - 1] if len(calls) <= len(base) else 0.3

        def step():
            clock[0] += 1
            return t * (5 if clock[0] <= len(calls) else 1)  # the first round
        return step
    monkeypatch.setattr(autolayout, "prepare_candidate", prepare)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    assert _chosen(capsys.readouterr().out) == (calls[0].layout, calls[0].storage)


def test_layout_auto_under_bf16_ranks_and_measures_in_the_compute_dtype(calibration, capsys, monkeypatch):
    """``--precision bf16``: the candidates are measured under the bf16 policy (bfloat16 compute), the ranking is
    planned under it (plan_lm prices it in the compute dtype, tests/test_cost_model.py), and an fp32 run of the
    same job is another job (it measures again instead of reading the bf16 choice)."""
    import torch

    from meshtorch.ops.precision import PrecisionPolicy
    from meshtorch.runtime import autolayout
    seen, planned = [], []
    monkeypatch.setattr(autolayout, "prepare_candidate",
                        lambda config, mesh, c, **kw: seen.append(kw["precision"]) or (lambda: 0.1))
    plan = autolayout.plan_lm
    monkeypatch.setattr(autolayout, "plan_lm", lambda *a, **k: planned.append(
        PrecisionPolicy.of(k.get("precision")).compute_dtype) or plan(*a, **k))
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--precision", "bf16"]) == 0, capsys.readouterr().err
    assert seen and all(p.compute_dtype == torch.bfloat16 for p in seen)
    assert planned and set(planned) == {torch.bfloat16}
    n = len(seen)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    assert len(seen) > n and all(p.compute_dtype == torch.float32 for p in seen[n:])

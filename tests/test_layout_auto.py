"""``meshtorch train --layout auto`` (issues 23, 36): the chosen layout is legal, fits --memory-limit per the
planner, is the fastest measured of the measured candidates (the default layout always among them) and is what
runs; a second run reads the choice from the cache; ``--trace-collectives`` reports the collectives that ran."""

import json
import os

import pytest

import meshtorch as mtf
from meshtorch.cli import main
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import memory_report
from meshtorch.runtime import calibrate as cal_mod

ARGS = ["train", "--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "", "--checkpoint-dir",
        "", "--steps", "2", "--eval-every", "2", "--mesh", "data:2,model:2"]


@pytest.fixture
def calibration(tmp_path, monkeypatch):
    """A cached calibration (fixed numbers, so nothing is measured)."""
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    cal = cal_mod.Calibration(host=cal_mod._host_key(), backend="placement", threads=1, gemm_flop_rate=5e10,
                              kernel_overhead=5e-6, memory_bandwidth=1e10,
                              collectives={k: [1e-5, 1e-10] for k in cal_mod.KINDS})
    path = cal_mod.cache_path("placement", 1)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(cal.__dict__, f)
    monkeypatch.setattr(cal_mod, "_gemm_rate", lambda *a: (_ for _ in ()).throw(AssertionError("measured")))
    return cal


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
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--memory-limit", "1KiB"]) == 2
    assert "--layout auto" in capsys.readouterr().err
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
    """Stands in for :func:`autolayout.prepare_candidate`: every step of the i-th prepared candidate takes
    ``times[i]`` s (so a test decides which is fastest), and every candidate is recorded."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, config, mesh_shape, c, **kw):
        self.calls.append(c)
        t = self.times[len(self.calls) - 1]
        return lambda: t


def _same_layout(a, b, storage_a="", storage_b=""):
    from meshtorch.planning.search import layout_key
    return layout_key(a, storage_a, {"data": 2, "model": 2}) == layout_key(b, storage_b, {"data": 2, "model": 2})


def test_layout_auto_trains_with_the_fastest_measured_candidate(calibration, capsys, monkeypatch):
    """The cost model's first candidate measures slowest and the third fastest: train runs the third, and the
    default layout was measured too (also when it is not among the best --auto-candidates)."""
    from meshtorch.runtime import autolayout
    from meshtorch.runtime.train_config import DEFAULT_LAYOUT
    timer = _FakeTimer([1.0, 0.5, 0.2, 0.3])
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert len(timer.calls) in (3, 4)  # the best 3, and the default if it is not among them
    assert any(_same_layout(c.layout, DEFAULT_LAYOUT, c.storage) for c in timer.calls)
    fastest = timer.calls[2]
    assert _chosen(out) == (fastest.layout, fastest.storage)
    assert "predicted ms" in out and "chosen" in out
    timer2 = _FakeTimer([0.3, 0.1])  # with 1 candidate the default layout is measured as well
    monkeypatch.setattr(autolayout, "prepare_candidate", timer2)
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--auto-candidates", "1"]) == 0
    out = capsys.readouterr().out
    assert any(_same_layout(c.layout, DEFAULT_LAYOUT, c.storage) for c in timer2.calls)
    if len(timer2.calls) == 2:
        assert _chosen(out) == (timer2.calls[1].layout, timer2.calls[1].storage)


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
    timer = _FakeTimer([0.3, 0.2, 0.1, 0.4])
    monkeypatch.setattr(autolayout, "prepare_candidate", timer)
    limit = _total_bytes(DEFAULT_LAYOUT) - 1
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--memory-limit", str(limit)]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert timer.calls and "over --memory-limit" in out
    for c in timer.calls:
        assert not _same_layout(c.layout, DEFAULT_LAYOUT, c.storage)
        assert _total_bytes(c.layout, c.storage, c.remat) <= limit, (c.layout, c.storage)
    best = min(range(len(timer.calls)), key=lambda i: timer.times[i])
    assert _chosen(out) == (timer.calls[best].layout, timer.calls[best].storage)


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


def test_layout_auto_interleaves_candidates_so_a_load_burst_hits_all_alike(calibration, capsys, monkeypatch):
    """A burst of load slows the first steps run (5x, as many as there are candidates): measured one candidate
    after another, the burst would fall on the first candidate alone and hand the choice to the second; in
    interleaved rounds it falls on round 1 of every candidate, and the intrinsically fastest (the first) still
    wins."""
    from meshtorch.runtime import autolayout
    base, clock, calls = [0.1, 0.15, 0.2, 0.25], [0], []

    def prepare(config, mesh_shape, c, **kw):
        calls.append(c)
        t = base[len(calls) - 1]

        def step():
            clock[0] += 1
            return t * (5 if clock[0] <= len(calls) else 1)  # the first round
        return step
    monkeypatch.setattr(autolayout, "prepare_candidate", prepare)
    assert main(ARGS + ["--layout", "auto", "--threads", "1"]) == 0, capsys.readouterr().err
    assert _chosen(capsys.readouterr().out) == (calls[0].layout, calls[0].storage)


def test_layout_auto_keeps_the_default_unless_every_step_of_a_candidate_beats_it(calibration, capsys, monkeypatch):
    """Noise guard: a candidate whose median beats the default's but which was slower than it in one round does
    not replace the default; one faster in every round does."""
    from meshtorch.runtime import autolayout
    from meshtorch.runtime.train_config import DEFAULT_LAYOUT
    calls = []

    def prepare(config, mesh_shape, c, **kw):
        calls.append(c)
        if _same_layout(c.layout, DEFAULT_LAYOUT, c.storage):
            return lambda: 0.30
        steps = iter([0.2, 0.35, 0.2] if noisy else [0.25, 0.29, 0.25])
        return lambda: next(steps)
    monkeypatch.setattr(autolayout, "prepare_candidate", prepare)
    for noisy, want_default in ((True, True), (False, False)):
        calls.clear()
        argv = ARGS + ["--layout", "auto", "--threads", "1", "--auto-candidates", "2" if noisy else "1"]
        assert main(argv) == 0, capsys.readouterr().err
        chosen = _chosen(capsys.readouterr().out)
        assert _same_layout(chosen[0], DEFAULT_LAYOUT, chosen[1]) == want_default, (noisy, chosen)


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

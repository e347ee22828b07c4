"""Calibration of the cost model (issue 23): measured once per host/backend/threads, then read from the cache;
the placement model sums its processors, the SPMD model takes one processor's share."""

import time

import pytest

import meshtorch as mtf
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import memory_report
from meshtorch.planning.cost import CostModel, estimate_time
from meshtorch.runtime import calibrate as cal_mod


def test_calibration_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    assert cal_mod.cached("placement", 1) is None
    t0 = time.perf_counter()
    first = cal_mod.calibrate("placement", threads=1)
    assert time.perf_counter() - t0 < 60
    assert first.gemm_flop_rate > 1e8 and 0 < first.kernel_overhead < 1e-2 and first.memory_bandwidth > 1e7
    assert set(first.collectives) == set(cal_mod.KINDS)
    assert all(a >= 0 and b > 0 for a, b in first.collectives.values())

    def no_measuring(*a, **k):
        raise AssertionError("measured again although a calibration is cached")

    monkeypatch.setattr(cal_mod, "_gemm_rate", no_measuring)
    monkeypatch.setattr(cal_mod, "_kernel_overhead", no_measuring)
    again = cal_mod.calibrate("placement", threads=1)
    assert again == first
    cost = again.cost_model()
    assert cost.serial and cost.flop_rate == first.gemm_flop_rate and cost.kernel_overhead == first.kernel_overhead
    with pytest.raises(AssertionError, match="measured again"):
        cal_mod.calibrate("placement", threads=1, force=True)
    with pytest.raises(mtf.MeshtorchError, match="backend must be one of"):
        cal_mod.calibrate("mpi")


def _report(mesh, layout):
    cfg = preset("tiny", vocab_size=256)
    lm = build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec(mesh, layout)}, materialize=False)
    return memory_report(lw, [lm.loss] + lm.updates)


def test_placement_replicated_layout_pays_every_processor():
    """train feeds each simulated processor its own batch slice, so even the replicated layout runs every
    processor's kernels (measured: 4 replicas ~4x one processor's step): its serial work is n x one processor's."""
    one, rep = _report("", ""), _report("all:4", "")
    assert rep.flops_serial == 4 * one.flops_per_processor and rep.kernel_calls_serial == 4 * one.kernel_steps


def test_serial_and_parallel_models():
    """Placement (serial): a batch-split layout costs the same einsum FLOPs as one processor and more kernel calls;
    SPMD: each processor does 1/n of the FLOPs. Counted from the plan, checked against the plain definitions."""
    one, split = _report("", ""), _report("all:4", "batch:all")
    assert split.einsum_flops == one.einsum_flops and split.flops_per_processor * 4 == one.flops_per_processor
    assert split.kernel_steps >= one.kernel_steps and split.kernel_calls_serial > split.kernel_steps
    flops_only = CostModel(flop_rate=1e9, bandwidth=1e30, latency=0.0)
    serial = CostModel(flop_rate=1e9, bandwidth=1e30, latency=0.0, serial=True)
    assert estimate_time(split, serial)["compute_s"] == pytest.approx(one.einsum_flops / 1e9)
    assert estimate_time(split, flops_only)["compute_s"] == pytest.approx(one.einsum_flops / 4 / 1e9)
    overhead = CostModel(flop_rate=1e30, bandwidth=1e30, latency=0.0, kernel_overhead=1e-5, serial=True)
    assert estimate_time(split, overhead)["compute_s"] == pytest.approx(split.kernel_calls_serial * 1e-5)
    # every all-reduce group of the mesh runs in turn on a placement mesh: 2 groups of 2 on a 2x2 mesh
    dm = _report("data:2,model:2", "batch:data")
    coll = CostModel(flop_rate=1e30, bandwidth=1e30, latency=1e-3)
    n = sum(dm.counters.records.values())
    assert estimate_time(dm, coll)["comm_s"] == pytest.approx(n * 1e-3)
    assert estimate_time(dm, CostModel(flop_rate=1e30, bandwidth=1e30, latency=1e-3, serial=True))["comm_s"] == \
        pytest.approx(2 * n * 1e-3)


def _fake_measurements(monkeypatch, gemm_rate=1e10):
    """Replace calibrate's measuring functions by constants (the real ones run in
    test_calibration_is_measured_once_then_cached); returns the calls they saw."""
    calls = []
    monkeypatch.setattr(cal_mod, "_gemm_rate", lambda m, k, n, **kw: calls.append("gemm") or gemm_rate)
    monkeypatch.setattr(cal_mod, "_kernel_overhead", lambda: calls.append("kernel") or 2e-5)
    monkeypatch.setattr(cal_mod, "_best_seconds", lambda fn, **k: calls.append("best") or 1e-3)
    monkeypatch.setattr(cal_mod, "_placement_collectives", lambda: {k: [1e-5, 1e-10] for k in cal_mod.KINDS})
    return calls


def test_plan_uses_the_cached_calibration(tmp_path, monkeypatch, capsys):
    """``plan --calibrate`` measures (here: injected constants, the real measuring is tested above; 6 s -> 1 s) and
    prints the calibration; a later ``plan`` uses the cached one without measuring."""
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    from meshtorch.cli import main

    main(["plan", "--preset", "tiny", "--hardware", "cpu"])
    assert "fixed constants" in capsys.readouterr().out
    calls = _fake_measurements(monkeypatch)
    main(["plan", "--preset", "tiny", "--calibrate"])
    out = capsys.readouterr().out
    assert "calibration of" in out and "calibrated placement" in out and "one after another" in out
    assert "gemm" in calls and "kernel" in calls  # --calibrate measured
    monkeypatch.setattr(cal_mod, "_gemm_rate", lambda *a: (_ for _ in ()).throw(AssertionError("measured")))
    main(["plan", "--preset", "tiny"])  # auto: the cached calibration, no measurement
    assert "calibrated placement" in capsys.readouterr().out
    assert main(["plan", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_calibration_takes_medians_of_repetitions_and_says_when_the_host_was_busy(tmp_path, monkeypatch):
    """Each compute constant is the median of REPEATS repetitions; their spread (max - min) / median is stated,
    and a spread over BUSY_SPREAD or a load above the cores marks the calibration busy (its summary and the cost
    model's name say so). The measured values are injected, so the expected medians are known."""
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    overheads = iter([1e-5, 4e-5, 2e-5])
    monkeypatch.setattr(cal_mod, "_gemm_rate", lambda m, k, n, **kw: 1e10)
    monkeypatch.setattr(cal_mod, "_kernel_overhead", lambda: next(overheads))
    monkeypatch.setattr(cal_mod, "_best_seconds", lambda fn, **k: 1e-3)
    monkeypatch.setattr(cal_mod, "_placement_collectives", lambda: {k: [1e-5, 1e-10] for k in cal_mod.KINDS})
    monkeypatch.setattr(cal_mod.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    cal = cal_mod.calibrate("placement", threads=1)
    assert cal.kernel_overhead == pytest.approx(2e-5) and cal.gemm_flop_rate == pytest.approx(1e10)
    assert cal.spread["kernel"] == pytest.approx((4e-5 - 1e-5) / 2e-5) and cal.spread["gemm"] == 0
    assert cal.busy and "host busy" in cal.summary() and "spread 150%" in cal.cost_model().name
    overheads = iter([2e-5] * 3)  # steady numbers on a quiet host: not busy; a loaded host: busy
    cal = cal_mod.calibrate("placement", threads=1, force=True)
    assert not cal.busy and cal.spread["kernel"] == 0 and "busy" not in cal.summary()
    overheads = iter([2e-5] * 3)
    monkeypatch.setattr(cal_mod.os, "getloadavg", lambda: (float(cal_mod.os.cpu_count() + 1), 0.0, 0.0))
    assert cal_mod.calibrate("placement", threads=1, force=True).busy

"""The cost model of more gloo processes than cores (issue 36): 4 ranks on a 2-core host time-share the cores, so
each rank's compute (FLOPs, kernel calls, elementwise bytes) takes twice what the calibration measured with 2
processes side by side, and the collectives keep their measured constants. Checked against the planner's own
counts of the step (FLOPs, kernel calls, bytes) priced by hand."""

from __future__ import annotations

import pytest

import meshtorch as mtf
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import memory_report
from meshtorch.planning.cost import CostModel, estimate_time
from meshtorch.runtime import calibrate as cal_mod


def _calibration(backend):
    return cal_mod.Calibration(host="h", backend=backend, threads=1, gemm_flop_rate=5e10, kernel_overhead=5e-6,
                               memory_bandwidth=1e10, collectives={k: [1e-4, 1e-9] for k in cal_mod.KINDS},
                               version=cal_mod.CALIBRATION_VERSION)


def test_more_ranks_than_cores_double_the_compute_not_the_collectives(monkeypatch):
    monkeypatch.setattr(cal_mod, "usable_cores", lambda: 2)
    cal = _calibration("gloo")
    base, two, four = cal.cost_model(), cal.cost_model(processes=2), cal.cost_model(processes=4)
    assert two == base  # 2 ranks on 2 cores: as measured
    assert (four.flop_rate, four.memory_bandwidth, four.kernel_overhead) == pytest.approx(
        (2.5e10, 5e9, 1e-5), rel=1e-12)
    assert four.collectives == base.collectives and four.latency == base.latency
    assert _calibration("placement").cost_model(processes=4) == _calibration("placement").cost_model()
    cfg = preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                 vocab_size=256, vocab_multiple=2)
    lm = build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec("data:2,model:2", "batch:data;heads:model;d_ff:model")},
                      materialize=False)
    rep = memory_report(lw, [lm.loss] + lm.updates)
    t2, t4 = estimate_time(rep, two), estimate_time(rep, four)
    assert t4["comm_s"] == pytest.approx(t2["comm_s"], rel=1e-12) and t2["comm_s"] > 0
    assert t4["compute_s"] == pytest.approx(2 * t2["compute_s"], rel=1e-12) and t2["compute_s"] > 0


def test_sharing_cores_with_threads_and_more_cores():
    c = CostModel(flop_rate=1e10, memory_bandwidth=1e9, kernel_overhead=1e-6, flop_rates=(("bfloat16", 1e9),))
    assert c.sharing_cores(4, 8) is c  # enough cores
    assert c.sharing_cores(6, 2, measured_with=2).flop_rate == pytest.approx(1e10 / 3)
    assert dict(c.sharing_cores(8, 2, measured_with=4).flop_rates)["bfloat16"] == pytest.approx(1e9 / 2)

"""Planning under storage rules (issue 12): memory per processor of parameters, gradients and optimizer
state, all-gathers and reduce-scatters in the cost model, storage rules in the layout search, and the
memory budget that fails an over-budget configuration before training."""

from __future__ import annotations

import math

import pytest

import meshtorch as mtf
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import (
    CostModel,
    MemoryLimitError,
    check_memory_limit,
    estimate_time,
    plan_memory,
    search_layouts,
    storage_candidates,
)
from meshtorch.runtime.plan_lm import plan_lm

CFG = preset("tiny", vocab_size=64, d_model=32, num_heads=4, d_kv=8, d_ff=64, num_layers=1, length=16,
             batch_size=8)


def _lm():
    return build_lm(CFG, optimizer=mtf.optim.AdamWOptimizer(1e-3))


def _report(mesh_shape, layout, storage):
    lm = _lm()
    return plan_memory(lm.graph, lm.mesh, [lm.loss] + lm.updates, mesh_shape, layout, storage), lm


def test_memory_report_breaks_down_parameters_gradients_and_optimizer_state():
    dp, lm = _report("data:4", "batch:data", "")
    fsdp, _ = _report("data:4", "batch:data", "d_model:data")
    full = sum(v.outputs[0].shape.size * 4 for v in lm.graph.trainable_variables)  # float32 parameters
    step = 8  # the int64 global_step
    assert (dp.parameter_bytes, dp.gradient_bytes, dp.optimizer_state_bytes) == (full, full, 2 * full + step)
    # FSDP: every weight has d_model, so each processor stores a quarter of everything
    assert (fsdp.parameter_bytes, fsdp.gradient_bytes, fsdp.optimizer_state_bytes) == (
        full // 4, full // 4, 2 * full // 4 + step)
    assert fsdp.model_state_bytes <= 0.30 * dp.model_state_bytes
    assert fsdp.total_bytes < dp.total_bytes
    assert fsdp.storage == "d_model:data"
    assert "gradients" in fsdp.summary() and "storage 'd_model:data'" in fsdp.summary()
    # no update fetched: no gradients
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("data:4", "batch:data")}, materialize=False)
    assert mtf.memory_report(lw, lm.loss).gradient_bytes == 0


def test_cost_model_counts_all_gathers_and_reduce_scatters():
    fsdp, _ = _report("data:4", "batch:data", "d_model:data")
    cost = CostModel(flop_rate=1e12, bandwidth=1e9, latency=1e-5)
    wire = {"allgather": 3, "reduce_scatter": 0.75, "allreduce": 1.5}  # ring algorithm, group of 4
    by_kind = {}
    for c, n in fsdp.counters.records.items():
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + n * (1e-5 + wire[c.kind] * c.bytes_per_processor / 1e9)
    assert by_kind["allgather"] > 0 and by_kind["reduce_scatter"] > 0
    assert estimate_time(fsdp, cost)["comm_s"] == pytest.approx(sum(by_kind.values()))


def test_storage_candidates_start_with_d_model():
    lm = _lm()
    cands = storage_candidates(lm.graph, "data:2,model:2", "batch:data;heads:model")
    assert cands[:2] == ["d_model:data", "d_model:model"]
    assert "heads:model" not in cands and "heads:data" in cands
    assert all(len(c.split(":")) == 2 for c in cands)


def test_search_finds_storage_rules_under_a_memory_limit():
    fsdp, _ = _report("data:4", "batch:data", "d_model:data")
    dp, _ = _report("data:4", "batch:data", "")
    limit = fsdp.total_bytes
    assert dp.total_bytes > limit
    ranked = search_layouts(_lm, "data:4", candidate_rules=["batch:data", ""], memory_limit_bytes=limit,
                            storage_rules="auto")
    assert all(r.total_bytes <= limit for _, r in ranked)
    assert ("batch:data", "d_model:data") in [(lay, r.storage) for lay, r in ranked]
    assert ("batch:data", "") not in [(lay, r.storage) for lay, r in ranked]
    # without storage rules in the search nothing fits
    with pytest.raises(ValueError, match="fits"):
        search_layouts(_lm, "data:4", candidate_rules=["batch:data", ""], memory_limit_bytes=limit)


def test_over_budget_configuration_fails_before_training_naming_a_storage_rule_that_fits():
    lm = _lm()
    fetches = [lm.loss] + lm.updates
    dp = plan_memory(lm.graph, lm.mesh, fetches, "data:4", "batch:data")
    fsdp = plan_memory(lm.graph, lm.mesh, fetches, "data:4", "batch:data", "d_model:data")
    limit = (dp.total_bytes + fsdp.total_bytes) // 2
    with pytest.raises(MemoryLimitError) as info:
        check_memory_limit(lm.graph, lm.mesh, fetches, "data:4", "batch:data", memory_limit=limit)
    msg = str(info.value)
    assert f"{limit} bytes" in msg and f"{dp.total_bytes} bytes" in msg
    rule = info.value.suggestion[0]
    assert f"Storage rule {rule!r} would fit" in msg
    assert plan_memory(lm.graph, lm.mesh, fetches, "data:4", "batch:data", rule).total_bytes <= limit
    # the FSDP configuration passes the same check
    rep = check_memory_limit(lm.graph, lm.mesh, fetches, "data:4", "batch:data", "d_model:data", limit)
    assert rep.total_bytes == fsdp.total_bytes
    # a limit nothing fits: no suggestion, and the message says so
    with pytest.raises(MemoryLimitError, match="No single storage rule fits") as info:
        check_memory_limit(lm.graph, lm.mesh, fetches, "data:4", "batch:data", memory_limit=1000)
    assert info.value.suggestion is None
    # a suggestion adds to the storage rules given, never placing one dimension twice
    with pytest.raises(MemoryLimitError) as info:
        check_memory_limit(lm.graph, lm.mesh, fetches, "data:4", "batch:data", "d_model:data", 1000)
    assert "d_model:data;d_model" not in str(info.value)


def test_plan_lm_takes_storage_and_memory_limit():
    lines = []
    (lay, rep), = plan_lm(CFG, "data:4", "batch:data", storage="d_model:data", print_fn=lines.append)
    assert rep.storage == "d_model:data" and any("storage 'd_model:data'" in ln for ln in lines)
    lines.clear()
    plan_lm(CFG, "data:4", "batch:data", memory_limit=rep.total_bytes, print_fn=lines.append)
    assert any(ln.startswith("over the memory limit") and "fits with" in ln and "--storage 'd_model:data'" in ln
               for ln in lines), lines
    lines.clear()
    ranked = plan_lm(CFG, "data:4", search=True, memory_limit=rep.total_bytes, print_fn=lines.append)
    assert ranked and all(r.total_bytes <= rep.total_bytes for _, r in ranked)
    assert math.isfinite(ranked[0][1].estimated_time["total_s"])

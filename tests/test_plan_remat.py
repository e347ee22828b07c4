"""``meshtorch plan --memory-limit`` picks ``--remat`` (and storage rules) when the limit requires it: the
choice is checked against the memory reports of every policy planned one by one."""

from dataclasses import replace

import pytest

from meshtorch.models.transformer import REMAT_POLICIES, build_lm, preset
from meshtorch.optim.adam import AdamWOptimizer
from meshtorch.planning import CostModel
from meshtorch.planning.budget import MemoryLimitError, fit_memory_limit, plan_memory
from meshtorch.runtime.plan_lm import plan_lm

CFG = preset("tiny", num_layers=3, length=64, batch_size=16)
COST = CostModel.cpu()


def _build(remat):
    lm = build_lm(replace(CFG, remat=remat), optimizer=AdamWOptimizer(1e-3))
    return lm.graph, lm.mesh, [lm.loss] + lm.updates


def _reports(mesh, layout="", storage=""):
    return {r: plan_memory(*_build(r), mesh, layout, storage, COST) for r in REMAT_POLICIES}


def test_one_processor_limit_between_policies_picks_remat():
    reps = _reports("")
    assert reps["block"].total_bytes < reps["none"].total_bytes  # else the test could not fail
    limit = (reps["block"].total_bytes + reps["none"].total_bytes) // 2
    fitting = [r for r in REMAT_POLICIES if reps[r].total_bytes <= limit]
    want = min(fitting, key=lambda r: (reps[r].estimated_time["total_s"], reps[r].total_bytes))
    assert want != "none"
    for options in (["none", "selective", "block"], ["none", "block", "selective"]):  # the order does not matter
        remat, storage, rep = fit_memory_limit(_build, options, "", "", "", limit, COST)
        assert (remat, storage, rep.total_bytes) == (want, "", reps[want].total_bytes)
    lines = []
    plan_lm(CFG, "", "", memory_limit=limit, cost=COST, print_fn=lines.append)
    assert any(f"fits with --remat {want}" in line for line in lines), lines


def test_no_remat_when_the_limit_is_met_and_error_when_nothing_fits():
    reps = _reports("")
    remat, _, rep = fit_memory_limit(_build, list(REMAT_POLICIES), "", "", "", reps["none"].total_bytes, COST)
    assert remat == "none" and rep.total_bytes == reps["none"].total_bytes
    smallest = min(r.total_bytes for r in reps.values())
    with pytest.raises(MemoryLimitError, match="none fits"):
        fit_memory_limit(_build, list(REMAT_POLICIES), "", "", "", smallest - 1, COST)


def test_two_processors_fastest_of_remat_and_storage():
    """On data:2 a storage rule (FSDP) competes with recomputation: the fastest configuration that fits wins."""
    plain = _reports("data:2", "batch:data")
    sharded = _reports("data:2", "batch:data", "d_model:data")
    limit = max(min(r.total_bytes for r in sharded.values()), min(r.total_bytes for r in plain.values()))
    limit = min(limit, plain["none"].total_bytes - 1)
    cands = [(r, "", plain[r]) for r in REMAT_POLICIES] + [(r, "d_model:data", sharded[r]) for r in REMAT_POLICIES]
    fitting = [c for c in cands if c[2].total_bytes <= limit]
    assert fitting
    remat, storage, rep = fit_memory_limit(_build, list(REMAT_POLICIES), "data:2", "batch:data", "", limit, COST)
    best_t = min(c[2].estimated_time["total_s"] for c in fitting)
    assert rep.total_bytes <= limit
    assert rep.estimated_time["total_s"] == pytest.approx(best_t, rel=1e-9), (remat, storage)

"""``meshtorch plan --backend gloo`` plans what gloo ranks run (issue 33): the report of the SPMD schedule
(one process per processor, in-place updates, the SPMD mesh's default gradient buckets), equal to the report a
default ``Lowering`` on ``SpmdMeshImpl`` makes of itself inside 2 gloo ranks."""

import os

import meshtorch as mtf
from _plan_backend_jobs import SHAPE
from meshtorch.lowering.stages import plan
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import plan_memory
from meshtorch.planning.memory import memory_report
from meshtorch.runtime.plan_command import backend_options
from meshtorch.testing.spmd import run_spmd

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_gloo_plan_is_the_report_of_the_lowering_gloo_ranks_run():
    ranks = run_spmd("_plan_backend_jobs:worker", nprocs=2, timeout_s=300, extra_path=[TESTS]).check().results
    assert ranks[0] == ranks[1]
    lm = build_lm(preset("tiny", **SHAPE), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    fetches = [lm.loss] + lm.updates
    rep = plan_memory(lm.graph, lm.mesh, fetches, "data:2", "batch:data", "d_model:data",
                      options=backend_options("gloo"))
    assert (rep.total_bytes, rep.peak_activation_bytes, rep.peak_step[1]) == (
        ranks[0]["total"], ranks[0]["peak"], ranks[0]["peak_op"])
    assert "reduce_scatter_bucket" in ranks[0]["kinds"]  # the ranks' buckets, planned here too
    assert backend_options("placement") is None
    placement = memory_report(plan(lm.graph, fetches, {lm.mesh: mtf.MeshSpec("data:2", "batch:data",
                                                                               storage="d_model:data")}))
    assert placement.peak_activation_bytes != rep.peak_activation_bytes  # no buckets: another schedule

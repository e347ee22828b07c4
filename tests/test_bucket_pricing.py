"""The cost model prices the collective calls the executor makes (issue 36): on an SPMD mesh a data-parallel
step's gradient sums go out in buckets (``meshtorch.lowering.schedule.bucket_reductions``), so the latency is
charged per bucket call, not per gradient; the placement mesh makes no buckets, one call per collective.

The reference is independent of the planner: the process-group calls the flight recorder saw in 2 gloo ranks
(and, for placement, in the placement mesh's primitives) during one training step."""

import os

import pytest

import meshtorch as mtf
from _plan_backend_jobs import BUCKET_LAYOUTS, SHAPE, recorded_calls
from meshtorch.lowering.stages import plan
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning.cost import CostModel, estimate_time, priced_calls
from meshtorch.planning.memory import memory_report
from meshtorch.runtime.plan_lm import backend_options
from meshtorch.testing.spmd import run_spmd

TESTS = os.path.dirname(os.path.abspath(__file__))
LATENCY = 1e-3
# latency alone: FLOPs, bytes and kernel calls cost (next to) nothing, so comm_s is the calls times the latency
LATENCY_ONLY = CostModel(flop_rate=1e30, bandwidth=1e30, latency=LATENCY)


def _report(rules: str, backend: str, mesh: str = "all:2"):
    lm = build_lm(preset("tiny", **SHAPE), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    return memory_report(plan(lm.graph, [lm.loss] + lm.updates, mtf.MeshSpec(mesh, rules), backend_options(backend)))


def test_gloo_latency_is_charged_per_call_the_ranks_make():
    ranks = run_spmd("_plan_backend_jobs:spmd_calls", nprocs=2, timeout_s=300, extra_path=[TESTS]).check().results
    assert ranks[0] == ranks[1]
    for rules in BUCKET_LAYOUTS:
        rep = _report(rules, "gloo")
        assert sum(priced_calls(rep).values()) == ranks[0][rules], rules
        assert estimate_time(rep, LATENCY_ONLY)["comm_s"] == pytest.approx(ranks[0][rules] * LATENCY, rel=1e-6)
    # the data-parallel layout sums every gradient in a few buckets: far fewer calls than planned gradient sums
    assert ranks[0]["batch:all"] < _report("batch:all", "gloo").counters.count()


def test_placement_latency_is_charged_per_collective_it_runs():
    calls = recorded_calls(mtf.PlacementMeshImpl)
    for rules in BUCKET_LAYOUTS:
        rep = _report(rules, "placement")
        assert sum(priced_calls(rep).values()) == calls[rules] == rep.counters.count(), rules
        assert estimate_time(rep, LATENCY_ONLY)["comm_s"] == pytest.approx(calls[rules] * LATENCY, rel=1e-6)


def test_planned_buckets_follow_the_lowering_default_rule():
    """The planned schedule takes a default Lowering's buckets (``default_buckets``): DDP's 25 MiB and 1 MiB first
    bucket, and none when gradients are summed in bfloat16 (then every gradient sum is its own call)."""
    from meshtorch.ops.precision import PrecisionPolicy
    from meshtorch.runtime.plan_lm import training_lm

    for policy, buckets in ((None, (25 * 2 ** 20, 2 ** 20)), (PrecisionPolicy.named("bf16", "bfloat16"), (0, 0))):
        lm = training_lm(preset("tiny", **SHAPE), precision=policy)
        program = plan(lm.graph, [lm.loss] + lm.updates, mtf.MeshSpec("all:2", "batch:all"), backend_options("gloo"))
        assert (program.options.bucket_bytes, program.options.first_bucket_bytes) == buckets
        rep = memory_report(program)
        assert (sum(priced_calls(rep).values()) < rep.counters.count()) == bool(buckets[0])

"""The flight recorder (issue 22): the collectives a mesh implementation executes, against the plan.

``lowering.counters`` are the collectives the mesh implementation recorded executing (its flight
recorder, :mod:`meshtorch.mesh.recorder`), ``plan_counters`` those the planner decided from shapes and
layout rules: two independent accounts, which must agree call for call on the placement mesh (1-D and
2-D) and on 4 gloo ranks, for data parallel, tensor parallel and FSDP storage with buckets and prefetch.
The mutation tests replace a backend's reduce-scatter by an all-reduce plus a local slice (the same
numbers, n times the bytes), or the SPMD strategy's process-group call one layer down (where the SPMD
mesh records): the losses do not change, and the comparison must fail.
"""

from __future__ import annotations

import os

import pytest
import torch

import meshtorch as mtf
from _recorder_jobs import CASES, RUNS, allreduce_then_slice, allreduce_then_slice_many, run_case
from meshtorch.lowering.collectives import KINDS
from meshtorch.mesh.recorder import FlightRecorder, collective_report, flight_recorder
from meshtorch.testing.collectives import assert_executed_as_planned, executed_vs_planned
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PLACEMENT = ["dp", "dp_buckets", "tp", "fsdp", "fsdp_buckets_prefetch", "fsdp_tp_buckets_prefetch2"]


def _placement(mesh_shape, rules, storage, prefetch):
    return mtf.PlacementMeshImpl(mesh_shape, rules, storage=storage, prefetch=prefetch)


@pytest.mark.parametrize("name", PLACEMENT)
def test_placement_executes_the_planned_collectives(name):
    got = run_case(name, _placement)
    assert got["diff"] == [], "\n".join(got["diff"])
    assert got["executed"] == got["planned"] > 0
    assert got["timed"] and got["sources"] == ["backend"] and got["ranks"] == [0]
    if CASES[name][4]:  # buckets: fewer calls than collectives, the same counters
        assert 0 < got["bucket_calls"] and got["calls"] < got["planned"], got
    else:
        assert got["bucket_calls"] == 0 and got["calls"] == got["planned"], got
    if CASES[name][3]:  # storage rules: weights gathered, gradients reduce-scattered
        assert {"allgather", "reduce_scatter"} <= set(got["kinds"]), got["kinds"]


@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp_buckets_prefetch2"])
def test_mutation_reduce_scatter_as_allreduce_is_caught_on_placement(name, monkeypatch):
    want = run_case(name, _placement)
    monkeypatch.setattr(mtf.PlacementMeshImpl, "reduce_scatter", allreduce_then_slice)
    if CASES[name][4]:  # buckets call reduce_scatter_many: mutate it the same way
        monkeypatch.setattr(mtf.PlacementMeshImpl, "reduce_scatter_many", allreduce_then_slice_many)
    got = run_case(name, _placement)
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0)  # the numbers cannot tell
    assert got["diff"], "the mutated backend passed the executed-vs-planned comparison"
    assert any(line.startswith("reduce_scatter over data") and line.endswith("executed 0") for line in got["diff"])
    assert any(line.startswith("allreduce[sum] over data") and "planned 0" in line for line in got["diff"])
    assert "reduce_scatter" not in got["kinds"]


def test_assert_helper_fails_on_mutation_and_passes_otherwise(monkeypatch):
    from _program_data import batch, mlp_step
    g, mesh, x, _, loss, _, updates = mlp_step()
    impl = mtf.PlacementMeshImpl("rows:2;cols:2", "batch:rows;hidden:cols", storage="io:rows")
    assert_executed_as_planned(mtf.Lowering(g, {mesh: impl}), [loss] + updates, lambda s: {x: batch(s)}, runs=2)
    monkeypatch.setattr(mtf.PlacementMeshImpl, "reduce_scatter", allreduce_then_slice)
    lw = mtf.Lowering(g, {mesh: impl})  # a new session: plans bind the (mutated) methods
    with pytest.raises(AssertionError, match=r"reduce_scatter over rows.*planned 2, executed 0"):
        assert_executed_as_planned(lw, [loss] + updates, lambda s: {x: batch(s)}, runs=2)


def test_recorder_off_counts_nothing_and_planned_counters_stay():
    from _program_data import batch, mlp_step
    g, mesh, x, _, loss, _, updates = mlp_step()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")})
    rec = flight_recorder()
    rec.enabled = False
    try:
        diff, _ = executed_vs_planned(lw, [loss] + updates, {x: batch(0)})
        with pytest.raises(AssertionError, match="differ from the plan"):
            assert_executed_as_planned(lw, [loss] + updates, {x: batch(0)})
    finally:
        rec.enabled = True
    assert lw.counters.count() == 0 and lw.plan_counters([loss] + updates).count("allreduce") > 0
    assert diff and all("executed 0" in line for line in diff)
    local = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})  # one processor: nothing to compare
    with pytest.raises(AssertionError, match="no collectives were executed"):
        assert_executed_as_planned(local, [loss] + updates, {x: batch(0)})


def test_ring_buffer_dump_and_report():
    rec = FlightRecorder(capacity=3)
    for i in range(5):
        r = rec.record("allreduce" if i % 2 else "allgather", ("data",), (4 * (i + 1),), torch.float32, "", 4, 1)
        if i < 4:
            r.seconds = 0.001 * (i + 1)
    recs = rec.records()
    assert [r.seq for r in recs] == [2, 3, 4] and rec.records(last=1)[0].seq == 4
    dump = rec.dump(2)
    assert "last 2 of 5" in dump and "#4 rank 1 allgather over data 20 B float32 not finished" in dump
    assert "#3 rank 1 allreduce over data 16 B float32 4.000 ms" in dump
    report = collective_report(recs, top=2)
    lines = report.splitlines()
    # rows sorted by total time: allreduce (#3: 4 ms) before allgather (#2: 3 ms, #4 untimed)
    assert lines[2].split()[:4] == ["allreduce", "data", "1", "16"] and "4.000" in lines[2]
    assert lines[3].split()[:4] == ["allgather", "data", "2", "32"] and "3.000" in lines[3]
    assert "slowest 2" in report and report.index("#3") < report.index("#2")
    with pytest.raises(ValueError, match="capacity"):
        FlightRecorder(capacity=0)


@pytest.fixture(scope="module")
def gloo(once_per_run):
    names = ["dp", "dp_buckets", "tp", "fsdp", "fsdp_buckets_prefetch", "fsdp_tp_buckets_prefetch2",
             "fsdp_tp_compiled"]
    return names, once_per_run("test_flight_recorder_gloo", lambda: run_spmd(
        "_recorder_jobs:spmd_worker", args=(names,), nprocs=4, timeout_s=600, extra_path=[TESTS_DIR]).check().results)


def test_gloo_ranks_execute_the_planned_collectives(gloo):
    names, results = gloo
    placement = {name: run_case(name, _placement) for name in names if name in PLACEMENT}
    for rank, res in enumerate(results):
        for name in names:
            got = res[name]
            assert got["diff"] == [], (rank, name, got["diff"])
            assert got["executed"] == got["planned"] > 0, (rank, name)
            assert got["ranks"] == [rank]
            if name == "fsdp_tp_compiled":  # counted from the plan: documented, untimed, and the summary says so
                assert got["sources"] == ["plan"] and got["runs_from_plan"] == RUNS, got
                assert f"over {RUNS} run(s) ({RUNS} compiled, counted from their plan):" in got["summary"]
                continue
            assert got["runs_from_plan"] == 0
            assert got["sources"] == ["backend"] and got["timed"], (rank, name)
            if CASES[name][4]:
                assert 0 < got["bucket_calls"] and got["calls"] < got["planned"], (rank, name, got)
            if name in placement:
                torch.testing.assert_close(got["losses"], placement[name]["losses"], rtol=1e-5, atol=0)
                assert got["kinds"] == placement[name]["kinds"]


def test_gloo_primitives_record_their_declared_kind(gloo):
    _, results = gloo
    want = {kind: (kind, ("all",), (8 * 4 * 4,), True) for kind in KINDS}
    for res in results:
        assert res["primitives"] == want


def test_mutation_reduce_scatter_as_allreduce_is_caught_on_gloo():
    job = run_spmd("_recorder_jobs:spmd_worker", args=(["fsdp"], True), nprocs=4, timeout_s=300,
                   extra_path=[TESTS_DIR]).check()
    want = run_case("fsdp", _placement)
    for res in job.results:
        got = res["fsdp"]
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0)
        assert any(line.startswith("reduce_scatter over data") and line.endswith("executed 0") for line in got["diff"])
        assert "reduce_scatter" not in got["kinds"]



def test_mutation_in_the_spmd_strategy_is_caught_on_gloo():
    """The substitution one layer down: ``EagerCollectives.reduce_scatter`` as an all-reduce plus a slice, or as
    the right ``torch.distributed`` call made past the recorder; the SPMD mesh method is unchanged."""
    job = run_spmd("_recorder_jobs:strategy_mutation_worker", nprocs=2, timeout_s=300,
                   extra_path=[TESTS_DIR]).check()
    for res in job.results:
        plain, summed, unrecorded = res["plain"], res["allreduce"], res["unrecorded"]
        assert plain["diff"] == [] and "reduce_scatter" in plain["kinds"], plain["diff"]
        for got in (summed, unrecorded):  # the numbers cannot tell
            torch.testing.assert_close(got["losses"], plain["losses"], rtol=1e-6, atol=0)
            assert any(line.startswith("reduce_scatter over rows") and line.endswith("executed 0")
                       for line in got["diff"]), got["diff"]
            assert "reduce_scatter" not in got["kinds"]
        assert any(line.startswith("allreduce[sum] over rows") and "planned 0" in line for line in summed["diff"])
        assert unrecorded["executed"] < unrecorded["planned"]

"""SpmdMeshImpl: the op suite, variables, local feeds and failure behaviour in 4 gloo processes.

One 4-process job (started once per module) runs every ``OP_CASES`` entry of every
``tests/test_ops_*.py`` on ``all:4`` and ``rows:2;cols:2`` and compares values and gradients with
PlacementMeshImpl (<= 1e-6 relative) and the unsplit PyTorch reference; the same job returns the
local variable slices and the local-feed training results, which this process compares with
PlacementMeshImpl runs. Separate short jobs check that a failing rank brings the whole job down.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import meshtorch as mtf
import spmd_helper as H
from meshtorch.data.sharding import batch_slice, local_batch_indices, local_feed
from meshtorch.testing import rel_error
from meshtorch.testing.spmd import SRC_DIR, run_spmd, spmd_layouts

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
OP_MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(TESTS_DIR, "test_ops_*.py")))
ALL_CASES = [(m, c) for m in OP_MODULES for c in getattr(importlib.import_module(m), "OP_CASES", [])]
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def job(once_per_run):
    """The one 4-process job (once per test run): (op suite report, initial values, feed results, wall seconds)."""
    return once_per_run("test_spmd_job", _job)


def _job():
    tasks = [("meshtorch.testing.spmd:op_suite_worker", (OP_MODULES,)),
             ("spmd_helper:init_values_worker", ()),
             ("spmd_helper:feeds_worker", ()),
             ("spmd_helper:async_worker", ()),
             ("spmd_helper:primitives_worker", ()),
             ("spmd_helper:leader_barrier_worker", ())]
    t0 = time.monotonic()
    run = run_spmd("meshtorch.testing.spmd:run_tasks", args=(tasks,), nprocs=4, timeout_s=JOB_TIMEOUT_S,
                   extra_path=[TESTS_DIR]).check()
    print(f"\nSPMD job: 4 processes, {len(ALL_CASES)} op cases, {time.monotonic() - t0:.1f} s wall")
    return run.results


def test_op_modules_found():
    assert "test_ops_elementwise" in OP_MODULES and len(ALL_CASES) >= 10


@pytest.mark.parametrize("module,case", ALL_CASES, ids=[f"{m}::{c.name}" for m, c in ALL_CASES])
def test_op_case_on_spmd(job, module, case):
    runs = job[0][0][f"{module}::{case.name}"]
    meshes = {m for m, _, _ in runs}
    assert meshes == {"all:4", "rows:2;cols:2"}, runs
    assert [(m, lay) for m, lay, _ in runs] == spmd_layouts(case)
    errors = [f"{m} {lay!r}: {e}" for m, lay, e in runs if e is not None]
    assert not errors, "\n".join(errors)


def _placement_lowering(graph_fn, mesh_shape, layout):
    out = graph_fn()
    g, mesh = out[0], out[1]
    return out, mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})


def test_initial_values_equal_placement(job):
    per_rank = [r[1] for r in job]
    for mesh_shape, layout in H.INIT_LAYOUTS:
        (g, mesh, vs), lw = _placement_lowering(H.init_graph, mesh_shape, layout)
        split_any = False
        for name, t in vs.items():
            full = lw.variable_value(name)
            for rank, got in enumerate(per_rank):
                value, bounds, slice_shape, type_name = got[(mesh_shape, layout)][name]
                assert type_name == "Tensor" and list(value.shape) == slice_shape, (name, rank)
                assert bounds == lw.mesh_impl(t).slice_bounds(t.shape, rank, lw.tensor_layout(t))
                assert torch.equal(value, full[bounds]), f"{mesh_shape} {layout} {name} rank {rank}"
                split_any |= value.numel() < full.numel()
        assert split_any, f"layout {layout!r} splits no variable: the check would be vacuous"


def test_local_feeds_and_slices(job):
    per_rank = [r[2] for r in job]
    assert "world size 4" in per_rank[0]["wrong_mesh"]
    for mesh_shape, layout in H.FEED_LAYOUTS:
        (g, mesh, x, w, y, loss, update), lw = _placement_lowering(H.feed_graph, mesh_shape, layout)
        for step in range(3):
            full = H.example_rows(torch.arange(8) + 8 * step)
            loss_p, y_p, _ = lw.run([loss, y, update], feeds={x: full})
            for rank, rec in enumerate(per_rank):
                r = rec[(mesh_shape, layout)]
                assert rel_error(torch.tensor(r["loss"][step]), loss_p) <= 1e-6, (layout, step, rank)
                y_local, bounds = r["y"][step]
                assert rel_error(y_local, y_p[bounds]) <= 1e-6, (layout, step, rank)
                lo = bounds[0].start
                assert torch.equal(r["ids"][step], torch.arange(lo, lo + y_local.shape[0]) + 8 * step)
        w_p = lw.variable_value("w")
        loss_full = lw.run(loss, feeds={x: H.example_rows(torch.arange(8))})
        for rec in per_rank:
            r = rec[(mesh_shape, layout)]
            assert rel_error(r["w"], w_p) <= 1e-6
            assert rel_error(torch.tensor(r["full_feed_loss"]), loss_full) <= 1e-6
            assert r["batch_slice_loss"] == r["full_feed_loss"]
            if "batch" in layout:
                assert "'x'" in r["bad_feed"] and "slice shape" in r["bad_feed"]
    # batch split over 4 ranks: each rank read 2 of the 8 examples
    assert [len(rec[("all:4", "batch:all")]["ids"][0]) for rec in per_rank] == [2, 2, 2, 2]


def test_assigned_allreduce_output_is_materialized(job):
    """A variable assigned straight from an (asynchronous) all-reduce holds a finished tensor after the run."""
    (g, mesh, x, v, op), lw = _placement_lowering(H.assign_sum_graph, "all:4", "batch:all")
    lw.run(op, feeds={x: H.example_rows(torch.arange(8))})
    want = lw.variable_value("v")
    assert want.abs().max() > 0
    for rec in (r[3] for r in job):
        for async_collectives in (True, False):
            type_name, stored, full = rec[async_collectives]
            assert type_name == "Tensor"
            assert rel_error(full, want) <= 1e-6 and torch.equal(stored, full)
        assert torch.equal(rec[True][1], rec[False][1])


def test_primitives_equal_placement(job):
    """Every collective primitive, every dtype, on both meshes: rank r's result == placement's slice r."""
    tensors, layouts = H.primitive_inputs()
    n_checked = 0
    for mesh_shape in H.PRIMITIVE_MESHES:
        impl = mtf.PlacementMeshImpl(mesh_shape, "")
        for dtype, full in tensors.items():
            for lay in layouts[mesh_shape]:
                x = impl.import_full(full, H._layout(lay))
                for name, want in H.primitive_calls(impl, x, lay):
                    for rank, rec in enumerate(r[4] for r in job):
                        got = rec[(mesh_shape, dtype, lay, name)]
                        exp = want if name == "export" else want[rank]
                        where = f"{mesh_shape} {dtype} layout {lay} {name} rank {rank}"
                        assert got.dtype == exp.dtype and got.shape == exp.shape, where
                        if dtype == "float32" and "SUM" in name:
                            assert rel_error(got, exp) <= 1e-6, where
                        else:
                            assert torch.equal(got, exp), where
                        n_checked += 1
    assert n_checked > 1000


def test_leader_and_barrier(job):
    """SpmdMeshImpl.is_leader is rank 0 only; barrier() releases no rank before the last one arrives
    (rank r arrives r x 0.3 s late). The single-process PlacementMeshImpl leads and never waits."""
    recs = [r[5] for r in job]
    assert [(rank, leader) for rank, leader, _, _ in recs] == [(0, True), (1, False), (2, False), (3, False)]
    last_arrival = max(entered for _, _, entered, _ in recs)
    assert all(left >= last_arrival for _, _, _, left in recs), recs
    impl = mtf.PlacementMeshImpl("all:4", "")
    assert impl.is_leader() is True and impl.barrier() is None


def test_feed_slices_on_placement():
    """The same local-feed code runs on a PlacementMeshImpl (the process holds every processor)."""
    g, mesh, x, w, y, loss, update = H.feed_graph()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "batch:rows;hidden:cols")})
    full = H.example_rows(torch.arange(8))
    ids = local_batch_indices(lw, x, "batch")
    assert torch.equal(ids, torch.arange(8))
    want_loss, want_y = lw.run([loss, y], feeds={x: full})
    got_loss, y_slices = lw.run([loss, y], feeds={x: local_feed(lw, x, full)}, feed_slices=True, return_slices=True)
    assert len(y_slices) == 4 and len(got_loss) == 4 and all(torch.equal(v, want_loss) for v in got_loss)
    for b, s in zip(lw.local_slice_bounds(y), y_slices, strict=True):
        assert torch.equal(s, want_y[b])
    assert torch.equal(lw.run(loss, feeds={x: batch_slice(full, lw, x)}, feed_slices=True), want_loss)
    with pytest.raises(mtf.FeedError, match="'x'"):
        lw.run(loss, feeds={x: [full] * 4}, feed_slices=True)
    with pytest.raises(mtf.FeedError, match="4 local slice"):
        lw.run(loss, feeds={x: full}, feed_slices=True)
    with pytest.raises(mtf.FeedError, match="no dimension 'nope'"):
        local_batch_indices(lw, x, "nope")


def _fail_checks(run, fail_rank, budget_s):
    fail_at = float(re.search(r"FAILING_AT ([0-9.]+)", run.stderr[fail_rank]).group(1))
    last_exit = run.start_wall + max(run.exit_times)
    assert not run.timed_out
    assert all(c != 0 for c in run.returncodes), run.returncodes
    detect_s = last_exit - fail_at
    assert detect_s < budget_s, f"ranks took {detect_s:.1f} s to stop after rank {fail_rank} failed"
    return detect_s


def test_failing_rank_stops_the_job():
    run = run_spmd("spmd_helper:failing_worker", args=(1, 3, "raise"), nprocs=4, timeout_s=120,
                   dist_timeout_s=30, extra_path=[TESTS_DIR])
    detect_s = _fail_checks(run, 1, budget_s=30)
    for r in (0, 2, 3):
        assert "rank 1 " in run.stderr[r] and "injected failure at step 3" in run.stderr[r], run.stderr[r][-2000:]
    print(f"\nfailure (raise) -> all 4 ranks exited in {detect_s:.2f} s")


def test_dying_rank_stops_the_job():
    """A rank that vanishes without a Python exception (os._exit) also ends every rank, non-zero."""
    run = run_spmd("spmd_helper:failing_worker", args=(1, 2, "exit"), nprocs=2, timeout_s=120,
                   dist_timeout_s=30, extra_path=[TESTS_DIR])
    assert run.returncodes[1] == 3
    detect_s = _fail_checks(run, 1, budget_s=35)
    print(f"\nfailure (exit) -> both ranks exited in {detect_s:.2f} s")


def test_hanging_rank_times_out():
    """A rank stuck (outside any collective) makes its peers' collectives time out (dist timeout 5 s); their
    failure records then stop the stuck rank too."""
    run = run_spmd("spmd_helper:failing_worker", args=(1, 2, "hang"), nprocs=2, timeout_s=120,
                   dist_timeout_s=5, extra_path=[TESTS_DIR])
    detect_s = _fail_checks(run, 1, budget_s=5 + 25)
    assert detect_s >= 4.0, "peers gave up before the collective timeout"
    assert "stopping because rank" in run.stderr[1], run.stderr[1][-2000:]
    print(f"\nhang (timeout 5 s) -> both ranks exited in {detect_s:.2f} s")


SCRIPT = """
import atexit, os, sys, torch, torch.distributed as dist
threads = lambda: sorted(open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task"))
before = threads()
# registered before meshtorch's exit handler, so it runs after it (atexit runs last-in first-out)
atexit.register(lambda: sys.stdout.write(f"THREADS {{os.environ['RANK']}} {{before}} {{threads()}}\\n"))
sys.path.insert(0, {src!r}); sys.path.insert(0, {tests!r})
import meshtorch as mtf, spmd_helper as H
from meshtorch.mesh import make_mesh_impl
impl = make_mesh_impl("all:2", "batch:all")
assert isinstance(impl, mtf.SpmdMeshImpl), impl
g, mesh, x, w, y, loss, update = H.feed_graph()
lw = mtf.Lowering(g, {{mesh: impl}})
value = float(lw.run(loss, feeds={{x: H.example_rows(torch.arange(8))}}))
if {fail} and dist.get_rank() == 1:
    raise ValueError("boom on rank one")
lw.run(loss, feeds={{x: H.example_rows(torch.arange(8))}})
sys.stdout.write(f"LOSS {{dist.get_rank()}} {{value!r}}\\n")  # one write(): lines of the 2 ranks never interleave
"""


@pytest.mark.parametrize("fail", [False, True])
def test_meshtorch_launch(tmp_path, fail):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(src=SRC_DIR, tests=TESTS_DIR, fail=fail))
    env = dict(os.environ, PYTHONPATH=SRC_DIR, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "meshtorch", "launch", "-n", "2", "--timeout", "30", "--",
                        sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    if not fail:
        assert p.returncode == 0, p.stderr[-3000:]
        (g, mesh, x, w, y, loss, update), lw = _placement_lowering(H.feed_graph, "", "")
        want = float(lw.run(loss, feeds={x: H.example_rows(torch.arange(8))}))
        got = sorted(re.findall(r"LOSS (\d) ([-0-9.e]+)", p.stdout))
        assert [r for r, _ in got] == ["0", "1"], p.stdout
        assert all(abs(float(v) - want) <= 1e-6 * abs(want) for _, v in got)
        # the process groups' threads (gloo workers, the store server on rank 0) end in meshtorch's exit
        # handler, not during interpreter finalization, where a worker can abort the process (status -6)
        left = dict((r, (b, a)) for r, b, a in re.findall(r"THREADS (\d) (\[.*?\]) (\[.*?\])", p.stdout))
        assert sorted(left) == ["0", "1"], p.stdout
        assert all(b == a for b, a in left.values()), left
    else:
        assert p.returncode == 1, p.stderr[-3000:]
        assert "rank 1 failed first" in p.stderr and "boom on rank one" in p.stderr, p.stderr[-3000:]
        assert "rank 0 stopping because rank 1" in p.stderr, p.stderr[-3000:]
        print(f"\nmeshtorch launch with a failing rank: exit 1 after {time.monotonic() - t0:.1f} s in all")


def test_gradient_allreduce_is_hoisted_before_earlier_layers_backward():
    """Data parallel 2-layer MLP: the last layer's gradient sum is issued before the first layer's gradient
    einsum (so an asynchronous all-reduce overlaps it), and results are unchanged."""
    g = mtf.Graph(seed=1)
    mesh = mtf.Mesh(g, "mesh")
    b, i, h, o = mtf.Dimension("batch", 8), mtf.Dimension("io", 4), mtf.Dimension("hidden", 8), mtf.Dimension("out", 4)
    x = mtf.placeholder(mesh, "x", [b, i])
    w1, w2 = mtf.get_variable(mesh, "w1", [i, h]), mtf.get_variable(mesh, "w2", [h, o])
    y = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[b, h])), w2], output_shape=[b, o])
    loss = mtf.reduce_mean(mtf.square(y))
    update = mtf.optim.SgdOptimizer(0.1).apply_grads(mtf.gradients([loss], [w1, w2]), [w1, w2])
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")})
    steps = lw.plan(update).steps
    produced_by = {o: k for k, st in enumerate(steps) for o in st.outputs}
    kinds = steps
    allreduces = [k for k, s in enumerate(kinds) if s.kind == "allreduce"]
    assert len(allreduces) == 2
    for k in allreduces:  # right after the step that makes its input
        assert all(produced_by.get(s, -1) == k - 1 for s in steps[k].inputs if s in produced_by), kinds[k].op
    first_einsum_grad = min(k for k, s in enumerate(kinds) if s.op.startswith("einsum_grad"))
    assert allreduces[0] < first_einsum_grad, [s.op for s in kinds]
    ref = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    feed = H.example_rows(torch.arange(8))
    for _ in range(2):
        lw.run(update, feeds={x: feed})
        ref.run(update, feeds={x: feed})
    for n in ("w1", "w2"):
        assert rel_error(lw.variable_value(n), ref.variable_value(n)) <= 1e-6

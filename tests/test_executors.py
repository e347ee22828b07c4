"""The three executors of a program give the same numbers: the step interpreter, the generated
straight-line function (default) and that function through torch.compile."""

from __future__ import annotations

import os

import pytest
import torch

import meshtorch as mtf
from _program_data import batch, mlp_step
from meshtorch.testing import rel_error
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

LAYOUTS = [("", ""), ("all:4", "batch:all"), ("rows:2;cols:2", "batch:rows;hidden:cols")]


def _train(mesh_shape, layout, mode, steps=3, storage=None):
    g, mesh, x, ws, loss, grads, updates = mlp_step()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)}, mode=mode)
    out = [lw.run([loss, *grads] + updates, feeds={x: batch(s)})[:3] for s in range(steps)]
    return out, {n: lw.variable_value(n) for n in ("w1", "w2")}, lw


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_generated_function_equals_the_interpreter_bitwise(mesh_shape, layout):
    a, va, lwa = _train(mesh_shape, layout, "codegen")
    b, vb, lwb = _train(mesh_shape, layout, "interpret")
    for s in range(len(a)):
        assert all(torch.equal(x, y) for x, y in zip(a[s], b[s], strict=True)), s
    assert all(torch.equal(va[n], vb[n]) for n in va)
    assert dict(lwa.counters.records) == dict(lwb.counters.records)
    assert lwa.plan([]).fn is None  # nothing fetched, nothing generated


def test_generated_function_unrolls_processors_on_the_placement_mesh():
    g, mesh, x, ws, loss, grads, updates = mlp_step()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")})
    lw.run([loss], feeds={x: batch(0)})
    src = lw.plan([loss]).fn.source
    # one kernel call per processor (p0..p3) for a slicewise step; the all-reduce sees the list of slices
    assert all(f"_{p} = k" in src for p in range(4)) and "= f" in src and "_4 = k" not in src


@pytest.mark.parametrize("mesh_shape,layout,storage", [("", "", None), ("rows:2;cols:2", "batch:rows;hidden:cols",
                                                                          "io:rows")])
def test_compiled_equals_interpreted(mesh_shape, layout, storage):
    a, va, lwa = _train(mesh_shape, layout, "compile", steps=4, storage=storage)
    b, vb, _ = _train(mesh_shape, layout, "interpret", steps=4, storage=storage)
    for s in range(len(a)):
        for x, y in zip(a[s], b[s], strict=True):
            assert rel_error(x, y) <= 1e-5, s
    assert all(rel_error(va[n], vb[n]) <= 1e-5 for n in va)
    assert len(lwa.session.compile_seconds) == 1 and next(iter(lwa.session.compile_seconds.values())) > 0


#: the compiled capture's case on 4 gloo ranks (FSDP storage over rows, tensor parallel over cols) and bucket sizes
COMPILED = ("rows:2;cols:2", "batch:rows;hidden:cols", "io:rows")
COMPILED_BUCKETS = [0, 1 << 20]  # single collectives, buckets


@pytest.fixture(scope="module")
def gloo_ranks(once_per_run):
    """One start of 4 gloo ranks for the two gloo tests of this file (once per test run: ``once_per_run``): per
    rank, ``(compiled capture results per bucket size, bucket worker results)``."""
    return once_per_run("test_executors_gloo", lambda: run_spmd(
        "_executor_jobs:gloo_jobs", args=((3, *COMPILED, COMPILED_BUCKETS, "aot_eager"), (3, 1 << 20)),
        nprocs=4, timeout_s=400, extra_path=[TESTS_DIR]).check().results)


@pytest.mark.slow
def test_compiled_spmd_program_is_one_graph_with_functional_collectives(gloo_ranks):
    """On 4 gloo ranks a compiled step (FSDP storage over ``rows``, tensor parallel over ``cols``:
    all-gathers, reduce-scatters and all-reduces, single or in buckets) is one dynamo graph per rank,
    no graph break, and gives the placement mesh's numbers (interpreter) to 1e-5. The capture is what this
    checks, so it compiles with ``aot_eager`` (dynamo + AOTAutograd, functional collectives, no generated
    kernels: 126 s -> seconds per case on the loaded 2-core host); inductor's kernels on gloo ranks are
    checked by ``test_spmd_jobs.py::test_train_compile_spmd_equals_placement``. Both cases (single
    collectives, then buckets) run in one job: one start of the 4 processes, dynamo reset between them."""
    mesh_shape, layout, storage = COMPILED
    want, want_vars, _ = _train(mesh_shape, layout, "interpret", steps=3, storage=storage)
    cases = COMPILED_BUCKETS
    assert len(gloo_ranks) == 4
    for rank_results, _ in gloo_ranks:
        assert len(rank_results) == len(cases)
        for bucket_bytes, (losses, values, kinds, breaks, graphs, inductor) in zip(cases, rank_results, strict=True):
            assert breaks == {} and graphs == 1, (bucket_bytes, breaks, graphs)
            assert not inductor  # the backend asked for is the one torch.compile used
            assert {"allgather", "reduce_scatter", "allreduce"} <= {k.removesuffix("_bucket") for k in kinds}
            assert any(k.endswith("_bucket") for k in kinds) == bool(bucket_bytes), (bucket_bytes, kinds)
            assert all(rel_error(a, w[0]) <= 1e-5 for a, w in zip(losses, want, strict=True)), bucket_bytes
            assert all(rel_error(values[n], want_vars[n]) <= 1e-5 for n in values), bucket_bytes


def test_spmd_generated_code_calls_kernels_directly(gloo_ranks):
    """On the SPMD mesh (one slice per process: ``local_slicewise``) the generated code calls each slicewise
    kernel itself, not through ``impl.slicewise``, and waits for an asynchronous all-reduce at its first use:
    on 4 gloo ranks, every gradient all-reduce in flight, the same numbers as the interpreter, bitwise."""
    assert len(gloo_ranks) == 4
    for _, (*_, direct) in gloo_ranks:
        assert direct["kernel_calls"] == direct["slicewise"] > 0
        (a, va), (b, vb) = direct["codegen"], direct["interpret"]
        for s in range(len(a)):
            assert all(torch.equal(x, y) for x, y in zip(a[s], b[s], strict=True)), s
        assert all(torch.equal(va[n], vb[n]) for n in va)


def test_unknown_mode_is_refused_before_planning():
    g, mesh, *_ = mlp_step()
    with pytest.raises(ValueError, match="mode must be"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}, mode="fast")
    with pytest.raises(ValueError, match="bucket_bytes must be"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}, bucket_bytes=-1)
    with pytest.raises(ValueError, match="compile backend must be .*'fast-inductor'"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}, mode="compile", compile_backend="fast-inductor")


def test_gradient_buckets_give_the_same_numbers_and_counters(gloo_ranks):
    """DDP-style buckets: the two gradient all-reduces of a data-parallel step become one call; results,
    variables and collective records are those of one call per gradient (placement and 4 gloo ranks)."""
    def run(bucket_bytes):
        g, mesh, x, ws, loss, grads, updates = mlp_step()
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")}, bucket_bytes=bucket_bytes)
        out = [lw.run([loss] + updates, feeds={x: batch(s)})[0] for s in range(3)]
        return out, lw, [st.kind for st in lw.plan([loss] + updates).steps]
    plain, lwp, _ = run(0)
    bucketed, lwb, kinds = run(1 << 20)
    assert all(torch.equal(a, b) for a, b in zip(plain, bucketed, strict=True))
    assert all(torch.equal(lwp.variable_value(n), lwb.variable_value(n)) for n in ("w1", "w2"))
    assert dict(lwp.counters.records) == dict(lwb.counters.records)
    # the loss and both gradient sums (3 all-reduce records) in one call: nothing needs them before the update
    assert kinds.count("allreduce_bucket") == 1 and "allreduce" not in kinds
    assert sum(n for r, n in lwb.plan_counters([]).records.items()) == 0 and lwb.counters.count("allreduce") == 9
    tiny, _, _ = run(8)  # a cap below one gradient: no bucket, same numbers
    assert all(torch.equal(a, b) for a, b in zip(plain, tiny, strict=True))
    assert len(gloo_ranks) == 4
    for _, (losses, values, rank_kinds, _) in gloo_ranks:  # 4 gloo ranks: _executor_jobs.gloo_jobs's bucket worker
        assert rank_kinds.count("allreduce_bucket") == 1
        assert all(rel_error(a, b) <= 1e-6 for a, b in zip(losses, plain, strict=True))
        assert all(rel_error(values[n], lwp.variable_value(n)) <= 1e-6 for n in values)

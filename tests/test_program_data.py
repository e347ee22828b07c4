"""The program as data (issue: program as data, storage layouts).

- one program is planned once, written as JSON, and run from that text alone on a placement mesh
  and on 4 gloo ranks: the same results and the same collective records;
- variables stored in another layout than the one they are computed in (storage rules, FSDP):
  all-gathers of the weights, reduce-scatters of their gradients, no all-reduce of a gradient, and
  values equal to the unsplit run.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import meshtorch as mtf
from _program_data import batch, mlp_step, run_json_steps
from meshtorch.testing import rel_error
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


def _plan(mesh_shape, layout, storage=None, prefetch=1):
    g, mesh, x, ws, loss, grads, updates = mlp_step()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage, prefetch=prefetch)})
    return lw, x, ws, loss, grads, updates


def _reference_steps():
    """The same MLP, plain PyTorch on full tensors: per-step loss and gradients, final weights."""
    g, mesh, *_ = mlp_step()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    w1, w2 = (lw.variable_value(n).clone().requires_grad_(True) for n in ("w1", "w2"))
    out = []
    for s in range(STEPS):
        x = batch(s)
        loss = ((torch.relu(x @ w1) @ w2 - x) ** 2).mean()
        g1, g2 = torch.autograd.grad(loss, [w1, w2])
        out.append((loss.detach(), g1, g2))
        with torch.no_grad():
            w1 -= 0.1 * g1
            w2 -= 0.1 * g2
    return out, {"w1": w1.detach(), "w2": w2.detach()}


@pytest.mark.parametrize("mesh_shape,layout,storage", [
    ("all:4", "hidden:all", ""),
    ("data:2;model:2", "batch:data;hidden:model", "io:data"),
])
def test_one_program_runs_from_json_on_placement_and_gloo_ranks(mesh_shape, layout, storage):
    lw, x, ws, loss, grads, updates = _plan(mesh_shape, layout, storage)
    fetches = [loss, *grads]
    text = lw.to_json(fetches)
    assert json.loads(text)["format"] == "meshtorch-program"
    names = [t.name for t in fetches]
    ops = [u.name for u in updates]
    values = {n: lw.variable_value(n) for n in lw.variable_names}
    # the planning process itself, through the graph API
    direct = []
    for s in range(STEPS):
        direct.append(lw.run(fetches + updates, feeds={x: batch(s)})[:len(fetches)])
    # the JSON text alone, on a fresh placement mesh and on 4 gloo ranks
    impl = mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)
    placed, placed_vars, placed_counts = run_json_steps(text, impl, values, STEPS, names, ops)
    run = run_spmd("_program_data:spmd_json_worker", args=(text, values, STEPS, names, ops, mesh_shape, layout,
                                                            storage), nprocs=4, extra_path=[TESTS_DIR]).check()
    ref, ref_vars = _reference_steps()
    for s in range(STEPS):
        for i, want in enumerate(ref[s]):
            assert rel_error(direct[s][i], want) <= 1e-5, (s, i)
            assert torch.equal(placed[s][i], direct[s][i]), (s, i)  # same program, same implementation
            for rank, (steps_r, _, _) in enumerate(run.results):
                assert rel_error(steps_r[s][i], placed[s][i]) <= 1e-6, (rank, s, i)
    for n in ("w1", "w2"):
        assert rel_error(placed_vars[n], ref_vars[n]) <= 1e-5
        for _, vars_r, _ in run.results:
            assert rel_error(vars_r[n], placed_vars[n]) <= 1e-6
    for _, _, counts in run.results:
        assert counts == placed_counts  # the same collectives, bytes and counts on both implementations


def test_storage_layout_gathers_weights_and_reduce_scatters_gradients():
    """Weights split over the data axis (storage ``io:all``), batch split over it too (compute)."""
    lw, x, ws, loss, grads, updates = _plan("all:4", "batch:all", storage="io:all")
    assert [tuple(lw.tensor_layout(w)) for w in ws] == [(0, None), (None, 0)]  # stored as shards
    c = lw.plan_counters([loss] + updates)
    kinds = {(r.kind, r.tensor): n for r, n in c.records.items()}
    # every weight is all-gathered for compute, every gradient reduce-scattered into the shards. With
    # reshard-after-forward (the default) a weight the backward pass reads is gathered again, unless only
    # weight-free ops lie between its forward and backward use, as for w2 (dh = dy w2^T right after the
    # loss): its forward copy is kept. w1 is not read by the backward pass (no gradient w.r.t. x is asked for)
    assert kinds[("allgather", "w1")] == 1 and kinds[("allgather", "w2")] == 1
    scattered = [r for r in c.records if r.kind == "reduce_scatter"]
    assert len(scattered) == 2 and {r.op for r in scattered} == {"einsum_grad1", "einsum_1_grad1"}
    # no all-reduce of a gradient: only the loss (a scalar) is all-reduced
    assert all(r.tensor.startswith("reduce") for r in c.records if r.kind == "allreduce"), c.summary()
    # bytes from the shapes: a full float32 [4, 8] weight is gathered from shards of 8 elements, and
    # each processor contributes its whole partial gradient (32 elements) to the reduce-scatter
    for r in c.records:
        if r.kind == "allgather":
            assert r.bytes_per_processor == 4 * 8 * 4 // 4
        if r.kind == "reduce_scatter":
            assert r.bytes_per_processor == 4 * 8 * 4
    # values and gradients equal the unsplit reference, over 3 SGD steps
    ref, ref_vars = _reference_steps()
    for s in range(STEPS):
        got = lw.run([loss, *grads] + updates, feeds={x: batch(s)})
        for i, want in enumerate(ref[s]):
            assert rel_error(got[i], want) <= 1e-5, (s, i)
    for n in ("w1", "w2"):
        assert rel_error(lw.variable_value(n), ref_vars[n]) <= 1e-5
    # each processor holds a quarter of each weight
    impl = lw.mesh_impl(ws[0])
    assert [list(t.shape) for t in impl.local_slices(lw.variables[ws[0].operation])] == [[1, 8]] * 4


def test_without_reshard_after_forward_the_forward_gather_is_kept():
    g, mesh, x, ws, loss, grads, updates = mlp_step()
    impl = mtf.PlacementMeshImpl("all:4", "batch:all", storage="io:all", reshard_after_forward=False)
    lw = mtf.Lowering(g, {mesh: impl})
    c = lw.plan_counters([loss] + updates)
    assert sorted(r.tensor for r in c.records if r.kind == "allgather") == ["w1", "w2"]
    ref, ref_vars = _reference_steps()
    for s in range(STEPS):
        assert rel_error(lw.run([loss] + updates, feeds={x: batch(s)})[0], ref[s][0]) <= 1e-5


def test_weight_gathers_are_not_hoisted_to_the_start():
    """Without prefetch an FSDP weight is gathered where it is first used, not at the start of the program
    (which would hold every gathered weight at once); the backward gather comes after the forward pass.
    With prefetch 1, w2's gather is issued before w1 is used, and no earlier than w1's gather."""
    lw, x, ws, loss, grads, updates = _plan("all:4", "batch:all", storage="io:all", prefetch=1)
    steps = lw.plan([loss] + updates).steps
    g1, g2 = (next(i for i, st in enumerate(steps) if st.kind == "allgather" and st.collective.tensor == w)
              for w in ("w1", "w2"))
    assert g1 < g2 < {st.op: i for i, st in enumerate(steps)}["einsum"]
    lw, x, ws, loss, grads, updates = _plan("all:4", "batch:all", storage="io:all", prefetch=0)
    plan = lw.plan([loss] + updates)
    steps = plan.steps
    gathers = [i for i, st in enumerate(steps) if st.kind == "allgather" and st.collective.tensor == "w2"]
    at = {st.op: i for i, st in enumerate(steps)}
    assert at["einsum"] < gathers[0] < at["einsum_1"]  # gathered after the first layer ran, just before use
    # only the loss lies between w2's forward and backward use: the backward pass reads the forward copy
    # (test_fsdp.py checks the LM's block weights, which are gathered again)
    forward_copy = steps[gathers[0]].outputs[0]
    assert len(gathers) == 1 and forward_copy in steps[at["einsum_1_grad0"]].inputs
    freed_at = next(i for i, f in enumerate(plan.frees) if forward_copy in f)
    assert freed_at >= at["einsum_1_grad0"]


def test_storage_rules_leave_a_program_without_them_unchanged():
    plain, *_ = _plan("data:2;model:2", "batch:data;hidden:model")
    same, *_ = _plan("data:2;model:2", "batch:data;hidden:model", storage="")
    assert plain.program_str() == same.program_str()


def test_session_refuses_an_implementation_of_another_mesh():
    lw, *_ = _plan("all:4", "batch:all")
    program = mtf.Program.from_json(lw.to_json())
    impls = {"mesh": mtf.PlacementMeshImpl("all:2", "batch:all")}
    with pytest.raises(ValueError, match="planned as"):
        mtf.Session(program, impls, mtf.VariableStore(program, impls))


def test_program_json_round_trip_keeps_every_step():
    lw, *_ = _plan("data:2;model:2", "batch:data;hidden:model", storage="io:data")
    text = lw.to_json()
    again = mtf.Program.from_json(text)
    assert str(again) == str(lw.program) and again.to_json() == text
    assert math.isfinite(len(again.steps)) and len(again.steps) == len(lw.program.steps)
    with pytest.raises(ValueError, match="not a meshtorch program"):
        mtf.Program.from_json('{"format": "other"}')


def test_bfloat16_activations_gather_bfloat16_weights_from_float32_shards():
    """Mixed precision with storage rules (FSDP2's param_dtype): the shard is cast, then gathered, so the
    all-gather moves bfloat16 while the stored (master) copy stays float32."""
    def build():
        g = mtf.Graph(seed=3)
        mesh = mtf.Mesh(g, "mesh")
        b, io, hid = mtf.Dimension("batch", 8), mtf.Dimension("io", 4), mtf.Dimension("hidden", 8)
        x = mtf.placeholder(mesh, "x", [b, io], dtype=torch.bfloat16)
        vd = mtf.VariableDType(torch.float32, torch.float32, torch.bfloat16)
        w = mtf.get_variable(mesh, "w", [io, hid], dtype=vd)
        y = mtf.einsum([x, w], output_shape=[b, hid])
        loss = mtf.reduce_mean(mtf.cast(mtf.square(y), torch.float32))
        upd = mtf.optim.SgdOptimizer(0.1).apply_grads(mtf.gradients([loss], [w]), [w])
        return g, mesh, x, loss, upd
    g, mesh, x, loss, upd = build()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all", storage="io:all")})
    gathers = [r for r in lw.plan_counters([loss] + upd).records if r.kind == "allgather"]
    assert [(r.tensor, r.bytes_per_processor) for r in gathers] == [("w/read", 4 * 8 // 4 * 2)]  # bf16 shard
    assert lw.store.values["w"][0].dtype == torch.float32 and list(lw.store.values["w"][0].shape) == [1, 8]
    g2, mesh2, x2, loss2, upd2 = build()
    ref = mtf.Lowering(g2, {mesh2: mtf.PlacementMeshImpl("", "")})
    for s in range(2):
        feed = batch(s).to(torch.bfloat16)
        a = lw.run([loss] + upd, feeds={x: feed})[0]
        r = ref.run([loss2] + upd2, feeds={x2: feed})[0]
        assert rel_error(a, r) <= 1e-2, (s, a, r)
    assert rel_error(lw.variable_value("w"), ref.variable_value("w")) <= 1e-2

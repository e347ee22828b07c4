"""Storage layouts (FSDP / ZeRO-3), issue 12 acceptance: the LM trains to the same losses under
replicated data parallel, FSDP over ``data`` and FSDP + tensor parallel, on the placement mesh and on
4 gloo ranks; an FSDP step all-gathers every sharded weight and reduce-scatters every sharded gradient
(bytes from the shapes), never all-reducing one.

Tolerances (measured 2026-11-23): the layouts differ from each other only in float32 summation order;
over 20 steps the largest relative loss difference from replicated data parallel was 1.9e-7 on the
placement mesh and 2.5e-7 on the gloo ranks, so 1e-6 holds with margin; the tests run 10 steps (since 2026-11-28,
to halve the 4-rank job), where the summation-order differences have had fewer steps to grow.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import meshtorch as mtf
from _fsdp import CFG, CLIP, LAYOUTS, LR, OPTIMIZERS, STEPS, WD, bf16_mlp, bf16_steps, build, data, train
from meshtorch.testing import rel_error
from meshtorch.testing.spmd import run_spmd
from meshtorch.testing.torch_lm import TorchLM

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
RTOL = 1e-6


def _max_rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def placement_runs(once_per_run):
    """{(layout name, optimizer): (losses, final values, counters)} on PlacementMeshImpl."""
    return once_per_run("test_fsdp_placement_runs", lambda: {
        (name, opt): train(mtf.PlacementMeshImpl(m, lay, storage=st), opt)
        for name, (m, lay, st) in LAYOUTS.items() for opt in OPTIMIZERS})


@pytest.fixture(scope="module")
def spmd_runs():
    """The same six runs on 4 gloo ranks (one job)."""
    return run_spmd("_fsdp:spmd_worker", nprocs=4, timeout_s=600, extra_path=[TESTS_DIR]).check().results


def _torch_adamw_losses():
    """Independent reference: TorchLM with the same initial weights, torch.optim.AdamW and clip_grad_norm_."""
    lm, *_ = build("adamw_clip")
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("", "")})
    model = TorchLM(CFG)
    model.load_state_dict({n.replace("/", "."): lw.variable_value(n) for n in lw.variable_names
                           if "/adam_" not in n and n != "global_step"}, strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for s in range(STEPS):
        x, y = data(s)
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_losses_equal_under_every_storage_layout_on_placement_mesh(placement_runs, opt):
    ref_losses, ref_values, _ = placement_runs[("replicated_dp", opt)]
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it trains
    for name in ("fsdp", "fsdp_tp"):
        losses, values, counters = placement_runs[(name, opt)]
        # what ran is STEPS times what the plan of one step says
        m, lay, st = LAYOUTS[name]
        lm, _, _, updates = build(opt)
        lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(m, lay, storage=st)}, materialize=False)
        planned = {(c.kind, c.mesh_axes, c.op, c.tensor, c.bytes_per_processor): n * STEPS
                   for c, n in lw.plan_counters([lm.loss] + updates).records.items()}
        assert counters == planned, (name, opt)
        assert _max_rel(losses, ref_losses) <= RTOL, (name, opt)
        for n, v in values.items():
            assert rel_error(v, ref_values[n]) <= 1e-5, (name, opt, n)


def test_replicated_adamw_with_clipping_follows_torch():
    """The replicated run itself against plain PyTorch (TorchLM + torch.optim.AdamW + clip_grad_norm_)."""
    lm_losses, _, _ = train(mtf.PlacementMeshImpl(*LAYOUTS["replicated_dp"][:2]), "adamw_clip")
    assert _max_rel(lm_losses, _torch_adamw_losses()) <= 1e-5


@pytest.mark.slow
def test_losses_equal_on_four_gloo_ranks(placement_runs, spmd_runs):
    for rank, runs in enumerate(spmd_runs):
        for key, run in runs.items():
            if key[0] == "bf16":
                p_losses, p_values = bf16_steps(mtf.PlacementMeshImpl("all:4", "batch:all", storage=key[1]))
                # bfloat16 partial sums are added in another order by gloo than on the placement mesh
                # (measured: 6e-5 in the losses, 4e-4 in the weights): bounded by bfloat16's epsilon, 2^-8
                assert _max_rel(run[0], p_losses) <= 2 ** -8, (rank, key)
                assert all(rel_error(run[1][n], p_values[n]) <= 2 ** -8 for n in p_values), (rank, key)
                # on the ranks themselves, FSDP (bfloat16 reduce-scatter) agrees with plain data parallel (all-reduce)
                # (measured: losses equal, weights 1.9e-4: bfloat16 sums in another order)
                same = runs[("bf16", "")]
                assert _max_rel(run[0], same[0]) <= 1e-6, (rank, key)
                assert all(rel_error(run[1][n], same[1][n]) <= 2 ** -8 for n in p_values), (rank, key)
                continue
            losses, values, counters = run
            p_losses, p_values, p_counters = placement_runs[key[:2]]  # async runs: same numbers
            assert _max_rel(losses, p_losses) <= RTOL, (rank, key)
            for n, v in values.items():
                assert rel_error(v, p_values[n]) <= 1e-6, (rank, key, n)
            assert counters == p_counters, (rank, key)  # the same collectives with the same bytes


def _rules(text: str) -> dict:
    return dict(p.split(":") for p in text.split(";") if p)


def _local_elems(shape, rules: dict, axis_sizes: dict) -> int:
    return math.prod(d.size // axis_sizes.get(rules.get(d.name), 1) for d in shape)


@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_fsdp_step_gathers_weights_and_reduce_scatters_gradients(name, opt):
    mesh_shape, layout, storage = LAYOUTS[name]
    lm, variables, grads, updates = build(opt)
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)},
                      materialize=False)
    counters = lw.plan_counters([lm.loss] + updates)
    axis_sizes = {a: int(s) for a, s in (p.split(":") for p in mesh_shape.split(","))}
    compute = _rules(layout)
    stored = {**compute, **_rules(storage)}
    recs = list(counters.records.items())
    grad_names = {g.name: v for g, v in zip(grads, variables, strict=True)}
    sharded = [v for v in variables if any(d.name == "d_model" for d in v.outputs[0].shape)]
    assert sharded == list(variables)  # every LM weight has d_model
    # reshard-after-forward (the default): a weight the backward pass reads (an op mtf.gradients built takes it
    # as an input) is gathered twice, once for the forward pass and again for the backward pass, except the
    # output projection: only the loss lies between its forward and backward use, so its forward copy is kept
    read_backward = {t for op in lm.graph.operations if op.backward for t in op.inputs}
    kept = {"logits/kernel"}
    assert kept <= {v.name for v in sharded}
    for v in sharded:
        t = v.outputs[0]
        gathers = [(c, n) for c, n in recs if c.kind == "allgather" and c.tensor == v.name]
        times = 2 if t in read_backward and v.name not in kept else 1
        assert [(c.mesh_axes, n) for c, n in gathers] == [(("data",), times)], (v.name, gathers)
        assert gathers[0][0].bytes_per_processor == _local_elems(t.shape, stored, axis_sizes) * 4, v.name
    assert read_backward & {v.outputs[0] for v in sharded}  # the test sees both cases
    # without reshard-after-forward: exactly once per step
    keep = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage,
                                                                  reshard_after_forward=False)}, materialize=False)
    once = keep.plan_counters([lm.loss] + updates).records
    for v in sharded:
        assert [n for c, n in once.items() if c.kind == "allgather" and c.tensor == v.name] == [1], v.name
    for g, v in zip(grads, variables, strict=True):
        scattered = [(c, n) for c, n in recs if c.kind == "reduce_scatter" and c.tensor == g.name]
        assert [(c.mesh_axes, n) for c, n in scattered] == [(("data",), 1)], (v.name, g.name)
        # each processor contributes its whole partial gradient, laid out by the compute rules
        assert scattered[0][0].bytes_per_processor == _local_elems(g.shape, compute, axis_sizes) * 4, v.name
    # no all-reduce of a gradient (only the loss and the clipping norm, scalars, are reduced over data)
    assert not [c for c, _ in recs if c.kind == "allreduce" and c.tensor in grad_names]
    assert all(c.bytes_per_processor == 4 for c, _ in recs if c.kind == "allreduce" and "data" in c.mesh_axes)
    # variables and optimizer slots are stored as shards: a quarter (FSDP) or less of each full tensor
    for var in lw.variables:
        t = var.outputs[0]
        if t.shape.size > 1:
            local = math.prod(lw.slice_shape(t))
            assert local == _local_elems(t.shape, stored, axis_sizes), var.name
            if any(d.name == "d_model" for d in t.shape):
                assert local * axis_sizes["data"] <= t.shape.size, var.name



def test_bfloat16_reads_gather_bfloat16_and_reduce_scatter_gradients():
    """Float32 variables read as bfloat16 (FSDP2's param_dtype): the cast runs on the stored shard, so the
    all-gather moves bfloat16; the gradient is reduce-scattered (bfloat16), then cast to float32 on the shard."""
    g, mesh, x, loss, variables, grads, updates = bf16_mlp()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all", storage="io:all")}, materialize=False)
    recs = lw.plan_counters([loss] + updates).records
    gathers = {c.tensor: c for c in recs if c.kind == "allgather"}
    assert set(gathers) == {"w1/read", "w2/read"}
    for v in variables:
        assert gathers[f"{v.name}/read"].bytes_per_processor == v.outputs[0].shape.size // 4 * 2  # bfloat16 shard
    scattered = {c.tensor: c for c in recs if c.kind == "reduce_scatter"}
    assert len(scattered) == len(variables)  # each weight's bfloat16 partial gradient, before its float32 cast
    for c in scattered.values():
        assert c.bytes_per_processor == 8 * 16 * 2  # the whole bfloat16 partial gradient
    assert not [c for c in recs if c.kind == "allreduce" and c.bytes_per_processor > 4]
    # the same numbers as without storage rules (bitwise: the same casts and sums on each element)
    ref_losses, ref_values = bf16_steps(mtf.PlacementMeshImpl("all:4", "batch:all"))
    losses, values = bf16_steps(mtf.PlacementMeshImpl("all:4", "batch:all", storage="io:all"))
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-6
    for n, v in values.items():
        assert v.dtype == torch.float32 and rel_error(v, ref_values[n]) <= 1e-6, n


def test_resharded_weight_is_freed_before_its_backward_gather_and_the_kept_one_is_reused():
    """Reshard-after-forward on the LM, prefetch 0: a block weight's forward copy is freed before the backward
    pass gathers it again; the output projection's forward copy (only the loss lies between its uses) is the
    one its backward op reads, gathered once."""
    mesh_shape, layout, storage = LAYOUTS["fsdp"]
    lm, variables, grads, updates = build("adamw_clip")
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage, prefetch=0)},
                      materialize=False)
    plan = lw.plan([lm.loss] + updates)
    steps = plan.steps

    def gathers(name):
        return [i for i, st in enumerate(steps) if st.kind == "allgather" and st.collective.tensor == name]

    block = next(v.name for v in variables if v.name.endswith("wi/kernel"))
    first, again = gathers(block)
    forward_copy = steps[first].outputs[0]
    assert next(i for i, f in enumerate(plan.frees) if forward_copy in f) < again
    (only,) = gathers("logits/kernel")
    backward = {op.name for op in lm.graph.operations if op.backward}
    readers = [st.op for st in steps if steps[only].outputs[0] in st.inputs]
    assert [op in backward for op in readers] == [False, True], readers  # the forward einsum, then its gradient

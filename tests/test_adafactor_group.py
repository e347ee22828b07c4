"""The multi-tensor Adafactor step (ForeachAdafactorGroupUpdate) vs the per-variable fused op and a float64 reference.

Variables named like an LM's (factored matrices, a 3-d kernel, an unfactored vector and a small matrix) under
four layouts: one processor, data parallel (``batch:data``, the variables replicated), 2x2 Megatron with FSDP
storage (``d_ff:model``, storage ``d_model:data``) and a layout splitting the factored (reduced) dims. The group
step must be bitwise equal to one FusedAdafactorUpdate per variable (the CPU's multi-tensor kernels are the
per-tensor ones, applied in the same order) and match ``test_optim.ref_adafactor`` (float64 on full tensors).
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch.lowering.donate import donatable_inputs, donated_mask
from meshtorch.optim.foreach_adafactor import ForeachAdafactorGroupUpdate
from meshtorch.optim.fused_adafactor import FusedAdafactorUpdate
from meshtorch.optim.in_backward import per_variable
from test_optim import _check_update, _compare, _grads, _params, ref_adafactor

SHAPES = {"wi": "d_model:128,d_ff:256", "q": "d_model:128,heads:4,d_kv:128", "scale": "d_model:128",
          "small": "d_ff:256,length:4"}
# (mesh, layout, storage)
LAYOUTS = [("", "", None), ("data:2", "batch:data", None), ("data:2;model:2", "d_ff:model;heads:model", "d_model:data"),
           ("all:4", "d_model:all", None)]


def _run(make_opt, params, grads_seq, mesh_shape, layout, storage, bucket_bytes=0):
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    names = list(params)
    vs = [mtf.get_variable(mesh, n, params[n][0], initializer=0.0) for n in names]
    phs = [mtf.placeholder(mesh, f"grad_{n}", params[n][0]) for n in names]
    ops = make_opt().apply_grads(phs, vs)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)}, bucket_bytes=bucket_bytes)
    for n in names:
        lw.set_variable_value(n, params[n][1])
    ptrs = {n: [t.data_ptr() for t in lw.store.impl(n).local_slices(lw.store.values[n])] for n in lw.store.names}
    for grads in grads_seq:
        lw.run(ops, feeds={ph: grads[n] for ph, n in zip(phs, names, strict=True)})
    assert ptrs == {n: [t.data_ptr() for t in lw.store.impl(n).local_slices(lw.store.values[n])]
                    for n in lw.store.names}, f"{mesh_shape!r} {layout!r}: variable storage reallocated"
    return {n: lw.variable_value(n) for n in lw.variable_names}, lw, g, ops


@pytest.mark.parametrize("beta1", [0.0, 0.9])
def test_group_step_bitwise_equals_per_variable_op_and_matches_reference(beta1):
    params = _params(shapes=SHAPES)
    grads = _grads(params, 3)
    ref = ref_adafactor(params, grads, beta1=beta1)
    names = list(params) + [n for n in ref if "_slot_" in n]
    assert {"wi_slot_vr", "q_slot_vc", "scale_slot_v", "small_slot_v"} <= set(names)
    kw = dict(beta1=beta1)
    for mesh_shape, layout, storage in LAYOUTS:
        where = f"beta1={beta1} {mesh_shape!r} {layout!r} storage {storage!r}"
        got, _, g, _ = _run(lambda: mtf.optim.AdafactorOptimizer(**kw), params, grads, mesh_shape, layout, storage)
        assert sum(isinstance(op, ForeachAdafactorGroupUpdate) for op in g.operations) == 1
        one, _, g1, _ = _run(lambda: per_variable(mtf.optim.AdafactorOptimizer(**kw)), params, grads, mesh_shape,
                             layout, storage)
        assert sum(isinstance(op, FusedAdafactorUpdate) for op in g1.operations) == len(params)
        for n in names:
            assert torch.equal(got[n], one[n]), f"{where}: {n} differs from the per-variable op by " \
                f"{(got[n] - one[n]).abs().max().item():.3g}"
        _compare(got, ref, names, where)
        _check_update(got, ref, params, where, len(grads))


def _plan(lw, ops):
    return lw.session.plan(lw._fetch_keys(ops))


def test_statistics_all_reduces_bucket_per_stage_and_updates_in_place():
    """On ``all:4`` splitting every factored dim, the step's statistics need all-reduces of every variable; with
    reduction buckets on, those after one stage over the same mesh axes are one call (3 stages with statistics:
    the sums of g^2 and w^2, the row sums and unfactored update sums, the factored update sums), where the
    per-variable ops issue one call per variable and statistic. The second moments, weights and momenta are
    updated in place (the plan donates them) and the values equal the unbucketed run's."""
    params = _params(shapes=SHAPES)
    grads = _grads(params, 2)
    mesh_shape, layout = "all:4", "d_model:all"
    got, lw, _, ops = _run(lambda: mtf.optim.AdafactorOptimizer(beta1=0.9), params, grads, mesh_shape, layout,
                           None, bucket_bytes=2 ** 20)
    plain, lw0, _, ops0 = _run(lambda: mtf.optim.AdafactorOptimizer(beta1=0.9), params, grads, mesh_shape, layout,
                               None)
    one, lw1, _, ops1 = _run(lambda: per_variable(mtf.optim.AdafactorOptimizer(beta1=0.9)), params, grads, mesh_shape,
                             layout, None, bucket_bytes=2 ** 20)
    for n in got:
        torch.testing.assert_close(got[n], plain[n], rtol=0, atol=0, msg=n)  # one process: sums in the same order
    assert len(got) == len(plain)
    kinds = [st.kind for st in _plan(lw, ops).steps if st.kind.startswith("allreduce")]
    unbucketed = [st.kind for st in _plan(lw0, ops0).steps if st.kind.startswith("allreduce")]
    per_var = [st.kind for st in _plan(lw1, ops1).steps if st.kind.startswith("allreduce")]
    assert kinds == ["allreduce_bucket"] * 3, kinds
    # unbucketed: one all-reduce per variable and statistic (9); per-variable ops: a bucket within one variable
    # at best (6 calls for the 2 factored variables' 9 statistics)
    assert len(unbucketed) == 9 and len(per_var) == 6, (unbucketed, per_var)
    plan = _plan(lw, ops)
    names = {s: n for n, s in plan.var_reads}
    donated = sorted(names[st.inputs[j]] for st in plan.steps if st.kind == "slicewise"
                     for j, d in zip(donatable_inputs(st), donated_mask(st), strict=False) if d)
    # every slice split over all:4 (d_model) is written in place; the replicated ones (small and its slots, wi's
    # vc [d_ff], q's vr [heads, d_kv]) are read by the 4 processors' calls, so they are not
    assert donated == ["q", "q_slot_m", "q_slot_vc", "scale", "scale_slot_m", "scale_slot_v", "wi", "wi_slot_m",
                       "wi_slot_vr"], donated


@pytest.mark.slow
def test_compiled_group_step_matches_reference():
    """``mode="compile"``: the four stages traced by ``torch.compile`` (the donated moments, weights and momenta
    written back into their storage as graph-input mutations) against the float64 reference, 2x2 Megatron with
    FSDP storage; 1e-5 (the compiled-vs-interpreted bound). (Compiled runs on a placement mesh give replicas of a
    replicated variable separate tensors, AdamW's too, so storage is not compared here.)"""
    params = _params(shapes=SHAPES)
    grads = _grads(params, 2)
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    vs = [mtf.get_variable(mesh, n, s, initializer=0.0) for n, (s, _) in params.items()]
    phs = [mtf.placeholder(mesh, f"grad_{n}", s) for n, (s, _) in params.items()]
    ops = mtf.optim.AdafactorOptimizer(beta1=0.9).apply_grads(phs, vs)
    _, layout, storage = LAYOUTS[2]
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(LAYOUTS[2][0], layout, storage=storage)}, mode="compile")
    for n, (_, v) in params.items():
        lw.set_variable_value(n, v)
    for gr in grads:
        lw.run(ops, feeds={ph: gr[n] for ph, n in zip(phs, params, strict=True)})
    assert lw.session.compile_seconds and all(lw.session.compile_seconds.values())  # it was compiled
    ref = ref_adafactor(params, grads, beta1=0.9)
    got = {n: lw.variable_value(n) for n in lw.variable_names}
    _compare(got, ref, list(ref), "compiled adafactor group", rtol=1e-5)


def test_groups_of_at_most_group_bytes_in_order_with_the_same_values():
    """``group_bytes``: the variables are cut in order into multi-tensor updates of at most that many float32
    bytes (a larger variable alone); the values are those of one group (bitwise)."""
    params = _params(shapes=SHAPES)
    grads = _grads(params, 2)

    def make(cap):
        opt = mtf.optim.AdafactorOptimizer(beta1=0.9)
        if cap is not None:
            opt.group_bytes = cap
        return opt
    # float32 bytes: wi 128 KiB, q 256 KiB, scale 512 B, small 4 KiB: a 200 KiB cap gives [wi], [q], [scale, small]
    one, _, g1, _ = _run(lambda: make(None), params, grads, "all:4", "d_model:all", None)
    cut, _, g, _ = _run(lambda: make(200 * 2 ** 10), params, grads, "all:4", "d_model:all", None)
    groups = [op for op in g.operations if isinstance(op, ForeachAdafactorGroupUpdate)]
    assert [op.n for op in groups] == [1, 1, 2]
    assert sum(isinstance(op, ForeachAdafactorGroupUpdate) for op in g1.operations) == 1
    for n in one:
        assert torch.equal(one[n], cut[n]), n

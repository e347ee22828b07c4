"""In-place variable state (issue 21): a run's assignments write into the variables' storage.

Every optimizer's step must leave each variable slice (parameters and slots) at the same
``data_ptr`` on the placement mesh, with the values a reference (the same graph on one processor,
and plain PyTorch for SGD) gives; lazily created lowerings draw nothing a restore sets first.
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch import optim
from meshtorch.lowering.donate import donatable_inputs, donated_mask
from meshtorch.ops import initializers

OPTIMIZERS = {
    "sgd": lambda: optim.SgdOptimizer(0.1),
    "momentum": lambda: optim.MomentumOptimizer(0.1, 0.9),
    "adam_unfused": lambda: optim.AdamOptimizer(0.01, fused=False),
    "adam_fused": lambda: optim.AdamOptimizer(0.01, fused=True),
    "adamw_unfused": lambda: optim.AdamWOptimizer(0.01, fused=False),
    "adamw_fused": lambda: optim.AdamWOptimizer(0.01, fused=True),
    "adafactor": lambda: optim.AdafactorOptimizer(min_dim_size_to_factor=4),
    "adafactor_unfused": lambda: optim.AdafactorOptimizer(min_dim_size_to_factor=4, fused=False),
}

LAYOUTS = [("", ""), ("all:2", "b:all"), ("rows:2;cols:2", "batch:rows;h:cols")]


def _model(opt_name, x_val, y_val, remat=False, with_grads=False):
    """A two-layer MLP with ``opt_name``'s updates: ``(graph, mesh, loss, updates)``, plus the gradients of w1 and
    w2 last with ``with_grads``; ``remat``: the first layer under ``mtf.recompute_grad``."""
    g = mtf.Graph(seed=1)
    mesh = mtf.Mesh(g, "m")
    x = mtf.import_tensor(mesh, x_val, "batch:8,a:8")
    y = mtf.import_tensor(mesh, y_val, "batch:8,b:4")
    w1 = mtf.get_variable(mesh, "w1", "a:8,h:8")
    w2 = mtf.get_variable(mesh, "w2", "h:8,b:4")

    def layer(t):
        return mtf.relu(mtf.einsum([t, w1], output_shape="batch:8,h:8"))
    h = mtf.recompute_grad(layer, [x]) if remat else layer(x)
    out = mtf.einsum([h, w2], output_shape="batch:8,b:4")
    loss = mtf.reduce_mean(mtf.square(out - y))
    grads = mtf.gradients([loss], [w1.operation.outputs[0], w2.operation.outputs[0]])
    updates = OPTIMIZERS[opt_name]().apply_grads(grads, [w1.operation, w2.operation])
    return (g, mesh, loss, updates, grads) if with_grads else (g, mesh, loss, updates)


def _ptrs(lw):
    return {n: [t.data_ptr() for t in lw.store.impl(n).local_slices(lw.store.values[n])] for n in lw.store.names}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_optimizer_step_keeps_variable_storage(opt_name):
    torch.manual_seed(0)
    x_val, y_val = torch.randn(8, 8), torch.randn(8, 4)
    ref = None
    for mesh_shape, layout in LAYOUTS:
        g, mesh, loss, updates = _model(opt_name, x_val, y_val)
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        before = _ptrs(lw)
        w0 = lw.variable_value("w1")
        losses = [lw.run([loss] + updates)[0].item() for _ in range(3)]
        assert _ptrs(lw) == before, f"{opt_name} on {mesh_shape!r} reallocated variable storage"
        assert not torch.equal(w0, lw.variable_value("w1"))  # value() is a copy, the update changed w1
        vals = {n: lw.variable_value(n) for n in lw.store.names}
        if ref is None:
            ref = losses, vals
        else:
            torch.testing.assert_close(losses, ref[0], rtol=1e-5, atol=1e-6)
            for n, v in vals.items():
                torch.testing.assert_close(v, ref[1][n], rtol=1e-5, atol=1e-6)


def test_sgd_in_place_matches_plain_pytorch_and_fetched_values_are_pre_run():
    torch.manual_seed(0)
    x_val, y_val = torch.randn(8, 8), torch.randn(8, 4)
    g, mesh, loss, updates = _model("sgd", x_val, y_val)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "")})
    w1 = torch.nn.Parameter(lw.variable_value("w1"))
    w2 = torch.nn.Parameter(lw.variable_value("w2"))
    opt = torch.optim.SGD([w1, w2], lr=0.1)
    for _ in range(3):
        fetched_w, got = lw.run([g.name_to_variable["w1"].outputs[0], loss] + updates)[:2]
        torch.testing.assert_close(fetched_w, w1.detach())  # the fetched value is from before the run
        opt.zero_grad()
        want = ((torch.relu(x_val @ w1) @ w2 - y_val) ** 2).mean()
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lw.variable_value("w1"), w1.detach(), rtol=1e-5, atol=1e-6)


def test_swap_in_place_reads_pre_run_values():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    x = mtf.get_variable(mesh, "x", "a:4", initializer=1.0)
    y = mtf.get_variable(mesh, "y", "a:4", initializer=2.0)
    swap = [mtf.assign(x, y), mtf.assign(y, x)]
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "")})
    lw.run(swap)
    assert torch.equal(lw.variable_value(x), torch.full((4,), 2.0))
    assert torch.equal(lw.variable_value(y), torch.full((4,), 1.0))


def _counting_draws(monkeypatch):
    drawn = []
    real = initializers._k_draw_slice

    def counting(*args, **kwargs):
        drawn.append(kwargs["key"])
        return real(*args, **kwargs)
    monkeypatch.setattr(initializers, "_k_draw_slice", counting)
    return drawn


def test_lazy_init_draws_nothing_that_is_set_and_the_rest_as_random(monkeypatch):
    torch.manual_seed(0)
    x_val, y_val = torch.randn(8, 8), torch.randn(8, 4)
    g, mesh, loss, updates = _model("adamw_fused", x_val, y_val)
    eager = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "b:all")})
    drawn = _counting_draws(monkeypatch)
    lazy = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "b:all")}, init="lazy")
    assert drawn == [] and all(v is None for v in lazy.store.values.values())
    lazy.set_variable_value("w1", eager.variable_value("w1"))
    assert drawn == []
    got = [lazy.run([loss] + updates)[0] for _ in range(2)]
    want = [eager.run([loss] + updates)[0] for _ in range(2)]
    assert drawn == ["w2", "w2"]  # only w2 (nothing set it), its two slices, when the first run read it
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="init must be"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}, init="meta")


def _donated(lw, fetches):
    """Names of the trainable variables whose update writes in place (one multi-tensor step may update several)."""
    plan = lw.session.plan(lw._fetch_keys(fetches))
    names = {s: n for n, s in plan.var_reads}
    return [names[st.inputs[j]] for st in plan.steps if st.kind == "slicewise"
            for j, d in zip(donatable_inputs(st), donated_mask(st), strict=False)
            if d and "/" not in names[st.inputs[j]]]


@pytest.mark.parametrize("remat", [False, True])
def test_fused_adam_updates_in_place_on_one_processor_and_on_shared_replicas_with_the_same_values(remat):
    """One processor and replicas sharing one tensor (all:2, replicated): both fused updates write in place (the
    replicas share one call). all:2 with ``b:all``: w1 is replicated but w2 split, so the two processors' calls
    differ and both read w1's one tensor: w1 is copied, w2 updated in place. Values are bitwise those of one
    processor. ``remat``: recompute_grad reads the weights through identities, dead before the update."""
    torch.manual_seed(0)
    x_val, y_val = torch.randn(8, 8), torch.randn(8, 4)
    runs = {}
    for mesh_shape, layout in [("", ""), ("all:2", ""), ("all:2", "b:all")]:
        g, mesh, loss, updates = _model("adamw_fused", x_val, y_val, remat=remat)
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        before = _ptrs(lw)
        losses = [lw.run([loss] + updates)[0].item() for _ in range(3)]
        assert _ptrs(lw) == before
        runs[layout or mesh_shape] = (losses, {n: lw.variable_value(n) for n in lw.store.names},
                                      _donated(lw, [loss] + updates))
    assert runs[""][2] == runs["all:2"][2] == ["w1", "w2"] and runs["b:all"][2] == ["w2"]
    for k, tol in (("all:2", 0), ("b:all", 1e-6)):  # b:all sums its split matmuls in another order
        torch.testing.assert_close(runs[""][0], runs[k][0], rtol=tol, atol=0)
        for n, v in runs[""][1].items():
            torch.testing.assert_close(v, runs[k][1][n], rtol=tol, atol=tol, msg=f"{n} on {k}")


@pytest.mark.parametrize("reader", ["matmul", "elementwise"])
def test_no_in_place_update_where_a_later_step_or_a_fetch_reads_the_variable(reader):
    torch.manual_seed(0)
    x_val, y_val = torch.randn(8, 8), torch.randn(8, 4)
    g, mesh, loss, updates = _model("adamw_fused", x_val, y_val)
    w1 = g.name_to_variable["w1"].outputs[0]
    # built after the update, so lowered after it: a matmul (a new tensor) or an elementwise op (maybe a view)
    ones = mtf.import_tensor(mesh, torch.ones(8), "a:8")
    probe = (mtf.reduce_sum(mtf.einsum([ones, w1], output_shape="h:8")) if reader == "matmul"
             else mtf.reduce_sum(mtf.square(w1)))
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    w_before = lw.variable_value("w1")
    total = lw.run([probe] + updates)[0]
    assert len(_donated(lw, [probe] + updates)) == 1  # w2's update only
    want = w_before.sum() if reader == "matmul" else (w_before ** 2).sum()
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)  # the pre-run value
    assert not torch.equal(lw.variable_value("w1"), w_before)
    fetched = lw.run([w1] + updates)[0]  # a fetched variable is not updated in place either
    assert len(_donated(lw, [w1] + updates)) == 1
    assert not torch.equal(lw.variable_value("w1"), fetched)


def test_memory_report_counts_in_place_updates_as_no_new_buffers():
    """Big weights, tiny batch: the peak is the update phase; in place (one processor, or replicas sharing one
    tensor) it holds no second copy of w, m, v; fetching w keeps its old value, so its update copies w (not m, v)."""
    from meshtorch.planning import memory_report
    g = mtf.Graph(seed=1)
    mesh = mtf.Mesh(g, "m")
    x = mtf.import_tensor(mesh, torch.randn(1, 256), "batch:1,a:256")
    w = mtf.get_variable(mesh, "w", "a:256,b:256")
    loss = mtf.reduce_sum(mtf.square(mtf.einsum([x, w], output_shape="batch:1,b:256")))
    updates = optim.AdamWOptimizer(0.01, fused=True).apply_grads(mtf.gradients([loss], [w]), [w.operation])
    reps = {(m, fetch_w): memory_report(mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(m, "")}, materialize=False),
                                        [loss] + updates + ([w] if fetch_w else []))
            for m in ("", "all:2") for fetch_w in (False, True)}
    w_bytes = 256 * 256 * 4  # the new w a copying update allocates
    for m in ("", "all:2"):
        assert reps[(m, True)].peak_activation_bytes - reps[(m, False)].peak_activation_bytes >= 0.95 * w_bytes
    assert reps[("", False)].peak_activation_bytes == reps[("all:2", False)].peak_activation_bytes


def test_compiled_fused_adam_writes_in_place_with_the_eager_values():
    """``mode="compile"``: the donated fused AdamW update writes into the variables' and slots' storage inside the
    compiled graph (input mutations), so the session's commit finds every new value already in place (no new
    buffers per step, as eager); losses equal the eager run's (1e-5 relative), variables too (1e-5 relative,
    1e-6 absolute: the compiled formula vs the fused kernel)."""
    torch.manual_seed(0)
    x_val, y_val = torch.randn(8, 8), torch.randn(8, 4)
    runs = {}
    for mode in ("codegen", "compile"):
        g, mesh, loss, updates = _model("adamw_fused", x_val, y_val)
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}, mode=mode)
        before, copied, commit = _ptrs(lw), [], lw.store.commit

        def recording(new_values, keep, commit=commit, lw=lw, copied=copied):
            copied.extend(n for n, v in new_values if [t.data_ptr() for t in lw.store.impl(n).local_slices(v)]
                          != [t.data_ptr() for t in lw.store.impl(n).local_slices(lw.store.values[n])])
            return commit(new_values, keep)
        lw.store.commit = recording
        losses = [lw.run([loss] + updates)[0].item() for _ in range(3)]
        assert _ptrs(lw) == before and set(copied) == {"global_step"}, (mode, copied)  # a new 0-dim int
        assert len(_donated(lw, [loss] + updates)) == 2
        runs[mode] = losses, {n: lw.variable_value(n) for n in lw.store.names}
    torch.testing.assert_close(runs["compile"][0], runs["codegen"][0], rtol=1e-5, atol=0)
    for n, v in runs["codegen"][1].items():
        torch.testing.assert_close(runs["compile"][1][n], v, rtol=1e-5, atol=1e-6)

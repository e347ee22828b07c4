"""gradients() on a small MLP and SGD/momentum training vs torch.optim, under several layouts."""

import pytest
import torch

import meshtorch as mtf

LAYOUTS = [("", ""), ("all:4", "batch:all"), ("all:4", "hidden:all"), ("rows:2;cols:2", "batch:rows;hidden:cols"),
           ("rows:2;cols:2", "hidden:rows;io:cols")]


def _mlp(mesh_shape, layout, opt):
    g = mtf.Graph(seed=3)
    mesh = mtf.Mesh(g, "m")
    batch, io, hidden = mtf.Dimension("batch", 8), mtf.Dimension("io", 4), mtf.Dimension("hidden", 16)
    x = mtf.placeholder(mesh, "x", [batch, io])
    t = mtf.placeholder(mesh, "t", [batch, io])
    w1 = mtf.get_variable(mesh, "w1", [io, hidden])
    b1 = mtf.get_variable(mesh, "b1", [hidden], initializer=0.1)
    w2 = mtf.get_variable(mesh, "w2", [hidden, io])
    h = mtf.tanh(mtf.einsum([x, w1], output_shape=[batch, hidden]) + b1)
    y = mtf.einsum([h, w2], output_shape=[batch, io]) + x  # x used twice: gradient paths accumulate
    loss = mtf.reduce_mean(mtf.square(y - t))
    variables = [w1, b1, w2]
    grads = mtf.gradients([loss], variables)
    updates = opt.apply_grads(grads, variables)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    return lw, x, t, loss, updates, variables


def _torch_run(lw, variables, opt_fn, xs, ts):
    params = [lw.variable_value(v).clone().requires_grad_(True) for v in variables]
    w1, b1, w2 = params
    opt = opt_fn(params)
    losses = []
    for x, t in zip(xs, ts, strict=True):
        loss = ((torch.tanh(x @ w1 + b1) @ w2 + x - t) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in params]


@pytest.mark.parametrize("kind", ["sgd", "momentum"])
def test_training_matches_torch_optim_under_every_layout(kind):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 4, generator=gen) for _ in range(5)]
    ts = [torch.randn(8, 4, generator=gen) for _ in range(5)]
    if kind == "sgd":
        opt, opt_fn = mtf.optim.SgdOptimizer(0.1), lambda p: torch.optim.SGD(p, lr=0.1)
    else:
        opt, opt_fn = mtf.optim.MomentumOptimizer(0.1, 0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
    for mesh_shape, layout in LAYOUTS:
        lw, x, t, loss, updates, variables = _mlp(mesh_shape, layout, opt)
        ref_losses, ref_params = _torch_run(lw, variables, opt_fn, xs, ts)
        losses = [lw.run([loss] + updates, feeds={x: xv, t: tv})[0].item() for xv, tv in zip(xs, ts, strict=True)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
        for v, p in zip(variables, ref_params, strict=True):
            torch.testing.assert_close(lw.variable_value(v), p, rtol=1e-5, atol=1e-6)


def test_gradient_of_unrelated_variable_is_none():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    a = mtf.get_variable(mesh, "a", "k:4")
    b = mtf.get_variable(mesh, "b", "k:4")
    ga, gb = mtf.gradients([mtf.reduce_sum(a * a)], [a, b])
    assert ga is not None and gb is None


def test_plan_counters_equal_executed_counters():
    lw, x, t, loss, updates, _ = _mlp("rows:2;cols:2", "batch:rows;hidden:cols", mtf.optim.SgdOptimizer(0.1))
    planned = lw.plan_counters([loss] + updates)
    for _ in range(3):
        lw.run([loss] + updates, feeds={x: torch.randn(8, 4), t: torch.randn(8, 4)})
    assert planned.count() > 0
    assert lw.counters.count() == 3 * planned.count()
    assert lw.counters.total_bytes() == 3 * planned.total_bytes()
    assert "allreduce" in lw.counters.summary()

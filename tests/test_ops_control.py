"""Control flow and autodiff helpers: custom_gradient, recompute_grad, depend, Print, while_loop."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


X = ("b:4,h:8", _r(4, 8, seed=1))
W = ("h:8,k:4", _r(8, 4, seed=2) * 0.5)
V = ("k:4,h:8", _r(4, 8, seed=3) * 0.5)


def _exp_grad(inputs, outputs, output_grads):
    return [outputs[0] * output_grads[0]]


def _matmul_grad(explicit_inputs, all_inputs, forward_operations, outputs, output_grads):
    x, w = all_inputs
    dy = output_grads[0]
    return [mtf.einsum([dy, w], output_shape=x.shape), mtf.einsum([x, dy], output_shape=w.shape)]


def _straight_through(inputs, outputs, output_grads):
    return [output_grads[0]]


def _block(x, w, v):
    """relu(x w) v: contracts h then k (lazy all-reduces when they are split)."""
    return mtf.einsum([mtf.relu(mtf.einsum([x, w], output_shape="b:4,k:4")), v], output_shape="b:4,h:8")


OP_CASES = [
    OpCase("custom_gradient_exp",
           lambda mesh, x: mtf.custom_gradient(mtf.exp, _exp_grad, [x]),
           {"x": X}, lambda x: torch.exp(x)),
    OpCase("custom_gradient_captured_variable",
           lambda mesh, x, w: mtf.custom_gradient(lambda a: mtf.einsum([a, w], output_shape="b:4,k:4"),
                                                  _matmul_grad, [x]),
           {"x": X, "w": W}, lambda x, w: x @ w),
    OpCase("custom_gradient_straight_through",
           lambda mesh, x: mtf.custom_gradient(mtf.sign, _straight_through, [x]) * x,
           {"x": X}, lambda x: (x + (torch.sign(x) - x).detach()) * x),
    OpCase("recompute_grad_block",
           lambda mesh, x, w, v: mtf.recompute_grad(lambda a: _block(a, w, v), [x]),
           {"x": X, "w": W, "v": V}, lambda x, w, v: torch.relu(x @ w) @ v),
    OpCase("recompute_grad_two_outputs",
           lambda mesh, x, w: mtf.recompute_grad(
               lambda a, b: [mtf.tanh(mtf.einsum([a, b], output_shape="b:4,k:4")), mtf.reduce_sum(a * a)], [x, w]),
           {"x": X, "w": W}, lambda x, w: [torch.tanh(x @ w), (x * x).sum()]),
    OpCase("depend",
           lambda mesh, x, y: mtf.depend(x * 2.0, [mtf.exp(y), y.operation]) + y,
           {"x": X, "y": ("b:4,h:8", _r(4, 8, seed=4))}, lambda x, y: x * 2.0 + y),
    OpCase("Print",
           lambda mesh, x, y: mtf.Print(x * 2.0, [x, y], "test print", summarize=2) * y,
           {"x": X, "y": ("b:4,h:8", _r(4, 8, seed=4))}, lambda x, y: x * 2.0 * y),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert ("rows:2;cols:2", "b:rows;h:cols") in layouts


# ---------------------------------------------------------------- custom_gradient / recompute_grad
def _counting_tanh(calls):
    def fn(t):
        calls.append(1)
        return torch.tanh(t)
    return fn


def _recompute_graph(recompute: bool, calls: list):
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=0.0)
    w = mtf.get_variable(mesh, "w", "h:8,k:4", initializer=0.0)
    v = mtf.get_variable(mesh, "v", "k:4,h:8", initializer=0.0)

    def fn(a):
        hid = mtf.einsum([a, w], output_shape="b:4,k:4")
        act = mtf.slicewise(_counting_tanh(calls), [hid], grad_function=lambda op, dy: [
            mtf.slicewise(lambda y, d: d * (1 - y * y), [op.outputs[0], dy], name="tanh_grad")], name="counted_tanh")
        return mtf.einsum([act, v], output_shape="b:4,h:8")

    y = mtf.recompute_grad(fn, [x]) if recompute else fn(x)
    loss = mtf.reduce_sum(y * y)
    grads = mtf.gradients([loss], [x, w, v])
    return g, mesh, [loss] + grads


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:4", "h:all"), ("rows:2;cols:2", "b:rows;k:cols")])
def test_recompute_grad_runs_forward_twice_same_gradients(mesh_shape, layout):
    results, counts = {}, {}
    for recompute in (False, True):
        calls = []
        g, mesh, fetches = _recompute_graph(recompute, calls)
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        for name, val in (("x", X[1]), ("w", W[1]), ("v", V[1])):
            lw.set_variable_value(name, val)
        results[recompute] = lw.run(fetches)
        # kernel calls: one per processor, or one for all when the inputs are replicated (shared tensors)
        counts[recompute] = len(calls)
        # the program holds the counted forward op once, or twice with recomputation
        counts[recompute, "steps"] = sum(st.op == "counted_tanh" for st in lw.steps)
    assert counts[False] >= 1 and counts[True] == 2 * counts[False]
    assert counts[False, "steps"] == 1 and counts[True, "steps"] == 2
    for a, b in zip(results[False], results[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_custom_gradient_errors():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8")
    y = mtf.custom_gradient(mtf.exp, lambda i, o, d: [mtf.reduce_sum(d[0], reduced_dim="h")], [x])
    with pytest.raises(mtf.ShapeError, match="gradient for 'x'"):
        mtf.gradients([mtf.reduce_sum(y)], [x])
    z = mtf.custom_gradient(mtf.exp, lambda i, o, d: [d[0], d[0]], [x])
    with pytest.raises(ValueError, match="returned 2 gradients for 1 inputs"):
        mtf.gradients([mtf.reduce_sum(z)], [x])


# ---------------------------------------------------------------- depend / Print
def test_depend_runs_dependencies_only_when_fetched():
    calls = []
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=1.0)
    side = mtf.slicewise(_counting_tanh(calls), [x * 3.0], name="side")
    y = x * 2.0
    d = mtf.depend(y, [side])
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "b:all")})
    torch.testing.assert_close(lw.run(y), torch.full((4, 8), 2.0))
    assert calls == []
    torch.testing.assert_close(lw.run(d), torch.full((4, 8), 2.0))
    assert len(calls) == 4  # once per processor


def test_depend_rejects_assignments():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4")
    with pytest.raises(ValueError, match="assignment"):
        mtf.depend(x * 2.0, [mtf.assign(x, x * 3.0)])


def test_print_prints_each_processor_slice(capsys):
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=0.0)
    y = mtf.Print(x + 1.0, [x], "hello", summarize=2)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "b:rows;h:cols")})
    lw.set_variable_value("x", torch.arange(32.0).reshape(4, 8))
    out = lw.run(y)
    torch.testing.assert_close(out, torch.arange(32.0).reshape(4, 8) + 1)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("hello")]
    assert len(lines) == 4
    # processor 3 = (row 1, col 1) holds rows 2-3, columns 4-7: first elements 20, 21
    assert "[processor 3] x=[20, 21, ...] shape=[2, 4]" in lines[3]
    assert "[processor 0] x=[0, 1, ...] shape=[2, 4]" in lines[0]


# ---------------------------------------------------------------- while_loop
LOOP_LAYOUTS = [("", ""), ("all:4", "b:all"), ("all:4", "h:all"), ("all:4", "k:all"),
                ("rows:2;cols:2", "b:rows;h:cols"), ("rows:2;cols:2", "h:rows;k:cols")]


def _i64(mesh, v):
    return mtf.constant(mesh, v, dtype=torch.int64)


def _loop_graph(n_iter, accumulate=True):
    """y <- tanh((y w) v) + x for n_iter steps; accumulators sum(y w) over b,h-contractions."""
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=0.0)
    w = mtf.get_variable(mesh, "w", "h:8,k:4", initializer=0.0)
    v = mtf.get_variable(mesh, "v", "k:4,h:8", initializer=0.0)

    def cond(i, y):
        return mtf.less(i, _i64(mesh, n_iter))

    def body(i, y):
        yw = mtf.einsum([y, w], output_shape="b:4,k:4")
        new_y = mtf.tanh(mtf.einsum([yw, v], output_shape="b:4,h:8")) + x
        out = [i + _i64(mesh, 1), new_y]
        if accumulate:
            out += [mtf.einsum([y, w], output_shape="k:4"), mtf.reduce_sum(y)]
        return out

    outs = mtf.while_loop(cond, body, [_i64(mesh, 0), x * 0.5], has_accumulators=accumulate)
    return g, mesh, outs


def _loop_reference(n_iter):
    x, w, v = X[1], W[1], V[1]
    y = x * 0.5
    acc_k, acc_s = torch.zeros(4), torch.zeros(())
    for _ in range(n_iter):
        acc_k = acc_k + (y @ w).sum(0)
        acc_s = acc_s + y.sum()
        y = torch.tanh((y @ w) @ v) + x
    return [torch.tensor(n_iter), y, acc_k, acc_s]


def _set_xwv(lw):
    for name, val in (("x", X[1]), ("w", W[1]), ("v", V[1])):
        if name in lw.variable_names:
            lw.set_variable_value(name, val)


@pytest.mark.parametrize("mesh_shape,layout", LOOP_LAYOUTS)
def test_while_loop_matches_python_loop(mesh_shape, layout):
    g, mesh, outs = _loop_graph(5)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    _set_xwv(lw)
    got = lw.run(outs)
    ref = _loop_reference(5)
    assert got[0].item() == 5
    for a, b in zip(got[1:], ref[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # zero iterations: the loop values come back unchanged, the accumulators are zero
    g0, mesh0, outs0 = _loop_graph(0)
    lw0 = mtf.Lowering(g0, {mesh0: mtf.PlacementMeshImpl(mesh_shape, layout)})
    _set_xwv(lw0)
    got0 = lw0.run(outs0)
    torch.testing.assert_close(got0[1], X[1] * 0.5)
    assert torch.count_nonzero(got0[2]) == 0 and got0[3].item() == 0


def test_while_loop_accumulator_allreduce_happens_once_after_loop():
    # h split over 'all': the accumulators contract h (partial sums); the loop values never do
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=0.0)
    w = mtf.get_variable(mesh, "w", "h:8,k:4", initializer=0.0)

    def body(i, y):
        return [i + _i64(mesh, 1), y * 0.5 + x, mtf.einsum([y, w], output_shape="k:4"), mtf.reduce_sum(y)]

    i, y, acc_k, acc_s = mtf.while_loop(lambda i, y: mtf.less(i, _i64(mesh, 5)), body, [_i64(mesh, 0), x],
                                        has_accumulators=True)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "h:all")})
    _set_xwv(lw)
    got = lw.run([y, acc_k, acc_s])
    ry, rk, rs = X[1], torch.zeros(4), torch.zeros(())
    for _ in range(5):
        rk, rs, ry = rk + (ry @ W[1]).sum(0), rs + ry.sum(), ry * 0.5 + X[1]
    for a, b in zip(got, [ry, rk, rs], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # one all-reduce per accumulator after 5 iterations (not one per iteration)
    allreduces = lw.counters.collectives("allreduce")
    assert sorted(n for _, n in allreduces) == [1, 1], lw.counters.summary()
    assert {c.tensor for c, _ in allreduces} == {acc_k.name, acc_s.name}
    listing = lw.program_str()  # the loop step lists its sub-programs; the all-reduces come after it
    assert "body:" in listing and "cond:" in listing
    assert listing.index("while_loop ") < listing.index("allreduce")
    # a lazy sum forced inside the body (a loop value) is all-reduced every iteration
    lw.counters.reset()
    g2 = mtf.Graph()
    mesh2 = mtf.Mesh(g2)
    x2 = mtf.get_variable(mesh2, "x", "b:4,h:8", initializer=0.0)
    w2 = mtf.get_variable(mesh2, "w", "h:8,k:4", initializer=0.0)

    def body2(i, s):
        return [i + _i64(mesh2, 1), s + mtf.einsum([x2, w2], output_shape="k:4") * 0.0 + mtf.reduce_sum(x2 * 1.0)]

    _, s2 = mtf.while_loop(lambda i, s: mtf.less(i, _i64(mesh2, 5)), body2,
                           [_i64(mesh2, 0), mtf.zeros(mesh2, "k:4")])
    lw2 = mtf.Lowering(g2, {mesh2: mtf.PlacementMeshImpl("all:4", "h:all")})
    _set_xwv(lw2)
    torch.testing.assert_close(lw2.run(s2), torch.full((4,), 5 * X[1].sum().item()), rtol=1e-5, atol=1e-5)
    assert lw2.counters.count("allreduce") == 5 * 2, lw2.counters.summary()


def test_while_loop_captured_lazy_sum_is_reduced_once_before_the_loop():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=0.0)
    w = mtf.get_variable(mesh, "w", "h:8,k:4", initializer=0.0)
    xw = mtf.einsum([x, w], output_shape="b:4,k:4")  # lazy partial sums under h:all
    _, acc = mtf.while_loop(lambda i, a: mtf.less(i, _i64(mesh, 5)),
                            lambda i, a: [i + _i64(mesh, 1), a + mtf.tanh(xw)],
                            [_i64(mesh, 0), mtf.zeros(mesh, "b:4,k:4")])
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "h:all")})
    _set_xwv(lw)
    torch.testing.assert_close(lw.run(acc), 5 * torch.tanh(X[1] @ W[1]), rtol=1e-5, atol=1e-5)
    assert lw.counters.count("allreduce") == 1, lw.counters.summary()


def test_nested_while_loop_and_num_loop_vars():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=0.0)

    def inner(y):
        _, y2 = mtf.while_loop(lambda j, z: mtf.less(j, _i64(mesh, 2)),
                               lambda j, z: [j + _i64(mesh, 1), z * 2.0 + x], [_i64(mesh, 0), y])
        return y2

    outs = mtf.while_loop(lambda i, y, c: mtf.less(i, _i64(mesh, 3)),
                          lambda i, y, c: [i + _i64(mesh, 1), inner(y), c + 1.0],
                          [_i64(mesh, 0), x, mtf.zeros(mesh, "")], num_loop_vars=2)
    assert len(outs) == 2
    ref = X[1]
    for _ in range(6):
        ref = ref * 2.0 + X[1]
    for mesh_shape, layout in LOOP_LAYOUTS[:3]:
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        lw.set_variable_value("x", X[1])
        i, y = lw.run(outs)
        assert i.item() == 3
        torch.testing.assert_close(y, ref)


def test_plan_counters_with_loop_iterations_equal_executed_counters():
    """plan_counters(loop_iterations=...) counts nested loop bodies and conditions as run() executes them."""
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=0.0)
    w = mtf.get_variable(mesh, "w", "h:8,k:4", initializer=0.0)

    def inner(s):  # the contraction over h is all-reduced every inner iteration (a loop value needs it)
        _, s2 = mtf.while_loop(lambda j, t: mtf.less(j, _i64(mesh, 2)),
                               lambda j, t: [j + _i64(mesh, 1), t + mtf.einsum([x, w], output_shape="k:4")],
                               [_i64(mesh, 0), s], name="inner")
        return s2

    outs = mtf.while_loop(lambda i, s: mtf.less(i, _i64(mesh, 3)),
                          lambda i, s: [i + _i64(mesh, 1), inner(s) + mtf.reduce_sum(x * 1.0)],
                          [_i64(mesh, 0), mtf.zeros(mesh, "k:4")], name="outer")
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "h:all")})
    _set_xwv(lw)
    assert lw.plan_counters(outs).count("allreduce") == 0  # default: loop bodies count zero times
    planned = lw.plan_counters(outs, loop_iterations={"outer": 3, "inner": 2})
    got = lw.run(outs)
    torch.testing.assert_close(got[1], 6 * (X[1] @ W[1]).sum(0) + 3 * X[1].sum(), rtol=1e-5, atol=1e-5)
    assert lw.counters.count("allreduce") == 3 * 2 + 3, lw.counters.summary()
    assert dict(planned.records) == dict(lw.counters.records)
    assert planned.einsum_flops == lw.counters.einsum_flops > 0
    # one int for every loop: 2 outer x 2 inner
    assert lw.plan_counters(outs, loop_iterations=2).count("allreduce") == 2 * 2 + 2
    with pytest.raises(ValueError, match=r"'decoder'.*'inner', 'outer'"):
        lw.plan_counters(outs, loop_iterations={"decoder": 3})
    with pytest.raises(ValueError, match="trip count"):
        lw.plan_counters(outs, loop_iterations={"outer": -1})


def test_while_loop_errors():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8")
    i0 = _i64(mesh, 0)
    with pytest.raises(mtf.ShapeError, match="scalar"):
        mtf.while_loop(lambda i, y: y, lambda i, y: [i, y], [i0, x])
    with pytest.raises(mtf.ShapeError, match="body output 1"):
        mtf.while_loop(lambda i, y: mtf.less(i, i0), lambda i, y: [i, mtf.reduce_sum(y, reduced_dim="h")], [i0, x])
    with pytest.raises(ValueError, match="has_accumulators"):
        mtf.while_loop(lambda i, y: mtf.less(i, i0), lambda i, y: [i, y, y], [i0, x])
    with pytest.raises(ValueError, match="assignments"):
        mtf.while_loop(lambda i, y: mtf.less(i, i0), lambda i, y: [i, mtf.assign(x, y).inputs[0]], [i0, x])
    inside = []

    def body(i, y):
        inside.append(y * x)
        return [i + _i64(mesh, 1), inside[-1]]

    _, y = mtf.while_loop(lambda i, y: mtf.less(i, _i64(mesh, 2)), body, [i0, x])
    with pytest.raises(NotImplementedError, match="no gradient"):
        mtf.gradients([mtf.reduce_sum(y)], [x])
    leaked = inside[0] + 1.0  # a body tensor used outside the loop
    with pytest.raises(ValueError, match="inside a while_loop"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    g.operations.remove(leaked.operation)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    with pytest.raises(ValueError, match="inside a while_loop"):
        lw.run(inside[0])


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:4", "b:all"), ("all:4", "h:all"),
                                               ("rows:2;cols:2", "b:rows;k:cols")])
def test_while_loop_accumulates_microbatch_gradients(mesh_shape, layout):
    """Mesh TF's serialize_training_step pattern: per-microbatch gradients summed by accumulators."""
    xs = _r(3, 4, 8, seed=7)
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "mb:3,b:4,h:8", initializer=0.0, trainable=False)
    w = mtf.get_variable(mesh, "w", "h:8,k:4", initializer=0.0)

    def body(i, _):
        xi = mtf.einsum([x, mtf.one_hot(i, mtf.Dimension("mb", 3))], output_shape="b:4,h:8")
        loss = mtf.reduce_sum(mtf.square(mtf.tanh(mtf.einsum([xi, w], output_shape="b:4,k:4"))))
        (gw,) = mtf.gradients([loss], [w])
        return [i + _i64(mesh, 1), loss, gw, loss]

    _, _, gw, total = mtf.while_loop(lambda i, _: mtf.less(i, _i64(mesh, 3)), body,
                                     [_i64(mesh, 0), mtf.zeros(mesh, "")], has_accumulators=True)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    lw.set_variable_value("x", xs)
    lw.set_variable_value("w", W[1])
    got_gw, got_total = lw.run([gw, total])
    wr = W[1].clone().requires_grad_(True)
    ref = (torch.tanh(xs @ wr) ** 2).sum()
    (ref_gw,) = torch.autograd.grad(ref, [wr])
    torch.testing.assert_close(got_total, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_gw, ref_gw, rtol=1e-5, atol=1e-5)
    if layout == "b:all":  # the gradient contracts the split batch: one all-reduce, after the loop
        grad_reduces = [n for c, n in lw.counters.collectives("allreduce") if c.tensor == gw.name]
        assert grad_reduces == [1], lw.counters.summary()


def test_recompute_grad_with_variables_created_inside_and_input_passthrough():
    def build(recompute):
        g = mtf.Graph(seed=5)
        mesh = mtf.Mesh(g)
        x = mtf.get_variable(mesh, "x", "b:4,h:8", initializer=0.0)

        def fn(a):
            return [mtf.layers.dense(a, mtf.Dimension("k", 4), activation=mtf.tanh, name="d"), a]

        y, same = mtf.recompute_grad(fn, [x]) if recompute else fn(x)
        loss = mtf.reduce_sum(y * y) + mtf.reduce_sum(same * x)
        variables = [x] + [v.outputs[0] for v in g.trainable_variables if v.name != "x"]
        return g, mesh, [loss] + mtf.gradients([loss], variables)

    results = []
    for recompute in (False, True):
        g, mesh, fetches = build(recompute)
        assert len(g.trainable_variables) == 3  # x, d/kernel, d/bias: created once, kept out of the recomputation
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "b:rows;k:cols")})
        lw.set_variable_value("x", X[1])
        lw.set_variable_value("d/bias", torch.linspace(-1, 1, 4))
        results.append(lw.run(fetches))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b)
    assert torch.count_nonzero(results[1][2]) > 0  # the kernel gets a gradient through the recomputation

"""Random ops and dropout: layout-invariant (bitwise), fresh per run, statistically sane."""

import math

import pytest
import torch

import meshtorch as mtf
from meshtorch.ops.random import random_reference
from meshtorch.testing import OpCase, enumerate_layouts, run_layout

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
XIN = {"x": ("b:4,h:8", X)}


def _ref(kind, shape, key, **params):
    return lambda **_: random_reference(kind, shape, key=key, **params)


def _drop_ref(keep, noise="b:4,h:8", transpose=False, key="drop"):
    def ref(x):
        mask = random_reference("uniform", noise, key=key) < keep
        mask = mask.T if transpose else mask
        return x * mask / keep
    return ref


OP_CASES = [
    OpCase("random_uniform", lambda mesh: mtf.random_uniform(mesh, "b:4,h:8", name="u"), {},
           _ref("uniform", "b:4,h:8", "u")),
    OpCase("random_uniform_bounds_seed", lambda mesh: mtf.random_uniform(mesh, "b:4,h:8", -2.0, 3.0, seed=7), {},
           _ref("uniform", "b:4,h:8", "seed=7", minval=-2.0, maxval=3.0)),
    OpCase("random_uniform_int", lambda mesh: mtf.random_uniform(mesh, "b:4,h:8", 3, 10, torch.int64, name="i"),
           {}, _ref("uniform", "b:4,h:8", "i", minval=3, maxval=10, dtype=torch.int64)),
    OpCase("random_normal", lambda mesh: mtf.random_normal(mesh, "b:4,h:8", 1.0, 2.0, name="n"), {},
           _ref("normal", "b:4,h:8", "n", mean=1.0, stddev=2.0)),
    OpCase("truncated_normal", lambda mesh: mtf.truncated_normal(mesh, "b:4,h:8", stddev=0.5, name="t"), {},
           _ref("truncated_normal", "b:4,h:8", "t", stddev=0.5)),
    OpCase("dropout", lambda mesh, x: mtf.dropout(x, keep_prob=0.75, name="drop"), XIN, _drop_ref(0.75)),
    OpCase("dropout_rate", lambda mesh, x: mtf.dropout(x, rate=0.5, name="drop"), XIN, _drop_ref(0.5)),
    OpCase("dropout_noise_shape", lambda mesh, x: mtf.dropout(x, keep_prob=0.5, noise_shape="h:8", name="drop"), XIN,
           _drop_ref(0.5, "h:8")),
    OpCase("dropout_noise_shape_reordered",
           lambda mesh, x: mtf.dropout(x, keep_prob=0.5, noise_shape="h:8,b:4", name="drop"), XIN,
           _drop_ref(0.5, "h:8,b:4", transpose=True)),
    OpCase("dropout_then_einsum", lambda mesh, x: mtf.reduce_sum(mtf.dropout(x * 2.0, keep_prob=0.6, name="drop"),
                                                                 reduced_dim="h"), XIN,
           lambda x: _drop_ref(0.6)(x * 2.0).sum(1)),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert ("", "") in layouts and any(m == "rows:2;cols:2" for m, _ in layouts)


BITWISE = [
    ("uniform", lambda mesh: mtf.random_uniform(mesh, "b:4,h:8,c:4"), {}),
    ("normal", lambda mesh: mtf.random_normal(mesh, "b:4,h:8,c:4", 0.5, 3.0), {}),
    ("truncated", lambda mesh: mtf.truncated_normal(mesh, "b:4,h:8,c:4"), {}),
    ("int", lambda mesh: mtf.random_uniform(mesh, "b:4,h:8,c:4", 0, 1000, torch.int32), {}),
    ("dropout", lambda mesh, x: mtf.dropout(x, keep_prob=0.5, noise_shape="h:8"), XIN),
    ("sample", lambda mesh, x: mtf.sample_with_temperature(x, "h", 1.0), XIN),
]


@pytest.mark.parametrize("name,build,inputs", BITWISE, ids=[b[0] for b in BITWISE])
def test_bitwise_identical_under_every_layout(name, build, inputs):
    layouts = enumerate_layouts(build, inputs)
    assert len(layouts) >= 5
    base = None
    for mesh_shape, layout in layouts:
        (out,), _, _ = run_layout(build, inputs, mesh_shape, layout, grad=False)
        if base is None:
            base = out
        assert torch.equal(out, base), f"{name}: {mesh_shape!r} {layout!r} differs from one processor"


def _run_twice(build, inputs, mesh_shape, layout, with_grad=False):
    """Two runs of one lowering; returns ([outputs run 0], [outputs run 1], lowering)."""
    g = mtf.Graph(seed=3)
    mesh = mtf.Mesh(g)
    ts = {n: mtf.get_variable(mesh, n, s, initializer=0.0) for n, (s, _) in inputs.items()}
    y = build(mesh, **ts)
    fetches = [y]
    if with_grad:
        cot = mtf.import_tensor(mesh, torch.linspace(-1, 1, y.size).reshape(y.shape.to_integer_list()), y.shape)
        fetches += mtf.gradients([mtf.reduce_sum(y * cot)], [ts["x"]])
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    for n, (_, v) in inputs.items():
        lw.set_variable_value(n, v)
    r0 = lw.run(fetches)
    r1 = lw.run(fetches)
    return r0, r1, lw


def test_fresh_draws_each_run_identical_across_layouts():
    build = lambda mesh, x: mtf.dropout(x, keep_prob=0.5)  # noqa: E731
    runs = [_run_twice(build, XIN, m, lay, with_grad=True)
            for m, lay in [("", ""), ("all:4", "h:all"), ("all:4", "b:all"), ("rows:2;cols:2", "h:rows;b:cols")]]
    (y0, g0), (y1, g1), lw = runs[0]
    assert lw.run_count == 2
    assert not torch.equal(y0 != 0, y1 != 0), "a new run must draw a new mask"
    for r0, r1, _ in runs[1:]:
        assert torch.equal(r0[0], y0) and torch.equal(r1[0], y1) and torch.equal(r1[1], g1)
    # gradient at run 1 uses run 1's mask (recomputed): dy * mask / keep
    cot = torch.linspace(-1, 1, 32).reshape(4, 8)
    assert torch.allclose(g1, cot * (y1 != 0) / 0.5)
    assert torch.allclose(g0, cot * (y0 != 0) / 0.5)
    r = _run_twice(lambda mesh: mtf.random_normal(mesh, "b:4,h:8"), {}, "all:4", "h:all")
    assert not torch.equal(r[0][0], r[1][0])


def test_run_count_replays_a_run():
    g = mtf.Graph(seed=1)
    mesh = mtf.Mesh(g)
    u = mtf.random_uniform(mesh, "b:4,h:8")
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "h:all")})
    first, second = lw.run(u), lw.run(u)
    lw.run_count = 0
    assert torch.equal(lw.run(u), first) and torch.equal(lw.run(u), second)
    assert torch.equal(first, random_reference("uniform", "b:4,h:8", seed=1, key=u.operation.name, run=0))


def test_keys_seed_and_graph_seed_change_values():
    def draw(graph_seed, **kw):
        g = mtf.Graph(seed=graph_seed)
        mesh = mtf.Mesh(g)
        a = mtf.random_uniform(mesh, "n:64", **kw)
        b = mtf.random_uniform(mesh, "n:64", **kw)
        return mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}).run([a, b])
    a, b = draw(0)
    assert not torch.equal(a, b)  # two ops, two names, two streams
    assert not torch.equal(draw(1)[0], a)  # graph seed matters
    a, b = draw(0, seed=5)
    assert torch.equal(a, b)  # one explicit op seed, one stream (as TF op seeds)


def _sample(build):
    g = mtf.Graph(seed=11)
    mesh = mtf.Mesh(g)
    y = build(mesh)
    return mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}).run(y).double()


def test_distributions_are_sane():
    u = _sample(lambda mesh: mtf.random_uniform(mesh, "a:256,b:256"))
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.std() - math.sqrt(1 / 12)) < 0.003
    assert abs((u < 0.1).double().mean() - 0.1) < 0.005
    n = _sample(lambda mesh: mtf.random_normal(mesh, "a:256,b:256", 2.0, 3.0))
    assert abs(n.mean() - 2.0) < 0.04 and abs(n.std() - 3.0) < 0.04
    assert abs(((n - 2.0).abs() < 3.0).double().mean() - 0.6827) < 0.006
    t = _sample(lambda mesh: mtf.truncated_normal(mesh, "a:256,b:256"))
    assert t.abs().max() <= 2.0 and abs(t.mean()) < 0.01 and abs(t.std() - 0.8796) < 0.01
    i = _sample(lambda mesh: mtf.random_uniform(mesh, "a:256,b:256", -3, 5, torch.int64))
    counts = torch.bincount((i + 3).long().reshape(-1), minlength=8).double() / i.numel()
    assert i.min() == -3 and i.max() == 4 and (counts - 1 / 8).abs().max() < 0.005


def test_dropout_keep_rate_and_scale():
    y = _sample(lambda mesh: mtf.dropout(mtf.ones(mesh, "a:256,b:256"), keep_prob=0.3))
    kept = y != 0
    assert abs(kept.double().mean() - 0.3) < 0.005
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.3))
    y = _sample(lambda mesh: mtf.dropout(mtf.ones(mesh, "a:256,b:256"), rate=0.3, noise_shape="b:256"))
    assert torch.equal(y, y[:1].expand_as(y))  # one mask, broadcast over a
    assert abs((y[0] != 0).double().mean() - 0.7) < 0.06


def test_sample_with_temperature_matches_softmax():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def build(mesh):
        logits = mtf.import_tensor(mesh, p.log().expand(8000, 4).contiguous(), "n:8000,c:4")
        return mtf.sample_with_temperature(logits, "c")
    s = _sample(build)
    freq = torch.bincount(s.long(), minlength=4).double() / s.numel()
    assert (freq - p.double()).abs().max() < 0.015
    # high temperature flattens, low temperature sharpens
    for temp, check in ((100.0, lambda f: (f - 0.25).abs().max() < 0.03), (0.05, lambda f: f[3] > 0.99)):
        def build_t(mesh, temp=temp):
            logits = mtf.import_tensor(mesh, p.log().expand(4000, 4).contiguous(), "n:4000,c:4")
            return mtf.sample_with_temperature(logits, "c", temp)
        s = _sample(build_t)
        assert check(torch.bincount(s.long(), minlength=4).double() / s.numel())


def test_dropout_identity_cases_and_errors():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,h:8")
    assert mtf.dropout(x, is_training=False, keep_prob=0.5) is x
    assert mtf.dropout(x, keep_prob=1.0) is x
    with pytest.raises(ValueError, match="exactly one"):
        mtf.dropout(x, keep_prob=0.5, rate=0.5)
    with pytest.raises(ValueError, match="exactly one"):
        mtf.dropout(x)
    with pytest.raises(ValueError, match="keep_prob"):
        mtf.dropout(x, rate=1.0)
    with pytest.raises(mtf.ShapeError, match="noise_shape"):
        mtf.dropout(x, keep_prob=0.5, noise_shape="c:8")
    with pytest.raises(mtf.ShapeError, match="noise_shape"):
        mtf.dropout(x, keep_prob=0.5, noise_shape="h:4")
    with pytest.raises(ValueError, match="maxval"):
        mtf.random_uniform(mesh, "b:4", dtype=torch.int64)
    with pytest.raises(TypeError, match="floating"):
        mtf.random_normal(mesh, "b:4", dtype=torch.int64)
    with pytest.raises(ValueError, match="temperature"):
        mtf.sample_with_temperature(x, "h", -1.0)

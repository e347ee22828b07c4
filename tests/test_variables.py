"""Variables, initializers, run semantics, imports, constants and one_hot."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase

LAYOUTS = [("", ""), ("all:4", "a:all"), ("all:4", "b:all"), ("rows:2;cols:2", "a:rows;b:cols"),
           ("rows:2;cols:2", "b:rows;a:cols")]

INITS = {
    "normal": mtf.random_normal_initializer(0.5, 2.0),
    "truncated": mtf.truncated_normal_initializer(0.0, 1.0),
    "uniform": mtf.random_uniform_initializer(-1.0, 3.0),
    "variance_scaling": mtf.VarianceScalingInitializer(2.0, "fan_avg", "truncated_normal"),
    "glorot": None,
    "ones": mtf.ones_initializer(),
    "constant": mtf.constant_initializer(0.25),
}


def _init_value(init, mesh_shape, layout, seed=0):
    g = mtf.Graph(seed=seed)
    mesh = mtf.Mesh(g, "m")
    w = mtf.get_variable(mesh, "w", "a:64,b:128", initializer=init)
    return mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}).variable_value(w)


@pytest.mark.parametrize("name", list(INITS))
def test_initial_values_bitwise_identical_under_every_layout(name):
    vals = [_init_value(INITS[name], m, lay) for m, lay in LAYOUTS]
    for v in vals[1:]:
        assert torch.equal(v, vals[0])


def test_initializer_statistics():
    v = _init_value(mtf.random_normal_initializer(0.5, 2.0), "", "")
    assert abs(v.mean().item() - 0.5) < 0.05 and abs(v.std().item() - 2.0) < 0.05
    t = _init_value(mtf.truncated_normal_initializer(0.0, 1.0), "", "")
    assert t.abs().max() <= 2.0 and 0.8 < t.std().item() < 0.9  # std of N(0,1) truncated at 2 sigma: 0.88
    u = _init_value(mtf.random_uniform_initializer(-1.0, 3.0), "", "")
    assert u.min() >= -1.0 and u.max() < 3.0 and abs(u.mean().item() - 1.0) < 0.05
    glorot = _init_value(None, "", "")
    limit = (6.0 / (64 + 128)) ** 0.5
    assert glorot.abs().max() <= limit and abs(glorot.var().item() - limit ** 2 / 3) < 0.1 * limit ** 2 / 3
    vs = _init_value(mtf.VarianceScalingInitializer(1.0, "fan_in", "normal", reduced_dims=["a"], new_dims=["b"]),
                     "", "")
    assert abs(vs.var().item() - 1 / 64) < 0.1 / 64


def test_seed_and_name_change_values():
    a = _init_value(None, "", "", seed=0)
    assert not torch.equal(a, _init_value(None, "", "", seed=1))


def test_reads_see_pre_run_values_and_assignments_commit_together():
    """A momentum-like pair of updates in one run: both read pre-run values (no order race)."""
    for mesh_shape, layout in [("", ""), ("all:4", "a:all"), ("rows:2;cols:2", "a:rows;b:cols")]:
        g = mtf.Graph()
        mesh = mtf.Mesh(g, "m")
        x = mtf.get_variable(mesh, "x", "a:4,b:8", initializer=1.0)
        y = mtf.get_variable(mesh, "y", "a:4,b:8", initializer=2.0)
        swap = [mtf.assign(x, y), mtf.assign(y, x)]
        total = mtf.reduce_sum(x)
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        t0, *_ = lw.run([total] + swap)
        assert t0.item() == 32.0  # read before the assignments
        assert torch.equal(lw.variable_value(x), torch.full((4, 8), 2.0))
        assert torch.equal(lw.variable_value("y"), torch.full((4, 8), 1.0))


def test_set_variable_value_assign_add_sub_and_transposed_assign():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    w = mtf.get_variable(mesh, "w", "a:4,b:8", initializer=0.0)
    d = mtf.import_tensor(mesh, torch.arange(32.0).reshape(8, 4), "b:8,a:4")
    add = mtf.assign_add(w, d)
    sub = mtf.assign_sub(w, mtf.ones(mesh, "a:4,b:8"))
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "a:rows;b:cols")})
    start = torch.randn(4, 8)
    lw.set_variable_value(w, start)
    lw.run(add)
    torch.testing.assert_close(lw.variable_value(w), start + torch.arange(32.0).reshape(8, 4).T)
    lw.run(sub)
    torch.testing.assert_close(lw.variable_value(w), start + torch.arange(32.0).reshape(8, 4).T - 1)
    with pytest.raises(mtf.FeedError, match="'w'"):
        lw.set_variable_value("w", torch.zeros(8, 4))
    with pytest.raises(KeyError, match="nope"):
        lw.variable_value("nope")


def test_assign_shape_mismatch_names_variable():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    w = mtf.get_variable(mesh, "weights", "a:4,b:8")
    with pytest.raises(mtf.ShapeError, match="'weights'"):
        mtf.assign(w, mtf.zeros(mesh, "a:4"))


def test_duplicate_variable_name():
    """Mesh TF's get_variable returns the existing variable of that (scoped) name; another shape is an error,
    and so is a name an operation already took."""
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    w = mtf.get_variable(mesh, "w", "a:4")
    assert mtf.get_variable(mesh, "w", "a:4") is w and len(g.all_variables) == 1
    with pytest.raises(mtf.ShapeError, match="'w'"):
        mtf.get_variable(mesh, "w", "a:5")
    mtf.placeholder(mesh, "x", "a:4")
    with pytest.raises(ValueError, match="'x'"):
        mtf.get_variable(mesh, "x", "a:4")


_IDX = torch.tensor([[0, 5, 11, 3], [7, 7, 2, 9]])

OP_CASES = [
    OpCase("one_hot", lambda m, i: mtf.one_hot(i, mtf.Dimension("k", 12)), {"i": ("b:2,s:4", _IDX)},
           lambda i: torch.nn.functional.one_hot(i, 12).float(), grad=False),
    OpCase("one_hot_on_off", lambda m, i: mtf.one_hot(i, mtf.Dimension("k", 12), on_value=0.9, off_value=0.01),
           {"i": ("b:2,s:4", _IDX)}, lambda i: torch.nn.functional.one_hot(i, 12).float() * 0.89 + 0.01,
           grad=False),
    OpCase("import_and_constants", lambda m, x: x * mtf.import_tensor(m, torch.arange(8.0), "h:8")
           + mtf.constant(m, 0.5, "b:4,h:8") + mtf.ones(m, "h:8") - mtf.zeros(m, "b:4"),
           {"x": ("b:4,h:8", torch.randn(4, 8))}, lambda x: x * torch.arange(8.0) + 0.5 + 1.0),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    case.check()

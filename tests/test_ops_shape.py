"""Shape ops (slice, pad, concat, split, stack, unstack, add_n, where, shift, cumsum, range):
values and gradients under every legal layout vs plain PyTorch, collectives, and errors."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.core.errors import ShapeError
from meshtorch.testing import OpCase, run_layout


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _shift_ref(x, offset, dim, wrap):
    if wrap:
        return torch.roll(x, offset, dim)
    n = x.shape[dim]
    out = torch.zeros_like(x)
    idx = torch.arange(n)
    src = idx - offset
    ok = (src >= 0) & (src < n)
    out.index_copy_(dim, idx[ok], x.index_select(dim, src[ok]))
    return out


def _excl(c, x, dim):
    return torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), c.narrow(dim, 0, x.shape[dim] - 1)], dim)


_NAN_X = _r(4, 8, seed=3)
_COND = _r(4, 8, seed=4) > 0
_NAN_X[~_COND] = float("nan")
_NAN_X[0, ~_COND[0]] = float("inf")

X48 = ("b:4,s:8", _r(4, 8))
X416 = ("b:4,s:16", _r(4, 16, seed=1))

OP_CASES = [
    OpCase("slice", lambda mesh, x: mtf.slice(x, 2, 4, "s"), {"x": X48}, lambda x: x[:, 2:6]),
    OpCase("slice_dim_object", lambda mesh, x: mtf.slice(x, 0, 4, mtf.Dimension("b", 4)) * 2.0, {"x": X48},
           lambda x: x * 2.0),
    OpCase("pad", lambda mesh, x: mtf.pad(x, [3, 1], "s"), {"x": X48},
           lambda x: torch.nn.functional.pad(x, (3, 1))),
    OpCase("concat", lambda mesh, x, y: mtf.concat([x, y], "s"),
           {"x": X48, "y": ("b:4,s:4", _r(4, 4, seed=2))}, lambda x, y: torch.cat([x, y], 1)),
    OpCase("split_sizes", lambda mesh, x: mtf.split(x, "s", [4, 8]), {"x": ("b:4,s:12", _r(4, 12))},
           lambda x: list(torch.split(x, [4, 8], 1))),
    OpCase("split_num", lambda mesh, x: mtf.split(x, mtf.Dimension("s", 12), 3)[1:],
           {"x": ("b:4,s:12", _r(4, 12))}, lambda x: list(torch.split(x, 4, 1))[1:]),
    OpCase("stack", lambda mesh, x, y: mtf.stack([x, y * 2.0, x * y, y], "k", axis=1),
           {"x": X48, "y": ("b:4,s:8", _r(4, 8, seed=5))}, lambda x, y: torch.stack([x, y * 2, x * y, y], 1)),
    OpCase("unstack", lambda mesh, x: mtf.unstack(x, "k")[1:], {"x": ("b:4,k:4,s:8", _r(4, 4, 8))},
           lambda x: list(x.unbind(1))[1:]),
    OpCase("add_n", lambda mesh, x, y, z: mtf.add_n([x, y, z]),
           {"x": X48, "y": ("s:8", _r(8, seed=6)), "z": ("b:4,s:8", _r(4, 8, seed=7))},
           lambda x, y, z: x + y + z),
    OpCase("add_n_partial_sums", lambda mesh, x, w: mtf.add_n([mtf.einsum([x, w], output_shape="b:4"),
                                                               mtf.reduce_sum(x, output_shape="b:4")]),
           {"x": X48, "w": ("s:8", _r(8, seed=6))}, lambda x, w: x @ w + x.sum(1)),
    OpCase("where_nan_branch", lambda mesh, c, x, y: mtf.where(c, x, y),
           {"c": ("b:4,s:8", _COND), "x": ("b:4,s:8", _NAN_X), "y": ("s:8", _r(8, seed=8))},
           lambda c, x, y: torch.where(c, x, y)),
    OpCase("where_compare_scalar", lambda mesh, x: mtf.where(mtf.greater(x, 0.0), x * 3.0, 0.5),
           {"x": X48}, lambda x: torch.where(x > 0, x * 3.0, torch.tensor(0.5))),
    OpCase("where_grad_meets_other_grad",  # where's gradient has dy's dtype, not the condition's (bool)
           lambda mesh, x: mtf.where(mtf.greater(x, 0.0), x * 3.0, 0.5) + x,
           {"x": X48}, lambda x: torch.where(x > 0, x * 3.0, torch.tensor(0.5)) + x),
    OpCase("range", lambda mesh, x: x * mtf.cast(mtf.range(mesh, mtf.Dimension("s", 8), torch.int64),
                                                 torch.float32),
           {"x": X48}, lambda x: x * torch.arange(8.0)),
    OpCase("range_int", lambda mesh, i: i + mtf.range(mesh, "s:8", torch.int32),
           {"i": ("b:4,s:8", torch.arange(32, dtype=torch.int32).reshape(4, 8))},
           lambda i: i + torch.arange(8, dtype=torch.int32), grad=False),
    OpCase("cumsum", lambda mesh, x: mtf.cumsum(x, "s"), {"x": X416}, lambda x: torch.cumsum(x, 1)),
    OpCase("cumsum_exclusive", lambda mesh, x: mtf.cumsum(x, mtf.Dimension("s", 16), exclusive=True),
           {"x": X416}, lambda x: _excl(torch.cumsum(x, 1), x, 1)),
    OpCase("cumsum_reverse", lambda mesh, x: mtf.cumsum(x, "s", reverse=True), {"x": X416},
           lambda x: torch.cumsum(x.flip(1), 1).flip(1)),
    OpCase("cumsum_partial_sum", lambda mesh, x, w: mtf.cumsum(mtf.einsum([x, w], output_shape="s:16"), "s"),
           {"x": X416, "w": ("b:4", _r(4, seed=9))}, lambda x, w: torch.cumsum(w @ x, 0)),
] + [
    OpCase(f"shift_{off}_{'wrap' if wrap else 'zero'}",
           (lambda o, w: lambda mesh, x: mtf.shift(x, o, "s", w))(off, wrap),
           {"x": X416}, (lambda o, w: lambda x: _shift_ref(x, o, 1, w))(off, wrap))
    for off, wrap in [(1, False), (1, True), (-3, False), (-3, True), (6, False), (9, True), (-13, True),
                      (4, False), (-8, True), (16, False), (19, True), (0, False)]
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert any(m == "all:4" for m, _ in layouts) and any(m == "rows:2;cols:2" for m, _ in layouts)
    assert ("all:4", "s:all") in layouts or ("all:4", "k:all") in layouts


# ------------------------------------------------------------------ collectives


def _collectives(build, inputs, mesh_shape, layout):
    outs, _, lw = run_layout(build, inputs, mesh_shape, layout, grad=False)
    return outs, lw.counters


def test_shift_split_dim_sends_only_boundary():
    x = _r(4, 16)
    outs, c = _collectives(lambda mesh, x: mtf.shift(x, 1, "s", False), {"x": ("b:4,s:16", x)}, "all:4", "s:all")
    assert torch.equal(outs[0], _shift_ref(x, 1, 1, False))
    recv = c.collectives(kind="collective_permute")
    assert c.count() == 1 and len(recv) == 1
    assert recv[0][0].bytes_per_processor == 4 * 1 * 4  # b:4 rows x 1 boundary element x float32
    assert c.count("allgather") == 0 and c.count("allreduce") == 0


def test_shift_by_whole_blocks_is_one_receive_of_the_slice():
    x = _r(4, 16)
    outs, c = _collectives(lambda mesh, x: mtf.shift(x, -8, "s", True), {"x": ("b:4,s:16", x)}, "all:4", "s:all")
    assert torch.equal(outs[0], torch.roll(x, -8, 1))
    assert c.count() == 1 and c.collectives(kind="collective_permute")[0][0].bytes_per_processor == 4 * 4 * 4


def test_cumsum_split_gathers_only_totals():
    x = _r(4, 16)
    outs, c = _collectives(lambda mesh, x: mtf.cumsum(x, "s"), {"x": ("b:4,s:16", x)}, "all:4", "s:all")
    assert torch.allclose(outs[0], torch.cumsum(x, 1), atol=1e-5)
    ag = c.collectives(kind="allgather")
    assert c.count() == 1 and ag[0][0].bytes_per_processor == 4 * 1 * 4  # one total per row


def test_unsplit_dim_costs_nothing():
    x = _r(4, 16)
    for build in (lambda mesh, x: mtf.slice(x, 3, 8, "s"), lambda mesh, x: mtf.pad(x, [1, 3], "s"),
                  lambda mesh, x: mtf.cumsum(x, "s"), lambda mesh, x: mtf.shift(x, 2, "s", True),
                  lambda mesh, x: mtf.stack(mtf.split(x, "s", 4), "k", 0)):
        for mesh_shape, layout in (("all:4", "b:all"), ("rows:2;cols:2", "b:rows;k:cols")):
            _, c = _collectives(build, {"x": ("b:4,s:16", x)}, mesh_shape, layout)
            assert c.count() == 0, (layout, c.summary())


def test_slice_split_dim_gathers_once():
    x = _r(4, 16)
    outs, c = _collectives(lambda mesh, x: mtf.slice(x, 3, 8, "s"), {"x": ("b:4,s:16", x)}, "rows:2;cols:2",
                           "s:rows;b:cols")
    assert torch.equal(outs[0], x[:, 3:11])
    assert c.count() == 1 and c.collectives(kind="allgather", mesh_axes=("rows",))


# ------------------------------------------------------------------ errors


def _mesh():
    return mtf.Mesh(mtf.Graph(), "mesh")


def test_slice_bad_bounds_names_tensor_and_dim():
    mesh = _mesh()
    x = mtf.placeholder(mesh, "acts", "b:4,s:8")
    with pytest.raises(ShapeError, match="'s'.*'acts'"):
        mtf.slice(x, 6, 4, "s")
    with pytest.raises(ShapeError, match="'s'.*'acts'"):
        mtf.slice(x, -1, 2, "s")
    with pytest.raises(ShapeError, match="no dimension 'q'"):
        mtf.slice(x, 0, 2, "q")


def test_concat_mismatched_other_dims_names_tensor():
    mesh = _mesh()
    x = mtf.placeholder(mesh, "left", "b:4,s:8")
    y = mtf.placeholder(mesh, "right", "b:2,s:8")
    with pytest.raises(ShapeError, match="right.*other than 's'"):
        mtf.concat([x, y], "s")
    z = mtf.placeholder(mesh, "nos", "b:4,t:8")
    with pytest.raises(ShapeError, match="nos.*no dimension 's'"):
        mtf.concat([x, z], "s")


def test_other_shape_errors():
    mesh = _mesh()
    x = mtf.placeholder(mesh, "x", "b:4,s:8")
    with pytest.raises(ShapeError, match="x"):
        mtf.split(x, "s", 3)
    with pytest.raises(ShapeError, match="sum to 8"):
        mtf.split(x, "s", [4, 5])
    with pytest.raises(ValueError, match=">= 0"):
        mtf.pad(x, [-1, 2], "s")
    with pytest.raises(ShapeError, match="already have a dimension 's'"):
        mtf.stack([x, x], "s")
    with pytest.raises(TypeError, match="bool"):
        mtf.where(x, x, x)
    with pytest.raises(ShapeError, match="'x'.*no dimension 'q'"):
        mtf.shift(x, 1, "q", True)
    with pytest.raises(ShapeError, match="'x'.*no dimension 'q'"):
        mtf.cumsum(x, "q")
    with pytest.raises(ShapeError, match="'x'.*no dimension 'q'"):
        mtf.unstack(x, "q")


def test_unsplittable_free_layout_errors_are_layout_errors():
    # slicing a split dim to a size the mesh axis does not divide is a layout error naming the dim
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "mesh")
    x = mtf.placeholder(mesh, "x", "b:4,s:8")
    mtf.slice(x, 0, 3, "s")
    with pytest.raises(mtf.LayoutError, match="'s'"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "s:all")})


def test_linear_ops_keep_partial_sums_lazy():
    x, w = _r(4, 16), _r(4, seed=9)

    def build(mesh, x, w):
        p = mtf.einsum([x, w], output_shape="s:16")  # partial sums over the axis splitting b
        q = mtf.reduce_sum(x, output_shape="s:16")
        return mtf.cumsum(mtf.shift(mtf.add_n([p, q]), 3, "s", False), "s")
    outs, _, lw = run_layout(build, {"x": ("b:4,s:16", x), "w": ("b:4", w)}, "all:4", "b:all", grad=False)
    ref = torch.cumsum(_shift_ref(w @ x + x.sum(0), 3, 0, False), 0)
    assert torch.allclose(outs[0], ref, atol=1e-5)
    assert lw.counters.count("allreduce") == 1 and lw.counters.count() == 1


def test_numpy_integers_accepted_and_floats_rejected():
    import numpy as np
    mesh = _mesh()
    x = mtf.placeholder(mesh, "x", "b:4,s:8")
    assert mtf.slice(x, np.int64(2), np.int32(4), "s").shape == mtf.Shape("b:4,s:4")
    with pytest.raises(TypeError, match="begin"):
        mtf.slice(x, 2.0, 4, "s")

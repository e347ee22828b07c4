"""gather / scatter_add / top_k family: values and gradients under every layout vs plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.testing import OpCase, check_layouts, run_layout


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _randint(hi, *shape, lo=0, seed=1):
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed))


W = _randn(8, 4)
IND = _randint(8, 4, 2)
IND_BAD = torch.tensor([[0, -1], [8, 3], [7, 100], [2, 2]])
WB = _randn(4, 8, 4, seed=2)
INDB = _randint(8, 4, 4, seed=3)
X = _randn(4, 16, seed=4)
X3 = _randn(8, 4, 4, seed=5)
XTIES = _randint(3, 4, 16, seed=6).float()  # many ties: first maximum must win
A, B = _randn(8, 4, seed=7), _randn(4, 4, seed=8)


def _scatter_ref(u, ind):
    return torch.zeros(8, 4, dtype=u.dtype).index_add(0, ind.reshape(-1), u.reshape(-1, 4))


EMB = {"w": ("v:8,d:4", W), "ind": ("b:4,s:2", IND)}

OP_CASES = [
    OpCase("gather_embedding", lambda mesh, w, ind: mtf.gather(w, ind, "v"), EMB,
           lambda w, ind: F.embedding(ind, w)),
    OpCase("gather_dimension_object", lambda mesh, w, ind: mtf.gather(w, ind, mtf.Dimension("v", 8)), EMB,
           lambda w, ind: torch.index_select(w, 0, ind.reshape(-1)).reshape(4, 2, 4)),
    OpCase("gather_output_shape", lambda mesh, w, ind: mtf.gather(w, ind, "v", output_shape="d:4,b:4,s:2"), EMB,
           lambda w, ind: F.embedding(ind, w).permute(2, 0, 1)),
    OpCase("gather_out_of_range_is_zero", lambda mesh, w, ind: mtf.gather(w, ind, "v"),
           {"w": ("v:8,d:4", W), "ind": ("b:4,s:2", IND_BAD)},
           lambda w, ind: F.embedding(ind.clamp(0, 7), w) * ((ind >= 0) & (ind < 8)).unsqueeze(-1)),
    OpCase("gather_batched_shared_dim", lambda mesh, w, ind: mtf.gather(w, ind, "v"),
           {"w": ("b:4,v:8,d:4", WB), "ind": ("b:4,s:4", INDB)},
           lambda w, ind: w[torch.arange(4).unsqueeze(1), ind]),
    OpCase("gather_scalar_index", lambda mesh, w: mtf.gather(w, 3, "v"), {"w": ("v:8,d:4", W)},
           lambda w: w[3]),
    OpCase("gather_vocab_last", lambda mesh, w, ind: mtf.gather(w, ind, "v"),
           {"w": ("d:4,v:8", W.T.contiguous()), "ind": ("b:4,s:2", IND)}, lambda w, ind: F.embedding(ind, w.T)),
    OpCase("gather_of_lazy_einsum",
           lambda mesh, a, b, ind: mtf.gather(mtf.einsum([a, b], output_shape="v:8,d:4"), ind, "v"),
           {"a": ("v:8,h:4", A), "b": ("h:4,d:4", B), "ind": ("b:4,s:2", IND)},
           lambda a, b, ind: F.embedding(ind, a @ b)),
    OpCase("scatter_add", lambda mesh, u, ind: mtf.scatter_add(u, ind, "v:8", "v:8,d:4"),
           {"u": ("b:4,s:2,d:4", _randn(4, 2, 4, seed=9)), "ind": ("b:4,s:2", IND)}, _scatter_ref),
    OpCase("top_k", lambda mesh, x: list(mtf.top_k(x, "v", "k:3")), {"x": ("b:4,v:16", X)},
           lambda x: list(torch.topk(x, 3))),
    OpCase("top_k_k_exceeds_local_slice", lambda mesh, x: list(mtf.top_k(x, "v", "k:6")), {"x": ("b:4,v:16", X)},
           lambda x: list(torch.topk(x, 6))),
    OpCase("top_k_reduced_dim_first", lambda mesh, x: list(mtf.top_k(x, "v", "k:2")), {"x": ("v:8,b:4,h:4", X3)},
           lambda x: list(torch.topk(x.permute(1, 2, 0), 2))),
    OpCase("top_1", lambda mesh, x: list(mtf.top_1(x, "v")), {"x": ("b:4,v:16", X)},
           lambda x: list(torch.max(x, 1))),
    OpCase("top_1_ties_first_max", lambda mesh, x: list(mtf.top_1(x, "v")), {"x": ("b:4,v:16", XTIES)},
           lambda x: list(torch.max(x, 1))),
    OpCase("argmax_ties", lambda mesh, x: mtf.argmax(x, "v"), {"x": ("b:4,v:16", XTIES)},
           lambda x: torch.argmax(x, 1)),
    OpCase("argmax_middle_dim", lambda mesh, x: mtf.argmax(x, "b"), {"x": ("v:8,b:4,h:4", X3)},
           lambda x: torch.argmax(x, 1)),
    OpCase("nth_largest_element", lambda mesh, x: mtf.nth_largest_element(x, 2, "v"), {"x": ("b:4,v:16", X)},
           lambda x: torch.topk(x, 3).values[:, 2]),
    OpCase("nth_largest_zero_is_max", lambda mesh, x: mtf.nth_largest(x, 0, "v"), {"x": ("b:4,v:16", X)},
           lambda x: x.amax(1)),
    OpCase("sample_temperature_zero_is_argmax", lambda mesh, x: mtf.sample_with_temperature(x, "v", 0.0),
           {"x": ("b:4,v:16", X)}, lambda x: torch.argmax(x, 1)),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert ("", "") in layouts and any(m == "rows:2;cols:2" for m, _ in layouts)


def test_gather_mesh_axis_splitting_vocab_and_indices():
    """One axis splits the vocab of the weights and a dim of the indices: weights all-gathered first."""
    layouts = [("all:4", "v:all;b:all"), ("rows:2;cols:2", "v:rows;s:rows;d:cols"),
               ("rows:2;cols:2", "v:rows;b:rows;d:cols"), ("rows:2;cols:2", "v:cols;b:rows;s:cols")]
    check_layouts(lambda mesh, w, ind: mtf.gather(w, ind, "v"), EMB, lambda w, ind: F.embedding(ind, w),
                  layouts=layouts)
    check_layouts(lambda mesh, a, b, ind: mtf.gather(mtf.einsum([a, b], output_shape="v:8,d:4"), ind, "v"),
                  {"a": ("v:8,h:4", A), "b": ("h:4,d:4", B), "ind": ("b:4,s:2", IND)},
                  lambda a, b, ind: F.embedding(ind, a @ b),
                  layouts=[("all:4", "h:all;b:all"), ("rows:2;cols:2", "h:rows;b:rows;v:cols"),
                           ("rows:2;cols:2", "h:cols;s:cols;d:rows")])
    _, _, lw = run_layout(lambda mesh, w, ind: mtf.gather(w, ind, "v"), EMB, "all:4", "v:all;b:all")
    gathered = {(r.op, r.tensor): r.bytes_per_processor for r, _ in lw.counters.collectives("allgather")}
    assert lw.counters.count() == 3 and gathered[("gather", "w")] == 2 * 4 * 4  # weights' slice, forward
    assert gathered[("gather_grad", "ind")] == 2 * 8  # backward: updates and indices along b


def _counters(build, inputs, mesh_shape, layout):
    _, _, lw = run_layout(build, inputs, mesh_shape, layout, grad=False)
    return lw.counters


def test_gather_split_vocab_one_allreduce():
    c = _counters(lambda mesh, w, ind: mtf.gather(w, ind, "v"), EMB, "all:4", "v:all")
    assert c.count() == 1 and c.count("allreduce") == 1
    (rec, n), = c.collectives("allreduce")
    assert rec.mesh_axes == ("all",) and rec.bytes_per_processor == 4 * 2 * 4 * 4 and n == 1
    c = _counters(lambda mesh, w, ind: mtf.gather(w, ind, "v"), EMB, "rows:2;cols:2", "v:cols;b:rows")
    (rec, _), = c.collectives()
    assert rec.kind == "allreduce" and rec.mesh_axes == ("cols",) and rec.bytes_per_processor == 2 * 2 * 4 * 4
    assert _counters(lambda mesh, w, ind: mtf.gather(w, ind, "v"), EMB, "all:4", "d:all").count() == 0
    # the partial sums stay lazy: a reduction after the gather still costs one (smaller) all-reduce
    c = _counters(lambda mesh, w, ind: mtf.reduce_sum(mtf.gather(w, ind, "v"), reduced_dim="s"), EMB,
                  "all:4", "v:all")
    (rec, _), = c.collectives()
    assert rec.kind == "allreduce" and rec.bytes_per_processor == 4 * 4 * 4
    # lazily summed weights (einsum over a split h) pass through the lookup: the all-reduce is of the
    # gathered rows (b*s*d), not of the whole table (v*d)
    c = _counters(lambda mesh, a, b, ind: mtf.gather(mtf.einsum([a, b], output_shape="v:8,d:4"), ind, "v"),
                  {"a": ("v:8,h:4", A), "b": ("h:4,d:4", B), "ind": ("b:4", IND[:, 0])}, "all:4", "h:all")
    (rec, _), = c.collectives()
    assert rec.kind == "allreduce" and rec.op.startswith("gather") and rec.bytes_per_processor == 4 * 4 * 4


def test_gather_gradient_is_scatter_add_without_dense_onehot():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    w = mtf.get_variable(mesh, "w", "v:8,d:4")
    ind = mtf.placeholder(mesh, "ind", "b:4,s:2", dtype=torch.int64)
    (dw,) = mtf.gradients([mtf.reduce_sum(mtf.gather(w, ind, "v"))], [w])
    assert isinstance(dw.operation, mtf.ScatterAddOperation)
    assert not any(isinstance(op, mtf.OneHotOperation) for op in g.operations)


def test_top_k_split_allgathers_k_candidates():
    c = _counters(lambda mesh, x: list(mtf.top_k(x, "v", "k:3")), {"x": ("b:4,v:16", X)}, "all:4", "v:all")
    recs = {r.tensor: r for r, _ in c.collectives("allgather")}
    assert c.count() == 2 and c.count("allgather") == 2
    vals = [r for t, r in recs.items() if not t.endswith(":1")][0]
    idx = [r for t, r in recs.items() if t.endswith(":1")][0]
    assert vals.bytes_per_processor == 4 * 3 * 4 and idx.bytes_per_processor == 4 * 3 * 8
    assert vals.mesh_axes == ("all",)
    # fewer local elements than k: each processor sends its whole slice (4 candidates)
    c = _counters(lambda mesh, x: list(mtf.top_k(x, "v", "k:6")), {"x": ("b:4,v:16", X)}, "all:4", "v:all")
    assert sorted(r.bytes_per_processor for r, _ in c.collectives("allgather")) == [4 * 4 * 4, 4 * 4 * 8]
    assert _counters(lambda mesh, x: list(mtf.top_k(x, "v", "k:3")), {"x": ("b:4,v:16", X)},
                     "all:4", "b:all").count() == 0


def test_top_k_dim_is_unsplittable():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.get_variable(mesh, "x", "b:4,v:16")
    mtf.top_k(x, "v", "k:4")
    with pytest.raises(mtf.LayoutError, match="'k'"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "k:all")})


def test_build_errors_name_the_problem():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    w = mtf.get_variable(mesh, "w", "v:8,d:4")
    ind = mtf.placeholder(mesh, "ind", "b:4", dtype=torch.int64)
    with pytest.raises(TypeError, match="integers"):
        mtf.gather(w, mtf.get_variable(mesh, "f", "b:4"), "v")
    with pytest.raises(mtf.ShapeError, match="'q'"):
        mtf.gather(w, ind, "q")
    with pytest.raises(mtf.ShapeError, match="v:9"):
        mtf.gather(w, ind, "v:9")
    with pytest.raises(mtf.ShapeError, match="output_shape"):
        mtf.gather(w, ind, "v", output_shape="b:4")
    with pytest.raises(mtf.ShapeError, match="have the gathered"):
        mtf.gather(w, mtf.placeholder(mesh, "i2", "v:8", dtype=torch.int64), "v")
    with pytest.raises(mtf.ShapeError, match="larger"):
        mtf.top_k(w, "v", "k:9")
    with pytest.raises(mtf.ShapeError, match="new dimension"):
        mtf.top_k(w, "v", "d:2")
    with pytest.raises(ValueError, match="non-negative"):
        mtf.nth_largest_element(w, -1, "v")
    with pytest.raises(mtf.ShapeError):
        mtf.nth_largest_element(w, 8, "v")


@pytest.mark.parametrize("mesh_shape,layout", [("all:2", "k:all;vocab:all"), ("all:2", "k:all")])
def test_scatter_add_of_a_partial_sum_into_a_dim_split_over_the_same_axis(mesh_shape, layout):
    """Updates that are a partial sum over a mesh axis (a contraction of a dim split over it) scattered into an
    output whose gathered dim is split over that same axis (an embedding gradient with ``vocab`` and the producing
    contraction on one axis, as a pipeline's ``stage:pipe;vocab:pipe`` gives) equal the unsplit result."""
    x, w, ind = _randn(4, 6, seed=11), _randn(6, 3, seed=12), _randint(8, 4, seed=13)
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "mesh")
    b, k, d, v = mtf.Dimension("b", 4), mtf.Dimension("k", 6), mtf.Dimension("d", 3), mtf.Dimension("vocab", 8)
    u = mtf.einsum([mtf.import_tensor(mesh, x, [b, k]), mtf.import_tensor(mesh, w, [k, d])], output_shape=[b, d])
    out = mtf.scatter_add(u, mtf.import_tensor(mesh, ind, [b]), v, [v, d])
    got = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}).run(out)
    want = torch.zeros(8, 3).index_add_(0, ind, x @ w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

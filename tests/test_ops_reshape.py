"""reshape / rename_dimension / replace_dimensions / transpose: values and gradients under every
layout vs plain PyTorch, the collectives of each lowering case, random shapes and layouts, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mtf
from meshtorch.core.errors import ShapeError
from meshtorch.testing import OpCase, check_layouts, run_layout


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


OP_CASES = [
    OpCase("reshape_split_dim", lambda mesh, x: mtf.reshape(x, "b:4,h1:4,h2:2"), {"x": ("b:4,h:8", _r(4, 8))},
           lambda x: x.reshape(4, 4, 2)),
    OpCase("reshape_merge_dims", lambda mesh, x: mtf.reshape(x, "ab:16,c:4"), {"x": ("a:4,b:4,c:4", _r(4, 4, 4))},
           lambda x: x.reshape(16, 4)),
    OpCase("reshape_regroup", lambda mesh, x: mtf.reshape(x, "c:8,d:4"), {"x": ("a:4,b:8", _r(4, 8))},
           lambda x: x.reshape(8, 4)),
    OpCase("reshape_of_partial_sum", lambda mesh, x, w: mtf.reshape(mtf.einsum([x, w], output_shape="b:4,h:8"),
                                                                    "b:4,p:2,q:4"),
           {"x": ("b:4,k:4,h:8", _r(4, 4, 8)), "w": ("k:4", _r(4, seed=1))},
           lambda x, w: torch.einsum("bkh,k->bh", x, w).reshape(4, 2, 4)),
    OpCase("rename_dimension", lambda mesh, x: mtf.rename_dimension(x, "h", "g"), {"x": ("b:4,h:8", _r(4, 8))},
           lambda x: x * 1),
    OpCase("replace_dimensions", lambda mesh, x: mtf.replace_dimensions(x, mtf.Dimension("h", 8), ["h1:2", "h2:4"]),
           {"x": ("b:4,h:8,s:4", _r(4, 8, 4))}, lambda x: x.reshape(4, 2, 4, 4)),
    OpCase("transpose", lambda mesh, x: mtf.transpose(x, "h:8,s:4,b:4"), {"x": ("b:4,h:8,s:4", _r(4, 8, 4))},
           lambda x: x.permute(1, 2, 0)),
    OpCase("transpose_of_partial_sum", lambda mesh, x, w: mtf.transpose(mtf.einsum([x, w], output_shape="b:4,h:8"),
                                                                        "h:8,b:4"),
           {"x": ("b:4,k:4,h:8", _r(4, 4, 8)), "w": ("k:4", _r(4, seed=1))},
           lambda x, w: torch.einsum("bkh,k->hb", x, w)),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert any(m == "all:4" for m, _ in layouts) and any(m == "rows:2;cols:2" for m, _ in layouts)


# ------------------------------------------------------------------ the four lowering cases + the rejected one

X = _r(4, 8)

# (name, input shape, new shape, mesh, layout, {collective kind: count} of the forward reshape)
CASES = [
    ("free_kept_split", "b:4,h:8", "b:4,h1:4,h2:2", "all:4", "h:all;h1:all", {}),
    ("free_batch", "b:4,h:8", "b:4,g:8", "rows:2;cols:2", "b:rows", {}),
    ("local_slice_before", "b:4,h:8", "b:4,h1:4,h2:2", "all:4", "h1:all", {}),
    ("local_slice_after", "a:2,b:8", "c:16", "all:4", "c:all", {}),
    ("allgather", "b:4,h:8", "b:4,g:8", "all:4", "h:all", {"allgather": 1}),
    ("alltoall_before", "b:4,h:8", "b2:4,g:8", "all:4", "h:all;b2:all", {"alltoall": 1}),
    ("alltoall_after", "a:4,b:8", "c:2,d:16", "rows:2;cols:2", "a:rows;d:rows", {"alltoall": 1}),
    ("rejected_by_mesh_tf", "a:2,b:8", "c:16", "all:4", "b:all;c:all", {"allgather": 1}),
    ("two_axes_swap", "a:4,b:8", "c:4,d:8", "rows:2;cols:2", "a:rows;b:cols;c:cols;d:rows",
     {"alltoall": 1, "allgather": 1}),
]


def _sizes(shape):
    return mtf.convert_to_shape(shape).to_integer_list()


@pytest.mark.parametrize("name,old,new,mesh_shape,layout,expected", CASES, ids=[c[0] for c in CASES])
def test_reshape_collectives(name, old, new, mesh_shape, layout, expected):
    x = _r(*_sizes(old))
    outs, _, lw = run_layout(lambda mesh, x: mtf.reshape(x, new), {"x": (old, x)}, mesh_shape, layout, grad=False)
    assert torch.equal(outs[0], x.reshape(_sizes(new)))
    c = lw.counters
    for kind in ("allgather", "alltoall", "allreduce", "collective_permute"):
        got = sum(n for _, n in c.collectives(kind=kind, op="reshape"))
        assert got == expected.get(kind, 0), f"{name}: {kind} x{got}\n{c.summary()}"
    assert c.count() == sum(expected.values())
    # values and gradients under this layout and a few others
    check_layouts(lambda mesh, x: mtf.reshape(x, new), {"x": (old, x)}, lambda x: x.reshape(_sizes(new)),
                  layouts=[("", ""), (mesh_shape, layout), ("all:2", layout.replace("rows", "all").replace(
                      "cols", "none"))])


def test_alltoall_moves_a_quarter_of_the_allgather_bytes():
    x = _r(4, 8)
    _, _, lw = run_layout(lambda mesh, x: mtf.reshape(x, "b2:4,g:8"), {"x": ("b:4,h:8", x)}, "all:4",
                          "h:all;b2:all", grad=False)
    (c, n), = lw.counters.collectives(kind="alltoall")
    assert c.bytes_per_processor == 4 * 2 * 4 and c.mesh_axes == ("all",)


def test_plan_counters_match_run():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "mesh")
    x = mtf.placeholder(mesh, "x", "a:2,b:8")
    y = mtf.reshape(x, "c:16")
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "b:all;c:all")})
    plan = lw.plan_counters([y])
    assert plan.count("allgather") == 1 and plan.count() == 1
    out = lw.run(y, feeds={x: X.reshape(2, 16)[:, :8]})
    assert torch.equal(out, X.reshape(2, 16)[:, :8].reshape(16))


# ------------------------------------------------------------------ random shapes and layouts

MESHES = ["all:4", "all:2", "rows:2;cols:2", "x:3;y:2"]
NAMES = "abcde"


def _factorization(draw, total, max_dims):
    primes, n, p = [], total, 2
    while n > 1:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    k = draw(st.integers(1, max_dims))
    groups = draw(st.lists(st.integers(0, k - 1), min_size=len(primes), max_size=len(primes)))
    sizes = [1] * k
    for prime, gi in zip(draw(st.permutations(primes)), groups, strict=True):
        sizes[gi] *= prime
    return sizes


def _legal(rules, name, axis, tensors) -> bool:
    """May the rule name:axis join ``rules``: divisible, and no tensor gets two dims on one mesh axis?"""
    if any(r[0] == name for r in rules):
        return False
    for dims in tensors:
        sizes = dict(dims)
        if name in sizes and (sizes[name] % axis.size or any(r[1] == axis.name and r[0] in sizes for r in rules)):
            return False
    return True


@st.composite
def reshape_problem(draw):
    old_sizes = draw(st.lists(st.sampled_from([4, 2, 8, 1, 6, 3]), min_size=1, max_size=4))
    total = math.prod(old_sizes)
    new_sizes = _factorization(draw, total, 4)
    mesh_shape = draw(st.sampled_from(MESHES))
    mesh = mtf.convert_to_shape(mesh_shape)
    if draw(st.booleans()):  # names shared between input and output (renames, kept dims)
        old_names = draw(st.permutations(NAMES))[: len(old_sizes)]
        new_names = draw(st.permutations(NAMES))[: len(new_sizes)]
    else:  # distinct names: each mesh axis is drawn a dim of the input and one of the output
        old_names, new_names = [f"o{i}" for i in range(len(old_sizes))], [f"n{i}" for i in range(len(new_sizes))]
    old = list(zip(old_names, old_sizes, strict=True))
    new = list(zip(new_names, new_sizes, strict=True))
    rules = []
    for axis in mesh:  # per mesh axis: at most one dim of each tensor, divisible, not already split
        for dims in (old, new):
            k = draw(st.integers(-1, len(dims) - 1))
            if k < 0:
                continue
            name = dims[k][0]
            if _legal(rules, name, axis, (old, new)):
                rules.append((name, axis.name))
    layout = ";".join(f"{n}:{a}" for n, a in rules)
    return old, new, mesh_shape, layout



@settings(max_examples=300, deadline=None)
@given(reshape_problem())
def test_reshape_random_layouts(problem):
    old, new, mesh_shape, layout = problem
    x = torch.arange(math.prod(s for _, s in old), dtype=torch.float32).reshape([s for _, s in old])
    outs, _, _ = run_layout(lambda mesh, x: mtf.reshape(x, new), {"x": (old, x)}, mesh_shape, layout, grad=False)
    assert torch.equal(outs[0], x.reshape([s for _, s in new])), (old, new, mesh_shape, layout)


@settings(max_examples=25, deadline=None)
@given(reshape_problem())
def test_reshape_random_layouts_gradient(problem):
    old, new, mesh_shape, layout = problem
    x = _r(*[s for _, s in old])
    check_layouts(lambda mesh, x: mtf.reshape(x, new), {"x": (old, x)}, lambda x: x.reshape([s for _, s in new]),
                  layouts=[(mesh_shape, layout)], min_layouts=1)


# ------------------------------------------------------------------ errors


def test_reshape_wrong_size_names_tensor():
    mesh = mtf.Mesh(mtf.Graph(), "mesh")
    x = mtf.placeholder(mesh, "acts", "b:4,h:8")
    with pytest.raises(ShapeError, match="'acts'.*32 elements.*30"):
        mtf.reshape(x, "b:5,h:6")


def test_rename_replace_transpose_errors():
    mesh = mtf.Mesh(mtf.Graph(), "mesh")
    x = mtf.placeholder(mesh, "acts", "b:4,h:8,s:2")
    with pytest.raises(ShapeError, match="'acts'.*no dimension 'q'"):
        mtf.rename_dimension(x, "q", "r")
    with pytest.raises(ShapeError, match="more than once"):
        mtf.rename_dimension(x, "h", "b")
    with pytest.raises(ShapeError, match="not consecutive"):
        mtf.replace_dimensions(x, ["b:4", "s:2"], "bs:8")
    with pytest.raises(ShapeError, match="'acts'.*no dimension"):
        mtf.replace_dimensions(x, "q:3", "r:3")
    with pytest.raises(ShapeError, match="not a permutation.*'acts'"):
        mtf.transpose(x, "h:8,b:4")
    with pytest.raises(ShapeError, match="not a permutation.*'acts'"):
        mtf.transpose(x, "h:8,b:4,s:3")
    assert mtf.replace_dimensions(x.shape, "h:8", ["h1:2", "h2:4"]) == mtf.Shape("b:4,h1:2,h2:4,s:2")


def test_transpose_is_local_and_counts_no_flops():
    x = _r(4, 8, 4)
    outs, _, lw = run_layout(lambda mesh, x: mtf.transpose(x, "s:4,b:4,h:8"), {"x": ("b:4,h:8,s:4", x)},
                             "rows:2;cols:2", "h:rows;s:cols", grad=False)
    assert torch.equal(outs[0], x.permute(2, 0, 1))
    assert lw.counters.count() == 0 and lw.counters.einsum_flops == 0

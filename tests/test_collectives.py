"""The MeshImpl collectives: reference semantics on full tensors, SPMD == placement, and their transposes.

(a) Each primitive of :class:`~meshtorch.mesh.placement.PlacementMeshImpl` on ``all:4`` and
    ``rows:2;cols:2``, for every mesh axis and tensor axis, against a reference written here on full
    tensors and per-processor blocks (processor coordinates from ``numpy.unravel_index``, as in JAX's
    shard_map ``collective_ref`` functions), never against meshtorch's own slice arithmetic.
(b) The same calls in 4 gloo processes (:class:`~meshtorch.mesh.spmd.SpmdMeshImpl`): rank r's result
    equals the placement result of processor r.
(c) Transposes, through graph gradients: a small graph whose forward pass causes one collective; the
    collectives of the gradient program (``plan_counters`` of the gradient fetch, records caused by the
    operations ``mtf.gradients`` created) are the transpose documented in docs/collectives.md, and the
    gradient equals plain PyTorch autograd on full tensors. Where today's program uses another collective than the ideal
    transpose, the constant ``TODAY_*`` below says so (see docs/collectives.md, "Where today's gradient
    differs").
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch

import _collectives_cases as C
import meshtorch as mtf
from meshtorch.core.layout import TensorLayout
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REDUCE = {"SUM": lambda ts: sum(ts[1:], ts[0]), "MAX": lambda ts: torch.stack(ts).amax(0),
          "MIN": lambda ts: torch.stack(ts).amin(0)}


# ============================================================ independent per-processor reference
def coords(p: int, dims) -> tuple[int, ...]:
    return tuple(int(c) for c in np.unravel_index(p, dims))


def block(full: torch.Tensor, layout, p: int, dims) -> torch.Tensor:
    """Processor p's block of ``full``: dim k split over mesh axis a keeps piece coords(p)[a] of dims[a]."""
    t, c = full, coords(p, dims)
    for k, a in enumerate(layout):
        if a is not None:
            size = full.shape[k] // dims[a]
            t = t.narrow(k, c[a] * size, size)
    return t


def group(p: int, axes, dims) -> list[int]:
    """Processors that differ from p only on ``axes``, ordered row-major over their coordinates there."""
    c = coords(p, dims)
    members = [q for q in range(int(np.prod(dims)))
               if all(coords(q, dims)[a] == c[a] for a in range(len(dims)) if a not in axes)]
    return sorted(members, key=lambda q: [coords(q, dims)[a] for a in sorted(axes)])


def allreduce_ref(blocks, p, axes, reduction, dims):
    return REDUCE[reduction]([blocks[q] for q in group(p, axes, dims)])


def allconcat_ref(blocks, p, a, concat_axis, dims):
    return torch.cat([blocks[q] for q in group(p, [a], dims)], dim=concat_axis)


def alltoall_ref(blocks, p, a, split_axis, concat_axis, dims):
    """Member c gets piece c (of n equal pieces along split_axis) of every member's block, concatenated."""
    members, c = group(p, [a], dims), coords(p, dims)[a]
    return torch.cat([torch.chunk(blocks[q], dims[a], dim=split_axis)[c] for q in members], dim=concat_axis)


def receive_ref(blocks, p, a, source, dims):
    members, c = group(p, [a], dims), coords(p, dims)[a]
    return torch.zeros_like(blocks[p]) if source[c] is None else blocks[members[source[c]]]


def broadcast_ref(blocks, p, a, root, dims):
    """Every member of the group along ``a`` gets the block of the member at coordinate ``root``."""
    return blocks[group(p, [a], dims)[root]]


def shift_source(n, offset, wrap):
    return [(c - offset) % n if wrap else (c - offset if 0 <= c - offset < n else None) for c in range(n)]


def reference(key, blocks, partial_blocks, p, dims):
    """The per-processor reference of one call of :func:`_collectives_cases.calls` (``key`` names it)."""
    kind, *args = key
    if kind == "allreduce":
        return allreduce_ref(partial_blocks, p, args[0], args[1], dims)
    if kind == "allconcat":
        return allconcat_ref(blocks, p, *args, dims)
    if kind == "alltoall":
        return alltoall_ref(blocks, p, *args, dims)
    if kind == "broadcast":
        return broadcast_ref(blocks, p, *args, dims)
    if kind == "shift":
        a, offset, wrap = args
        return receive_ref(blocks, p, a, shift_source(dims[a], offset, wrap), dims)
    return receive_ref(blocks, p, *args, dims)


# ============================================================ (a) placement vs the reference
@pytest.mark.parametrize("mesh_shape", C.MESHES)
def test_placement_primitives_match_reference(mesh_shape):
    dims = C.mesh_dims(mesh_shape)
    impl = mtf.PlacementMeshImpl(mesh_shape, "")
    full, parts = C.full_tensor(), C.partial_tensors(impl.size)
    results = C.run_all(impl, mesh_shape)
    n = 0
    for (lay, key), got in results.items():
        blocks = [block(full, lay, p, dims) for p in range(impl.size)]
        partial_blocks = [block(parts[p], lay, p, dims) for p in range(impl.size)]
        for p in range(impl.size):
            want = reference(key, blocks, partial_blocks, p, dims)
            assert got[p].shape == want.shape, (mesh_shape, lay, key, p)
            torch.testing.assert_close(got[p], want, rtol=1e-12, atol=1e-12, msg=f"{mesh_shape} {lay} {key} p{p}")
            n += 1
    assert len(results) > 70 and n == impl.size * len(results)


@pytest.mark.parametrize("mesh_shape", C.MESHES)
def test_full_tensor_semantics(mesh_shape):
    """All-gather of a split dim gives it whole; all-to-all re-splits; shift by k processors is
    torch.roll (or a zero-filled shift) of the full tensor by k blocks; import/export round-trip."""
    dims = C.mesh_dims(mesh_shape)
    impl = mtf.PlacementMeshImpl(mesh_shape, "")
    full = C.full_tensor()
    n = 0
    for lay in C.layouts(mesh_shape):
        x = impl.import_full(full, TensorLayout(lay))
        assert torch.equal(impl.export_full(x, TensorLayout(lay)), full)
        for k, a in enumerate(lay):
            if a is None:
                continue
            whole = tuple(None if j == k else b for j, b in enumerate(lay))
            got = impl.allconcat(x, a, k)
            for p in range(impl.size):  # every processor: the full tensor along dim k
                assert torch.equal(got[p], block(full, whole, p, dims))
            for j in range(len(lay)):  # all-to-all: mesh axis a moves from dim k to a whole dim j
                if lay[j] is None and full.shape[j] % dims[a] == 0:
                    moved = tuple(a if i == j else None if i == k else b for i, b in enumerate(lay))
                    got = impl.alltoall(x, a, j, k)
                    assert torch.equal(impl.export_full(got, TensorLayout(moved)), full), (lay, k, j)
                    n += 1
            size = full.shape[k] // dims[a]
            for off, wrap in C.SHIFTS:
                got = impl.export_full(impl.shift_by_n_processors(x, a, off, wrap), TensorLayout(lay))
                if wrap:
                    want = torch.roll(full, off * size, dims=k)
                else:
                    want = torch.zeros_like(full)
                    m = full.shape[k] - abs(off) * size
                    if m > 0:
                        src, dst = (0, off * size) if off > 0 else (-off * size, 0)
                        want.narrow(k, dst, m).copy_(full.narrow(k, src, m))
                assert torch.equal(got, want), (lay, k, off, wrap)
                n += 1
    assert n > 20


@pytest.mark.parametrize("mesh_shape", C.MESHES)
def test_allreduce_sums_partial_full_tensors(mesh_shape):
    """Each processor holds a different full tensor (replicated layout); the SUM all-reduce over all axes
    gives, everywhere, the sum of the full tensors: the value a pending partial sum stands for."""
    impl = mtf.PlacementMeshImpl(mesh_shape, "")
    parts = C.partial_tensors(impl.size)
    total = sum(parts[1:], parts[0])
    x = impl.laid_out_constant(lambda p: parts[p].clone())
    got = impl.allreduce(x, list(range(impl.ndims)), "SUM")
    for p in range(impl.size):
        torch.testing.assert_close(got[p], total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(impl.export_full(got, TensorLayout((None,) * len(C.SHAPE))), total,
                               rtol=1e-12, atol=1e-12)


# ============================================================ (b) SPMD (4 gloo ranks) vs placement
@pytest.fixture(scope="module")
def spmd_results(once_per_run):
    return once_per_run("test_collectives_spmd", lambda: run_spmd(
        "_collectives_cases:spmd_worker", nprocs=4, timeout_s=240, extra_path=[TESTS_DIR]).check().results)


@pytest.mark.parametrize("functional", [False, True], ids=["c10d", "functional"])
def test_spmd_primitives_equal_placement(spmd_results, functional):
    """Every primitive on 4 gloo ranks equals the placement mesh; ``functional``: the functional
    collectives (``SpmdMeshImpl.traceable()``) a compiled program uses."""
    n = 0
    for mesh_shape in C.MESHES:
        placement = C.run_all(mtf.PlacementMeshImpl(mesh_shape, ""), mesh_shape)
        for rank, res in enumerate(spmd_results):
            got_all = res[("functional", mesh_shape) if functional else mesh_shape]
            assert set(got_all) == set(placement)
            for key, want in placement.items():
                (got,) = got_all[key]
                where = f"{mesh_shape} {key} rank {rank}"
                assert got.shape == want[rank].shape, where
                torch.testing.assert_close(got, want[rank], rtol=1e-12, atol=1e-12, msg=where)
                n += 1
    assert n > 2000


def test_traceable_is_the_same_backend_with_functional_collectives(spmd_results):
    """``SpmdMeshImpl.traceable()`` is an SpmdMeshImpl (same mesh, rank and process groups) whose strategy
    issues functional collectives (an ``AsyncCollectiveTensor``, never the eager mesh's in-flight
    handle); the eager mesh keeps its asynchronous strategy; both all-reduces equal the sum of the ranks."""
    for rank, res in enumerate(spmd_results):
        facts = dict(res["traceable"])
        functional, eager = facts.pop("values")
        assert facts == {"same_class": True, "made_once": True, "functional": True, "eager_unchanged": True,
                         "same_mesh": (True, True, True, True), "functional_result": True, "eager_result": True,
                         "input_kept": True}, f"rank {rank}"
        want = torch.full((2, 3), float(sum(range(4))))
        torch.testing.assert_close(functional, want)
        torch.testing.assert_close(eager, want)


# ============================================================ (c) transposes through graph gradients
D = mtf.Dimension
B, H, N, Q, S = D("b", 4), D("h", 8), D("n", 4), D("q", 8), D("s", 4)

#: The gradient of an all-gather whose cotangent is a partial sum over the gathered mesh axis (a
#: reshape/rename that un-splits a dim, followed by an einsum contracting a dim split over that axis):
#: the ideal transpose, one reduce-scatter (the reshape's gradient redistributes the partial sum
#: straight into the split layout).
TODAY_ALLGATHER_PARTIAL_TRANSPOSE = [("reduce_scatter", "")]
#: The gradient of ``unstack`` (an all-gather of the split dim) is ``stack``; when the parts' cotangents
#: are partial sums over that axis, one reduce-scatter of the stacked sums would do; today each of the
#: 4 parts is all-reduced, then each processor keeps its own part.
TODAY_STACK_PARTIAL_TRANSPOSE = [("allreduce", "SUM", 4)]


def _loss(mesh, y, seed=1):
    cot = torch.randn(y.shape.to_integer_list(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return mtf.reduce_sum(y * mtf.import_tensor(mesh, cot, y.shape, name="cotangent")), cot


def g_einsum(mesh, v):
    return mtf.einsum([v["x"], v["w"]], output_shape=[B, N])


def t_einsum(t):
    return torch.einsum("bh,hn->bn", t["x"], t["w"])


def g_shift(offset, wrap):
    def g(mesh, v):
        return mtf.shift(v["x"], offset, "h", wrap=wrap)
    return g


def t_shift(offset, wrap):
    def t(t):
        x = t["x"]
        if wrap:
            return torch.roll(x, offset, dims=1)
        z = torch.zeros_like(x)
        if offset > 0:
            z[:, offset:] = x[:, :-offset]
        else:
            z[:, :offset] = x[:, -offset:]
        return z
    return t


def g_reshape(mesh, v):
    return mtf.reshape(v["x"], [D("b2", 4), D("h2", 8)])


def t_reshape(t):
    return t["x"].reshape(4, 8)


def g_rename(mesh, v):
    return mtf.rename_dimension(v["x"], "h", "q")


def t_rename(t):
    return t["x"]


def g_rename_einsum(mesh, v):
    return mtf.einsum([mtf.rename_dimension(v["x"], "h", "q"), v["u"]], output_shape=[B, N])


def t_rename_einsum(t):
    return torch.einsum("bq,qn->bn", t["x"], t["u"])


def g_unstack(mesh, v):
    return mtf.add_n([mtf.einsum([part, v["w"]], output_shape=[B, N]) for part in mtf.unstack(v["xs"], "s")])


def t_unstack(t):
    return torch.einsum("sbh,hn->bn", t["xs"], t["w"])


def g_slice(mesh, v):
    return mtf.slice(v["x"], 2, 4, "h")


def t_slice(t):
    return t["x"][:, 2:6]


VARS = {"x": [B, H], "w": [H, N], "u": [Q, N], "xs": [S, B, H]}

# name, graph, torch reference, variables to differentiate, (mesh, layout),
# collectives of the forward fetch, collectives caused by the ops mtf.gradients made: [(kind, reduction, axes, count)]
TRANSPOSE_CASES = [
    # einsum contracting a split dim: all-reduce (partial sums -> replicated) <-> identity (a replicated
    # cotangent is broadcast to the partial-sum terms: no communication)
    ("allreduce<->identity", g_einsum, t_einsum, ["x"], ("all:4", "h:all"),
     [("allreduce", "SUM", ("all",), 1)], []),
    ("allreduce<->identity 2x2", g_einsum, t_einsum, ["x"], ("rows:2;cols:2", "b:rows;h:cols"),
     [("allreduce", "SUM", ("cols",), 1)], []),
    # data parallel: a replicated weight used by batch-split activations (implicit broadcast) <-> the
    # weight gradient's all-reduce over the data axis
    ("broadcast<->allreduce", g_einsum, t_einsum, ["w"], ("all:4", "b:all"),
     [], [("allreduce", "SUM", ("all",), 1)]),
    ("broadcast<->allreduce 2x2", g_einsum, t_einsum, ["w"], ("rows:2;cols:2", "b:rows;h:cols"),
     [("allreduce", "SUM", ("cols",), 1)], [("allreduce", "SUM", ("rows",), 1)]),
    # shift(+k) <-> shift(-k): one collective-permute per part (a whole block, or the two parts of a block)
    ("shift+2 wrap", g_shift(2, True), t_shift(2, True), ["x"], ("all:4", "h:all"),
     [("collective_permute", "", ("all",), 1)], [("collective_permute", "", ("all",), 1)]),
    ("shift+3 zero-fill", g_shift(3, False), t_shift(3, False), ["x"], ("all:4", "h:all"),
     [("collective_permute", "", ("all",), 2)], [("collective_permute", "", ("all",), 2)]),
    ("shift-4 wrap 2x2", g_shift(-4, True), t_shift(-4, True), ["x"], ("rows:2;cols:2", "b:rows;h:cols"),
     [("collective_permute", "", ("cols",), 1)], [("collective_permute", "", ("cols",), 1)]),
    # all-to-all (split axis j, concat axis i) <-> all-to-all (split i, concat j)
    ("alltoall<->alltoall", g_reshape, t_reshape, ["x"], ("all:4", "h:all;b2:all"),
     [("alltoall", "", ("all",), 1)], [("alltoall", "", ("all",), 1)]),
    ("alltoall<->alltoall 2x2", g_reshape, t_reshape, ["x"], ("rows:2;cols:2", "h:cols;b2:cols"),
     [("alltoall", "", ("cols",), 1)], [("alltoall", "", ("cols",), 1)]),
    # all-gather with a replicated cotangent <-> local slice (no communication)
    ("allgather<->local slice", g_rename, t_rename, ["x"], ("all:4", "h:all"),
     [("allgather", "", ("all",), 1)], []),
    # local slice (dim split only after) <-> all-gather of the cotangent
    ("local slice<->allgather", g_rename, t_rename, ["x"], ("all:4", "q:all"),
     [], [("allgather", "", ("all",), 1)]),
    ("allgather<->local slice, slice<->allgather 2x2", g_rename, t_rename, ["x"], ("rows:2;cols:2", "h:rows;q:cols"),
     [("allgather", "", ("rows",), 1)], [("allgather", "", ("cols",), 1)]),
    # all-gather whose cotangent is a partial sum over the same axis: a reduce-scatter
    ("allgather<->reduce_scatter (partial)", g_rename_einsum, t_rename_einsum, ["x"], ("all:4", "h:all;n:all"),
     [("allgather", "", ("all",), 1)], [(k, r, ("all",), 1) for k, r in TODAY_ALLGATHER_PARTIAL_TRANSPOSE]),
    ("allgather<->reduce_scatter (partial) 2x2", g_rename_einsum, t_rename_einsum, ["x"],
     ("rows:2;cols:2", "h:cols;n:cols"),
     [("allgather", "", ("cols",), 1)], [(k, r, ("cols",), 1) for k, r in TODAY_ALLGATHER_PARTIAL_TRANSPOSE]),
    ("unstack: allgather<->stack(partial) today", g_unstack, t_unstack, ["xs"], ("all:4", "s:all;n:all"),
     [("allgather", "", ("all",), 1)], [(k, r, ("all",), n) for k, r, n in TODAY_STACK_PARTIAL_TRANSPOSE]),
    # mtf.slice of a split dim (all-gather, local slice) <-> mtf.pad (all-gather of the cotangent, local slice)
    ("slice: allgather<->allgather", g_slice, t_slice, ["x"], ("all:4", "h:all"),
     [("allgather", "", ("all",), 1)], [("allgather", "", ("all",), 1)]),
]


class _Variables(dict):
    """``{name: variable}``, created on first use (only the variables a case's graph reads)."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def __missing__(self, k):
        self[k] = mtf.get_variable(self.mesh, k, VARS[k], dtype=torch.float64)
        return self[k]


def _records(counters, ops=None):
    """``Counter{(kind, reduction, mesh axes): count}`` of the records caused by ``ops`` (names; None: all)."""
    out = collections.Counter()
    for c, n in counters.records.items():
        if ops is None or c.op in ops:
            out[(c.kind, c.reduction, tuple(c.mesh_axes))] += n
    return out


@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=[c[0] for c in TRANSPOSE_CASES])
def test_gradient_uses_transpose_collective(case):
    name, build, ref, wrt, (mesh_shape, layout), fwd_want, grad_want = case
    gen = torch.Generator().manual_seed(3)
    values = {k: torch.randn(mtf.Shape(s).to_integer_list(), generator=gen, dtype=torch.float64)
              for k, s in VARS.items()}
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    v = _Variables(mesh)
    y = build(mesh, v)
    loss, cot = _loss(mesh, y)
    forward_ops = {op.name for op in g.operations}
    grads = mtf.gradients([loss], [v[k] for k in wrt])
    gradient_ops = {op.name for op in g.operations} - forward_ops
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    for k in v:
        lw.set_variable_value(k, values[k])
    fwd = _records(lw.plan_counters([y]))
    assert fwd == collections.Counter({(k, r, a): n for k, r, a, n in fwd_want}), (name, fwd)
    for gr in grads:
        added = _records(lw.plan_counters([gr]), gradient_ops)
        assert added == collections.Counter({(k, r, a): n for k, r, a, n in grad_want}), (name, added,
                                                                                          lw.program_str())
    # values: the lowered gradient == plain PyTorch autograd on full tensors
    got = lw.run(grads)
    leaves = {k: t.clone().requires_grad_(k in wrt) for k, t in values.items()}
    (ref(leaves) * cot).sum().backward()
    for k, gk in zip(wrt, got, strict=True):
        torch.testing.assert_close(gk, leaves[k].grad, rtol=1e-12, atol=1e-12)

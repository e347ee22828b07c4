"""plan_redistribute (lowering/layout.py): a pure function of (spec, shape, dtype, src, dst) returning the
transforms of a layout change, checked against full tensors; the planner emits exactly those transforms,
and cost.transform_time prices them as estimate_time prices the planned program's counters."""

import functools
import math

import pytest
import torch

import meshtorch as mtf
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering.layout import LOCAL_SLICE, Layout, Transform, narrow_kernel, plan_redistribute
from meshtorch.planning import CostModel, estimate_time, memory_report, transform_time

P = frozenset

# (mesh shape, tensor sizes, src, dst, the kinds the documented rules choose)
CASES = [
    # 1-D mesh: each single rule
    ("x:4", [8, 12], Layout((None, None), P({0})), Layout((None, None)), ["allreduce"]),
    ("x:4", [8, 12], Layout((None, None), P({0})), Layout((None, 0)), ["reduce_scatter"]),
    ("x:4", [8, 12], Layout((None, None), P({0})), Layout((0, None)), ["reduce_scatter"]),
    ("x:4", [8, 12], Layout((0, None)), Layout((None, None)), ["allgather"]),
    ("x:4", [8, 12], Layout((None, 0)), Layout((None, None)), ["allgather"]),
    ("x:4", [8, 12], Layout((0, None)), Layout((None, 0)), ["alltoall"]),
    ("x:4", [8, 12], Layout((None, None)), Layout((0, None)), [LOCAL_SLICE]),
    ("x:4", [8, 12], Layout((None, 0)), Layout((None, 0)), []),
    # 2-D mesh: combinations
    ("r:2;c:2", [4, 8], Layout((None, None), P({0, 1})), Layout((None, None)), ["allreduce"]),
    ("r:2;c:2", [4, 8], Layout((None, None), P({0, 1})), Layout((1, None)), ["reduce_scatter", "allreduce"]),
    ("r:2;c:2", [4, 8], Layout((None, None), P({0, 1})), Layout((0, 1)), ["reduce_scatter", "reduce_scatter"]),
    ("r:2;c:2", [4, 8], Layout((None, None), P({0, 1})), Layout((None, None), P({1})), ["allreduce"]),
    ("r:2;c:2", [4, 8], Layout((0, None), P({1})), Layout((0, 1)), ["reduce_scatter"]),
    ("r:2;c:2", [4, 8], Layout((0, None), P({1})), Layout((None, 0)), ["allreduce", "alltoall"]),
    ("r:2;c:2", [4, 8], Layout((0, 1)), Layout((1, 0)), ["allgather", "alltoall", LOCAL_SLICE]),
    ("r:2;c:2", [4, 8], Layout((0, None)), Layout((1, None)), ["allgather", LOCAL_SLICE]),
    ("r:2;c:3", [6, 6], Layout((0, 1)), Layout((None, None)), ["allgather", "allgather"]),
    # dim 0 is split when the sum is reduced: no reduce-scatter into it
    ("r:2;c:3", [6, 12], Layout((None, 1), P({0})), Layout((1, 0)), ["allreduce", "alltoall", LOCAL_SLICE]),
    ("r:2;c:3", [6, 12], Layout((None, 1), P({0})), Layout((0, None)), ["reduce_scatter", "allgather"]),
    # mesh axes of size 1 move nothing
    ("a:2;b:1", [4, 6], Layout((0, 1)), Layout((None, None)), ["allgather"]),
    ("a:2;b:1", [4, 6], Layout((None, None), P({0, 1})), Layout((None, 1)), ["allreduce"]),
    ("a:2;b:1", [4, 6], Layout((None, None), P({1})), Layout((None, None)), []),
]


def _region(spec, sizes, axes, pnum):
    """Processor ``pnum``'s index region of a full tensor of ``sizes`` laid out with mesh ``axes`` per dim."""
    coords = spec.pnum_to_processor_coordinates(pnum)
    out = []
    for s, a in zip(sizes, axes, strict=True):
        n = spec.shape[a].size if a is not None else 1
        c = coords[a] if a is not None else 0
        out.append(slice(c * s // n, (c + 1) * s // n))
    return tuple(out)


def _term_sum(spec, terms, partial, pnum):
    """The full tensor processor ``pnum``'s slice is a share of: the terms of the mesh coordinates it shares
    with ``pnum`` on the ``partial`` axes, summed (all terms for an unpartial value)."""
    coords = spec.pnum_to_processor_coordinates(pnum)
    return sum(t for key, t in terms.items() if all(coords[a] == key[a] for a in partial))


def _apply(impl, x, transforms):
    """Run ``transforms`` on a placement value with the backend's primitives; check each collective's bytes."""
    for tr in transforms:
        rec = tr.collective
        if rec is None:
            axis = tr.mesh_axes[0]
            coords = impl.laid_out_constant(lambda p, axis=axis: impl.pnum_to_processor_coordinates(p)[axis])
            x = impl.slicewise(functools.partial(narrow_kernel, **dict(tr.params)), x, coords)
            assert tr.nbytes == 0
        else:
            assert tr.nbytes == x[0].numel() * x[0].element_size(), tr  # bytes of the input slice, as executed
            x = getattr(impl, rec.method)(x, **dict(tr.params))
    return x


@pytest.mark.parametrize("mesh_shape,sizes,src,dst,kinds", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_transforms_move_every_slice_to_its_target(mesh_shape, sizes, src, dst, kinds):
    spec = MeshSpec(mesh_shape)
    impl = mtf.PlacementMeshImpl(spec)
    gen = torch.Generator().manual_seed(0)
    # the partial sum: one full term per coordinate tuple (integers in float64: sums are exact)
    terms = {}
    x = []
    for p in range(spec.size):
        coords = spec.pnum_to_processor_coordinates(p)
        key = tuple(c if a in src.partial else 0 for a, c in enumerate(coords))
        if key not in terms:
            terms[key] = torch.randint(-9, 10, sizes, generator=gen).double()
        x.append(terms[key][_region(spec, sizes, src.axes, p)].clone())
    transforms = plan_redistribute(spec, sizes, torch.float64, src, dst)
    assert [tr.kind for tr in transforms] == kinds
    assert all(isinstance(tr, Transform) for tr in transforms)
    out = _apply(impl, x, transforms)
    ignore = {a for a in range(spec.ndims) if spec.shape[a].size == 1}
    unmoved = Layout(tuple(None if a in ignore else a for a in src.axes), src.partial - ignore)
    final = transforms[-1].layout if transforms else unmoved
    assert tuple(final.axes) == tuple(None if a in ignore else a for a in dst.axes)
    assert final.partial == dst.partial - ignore
    for p in range(spec.size):
        want = _term_sum(spec, terms, final.partial, p)[_region(spec, sizes, final.axes, p)]
        torch.testing.assert_close(out[p], want, rtol=0, atol=0)


def test_every_transform_records_the_layout_after_it():
    spec = MeshSpec("r:2;c:2")
    trs = plan_redistribute(spec, [4, 8], torch.float32, Layout((0, 1)), Layout((1, 0)))
    # gather r off dim 0, move c from dim 1 to dim 0, keep the r piece of dim 1
    assert [tuple(t.layout.axes) for t in trs] == [(None, 1), (1, None), (1, 0)]
    assert [t.tensor_axis for t in trs] == [0, 0, 1]


@pytest.mark.parametrize("src,dst,match", [
    (Layout((None, None)), Layout((None, None), P({0})), "partial over new mesh axes"),
    (Layout((None,)), Layout((None, None)), "do not match"),
    (Layout((None, None)), Layout((0, None)), "cannot be split"),
])
def test_bad_redistributions_name_the_tensor(src, dst, match):
    with pytest.raises(ValueError, match=match) as e:
        plan_redistribute(MeshSpec("x:3"), [4, 6], torch.float32, src, dst, name="w1")
    assert "'w1'" in str(e.value)


def _mlp():
    """A data- and model-parallel MLP with FSDP storage, SGD: all its collectives are redistributions."""
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "m")
    b, i, h = mtf.Dimension("batch", 8), mtf.Dimension("io", 4), mtf.Dimension("hidden", 16)
    x = mtf.placeholder(mesh, "x", [b, i])
    w1 = mtf.get_variable(mesh, "w1", [i, h])
    w2 = mtf.get_variable(mesh, "w2", [h, i])
    y = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[b, h])), w2], output_shape=[b, i])
    loss = mtf.reduce_sum(mtf.square(y))
    fetches = [loss] + mtf.optim.SgdOptimizer(0.1).apply_grads(mtf.gradients([loss], [w1, w2]), [w1, w2])
    return g, mesh, fetches


@pytest.mark.parametrize("serial", [False, True])
def test_price_of_the_plan_is_the_sum_of_its_transforms(serial):
    g, mesh, fetches = _mlp()
    spec = MeshSpec("data:2;model:2", "batch:data;hidden:model", storage="io:data")
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(spec)}, materialize=False)
    report = memory_report(lw, fetches)  # plans the fetches (and their last redistributions)
    # distinct constants per kind, so pricing one kind as another shows
    cost = CostModel(latency=1e-3, bandwidth=1e6, serial=serial,
                     collectives=(("allgather", 2e-3, 3e-6), ("reduce_scatter", 5e-3, 7e-6)))
    planned = estimate_time(report, cost)["comm_s"]
    sizes = [d.size for d in spec.shape]
    run = {o for st in lw.plan(fetches).steps for o in st.outputs}  # the steps a run of the fetches executes
    redists = [r for r in lw.planner.redistributions if r.slot in run]
    assert len(redists) < len(lw.planner.redistributions)  # w1's backward gather is not needed (x needs no grad)
    kinds = {tr.kind for r in redists for tr in r.transforms}
    assert {"allgather", "reduce_scatter", "allreduce"} <= kinds  # FSDP gathers, gradient scatters, sums
    priced = sum(transform_time(r.transforms, cost, sizes) for r in redists)
    assert planned > 0
    assert math.isclose(priced, planned, rel_tol=1e-12)
    n_transforms = sum(1 for r in redists for tr in r.transforms if tr.collective is not None)
    assert n_transforms == sum(report.counters.records.values())


def test_transform_time_rejects_an_axis_the_sizes_lack():
    trs = plan_redistribute(MeshSpec("r:2;c:2"), [4], torch.float32, Layout((1,)), Layout((None,)))
    with pytest.raises(ValueError, match="mesh axes \\[1\\]"):
        transform_time(trs, CostModel(), [2])


def test_transform_time_follows_the_ring_formulas():
    # all-gather of a [8, 12] float32 split over 4: each holds 2 * 12 * 4 bytes and sends 3 of those pieces
    trs = plan_redistribute(MeshSpec("x:4"), [8, 12], torch.float32, Layout((0, None)), Layout((None, None)))
    cost = CostModel(latency=1e-5, bandwidth=1e11)
    assert math.isclose(transform_time(trs, cost, [4]), 1e-5 + 3 * (2 * 12 * 4) / 1e11)
    # all-reduce then a local slice on a 2 x 2 mesh: 2 (g - 1) / g of the 4 * 8 * 2 bytes; the slice is free;
    # in a one-process simulation each of the 2 groups of the 'r' axis pays it in turn
    trs = plan_redistribute(MeshSpec("r:2;c:2"), [4, 8], torch.bfloat16, Layout((None, None), P({0})),
                            Layout((None, 1)))
    assert [t.kind for t in trs] == ["allreduce", LOCAL_SLICE]
    one = 1e-5 + 2 * (2 - 1) / 2 * (4 * 8 * 2) / 1e11
    assert math.isclose(transform_time(trs, cost, [2, 2]), one)
    assert math.isclose(transform_time(trs, CostModel(latency=1e-5, bandwidth=1e11, serial=True), [2, 2]), 2 * one)

"""MeshSpec: the mesh shape, rules and slice arithmetic apart from any backend (issue 22, deliverable 1)."""

import numpy as np
import pytest
import torch

import meshtorch as mtf
from meshtorch.core.mesh_spec import MeshSpec, convert_to_mesh_spec
from meshtorch.lowering import Session
from meshtorch.mesh.factory import make_mesh_impl, placement_mesh_impl


def test_spec_is_immutable_hashable_and_replaceable():
    a = MeshSpec("rows:2;cols:2", "batch:rows", storage="hidden:cols")
    b = MeshSpec([("rows", 2), ("cols", 2)], "batch:rows", storage="hidden:cols")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError, match="immutable"):
        a.prefetch = 3
    c = a.replace(prefetch=0, storage="")
    assert c.prefetch == 0 and not c.storage_rules.pairs and a.prefetch == 1 and a.storage_rules.pairs
    assert c != a
    with pytest.raises(TypeError, match="unknown field"):
        a.replace(devices=["cpu"])
    with pytest.raises(ValueError, match="prefetch"):
        MeshSpec("all:2", "", prefetch=-1)


@pytest.mark.parametrize("shape", ["", "all:4", "rows:2;cols:3", "a:2;b:1;c:2"])
def test_slice_arithmetic_matches_numpy(shape):
    """Row-major processor numbering and slices, against numpy's unravel_index and array_split on a full tensor."""
    spec = MeshSpec(shape)
    sizes = [d.size for d in spec.shape]
    for p in range(spec.size):
        coords = tuple(int(c) for c in np.unravel_index(p, sizes)) if sizes else ()
        assert spec.pnum_to_processor_coordinates(p) == coords
        assert spec.processor_coordinates_to_pnum(coords) == p
    if spec.ndims < 2:
        return
    # a tensor [x, y] with x split over mesh axis 0 and y over mesh axis 1
    x, y = mtf.Dimension("x", sizes[0] * 2), mtf.Dimension("y", sizes[1] * 3)
    rules = f"x:{spec.shape[0].name};y:{spec.shape[1].name}"
    s2 = MeshSpec(shape, rules)
    full = np.arange(x.size * y.size).reshape(x.size, y.size)
    layout = s2.tensor_layout([x, y])
    for p in range(s2.size):
        c = s2.pnum_to_processor_coordinates(p)
        want = np.array_split(np.array_split(full, sizes[0], axis=0)[c[0]], sizes[1], axis=1)[c[1]]
        np.testing.assert_array_equal(full[s2.slice_bounds([x, y], p, layout)], want)
    # groups along axis 1: processors equal on every other coordinate, ordered by their axis-1 coordinate
    for group in s2.processor_groups([1]):
        cs = [s2.pnum_to_processor_coordinates(p) for p in group]
        assert len({(c[0],) + tuple(c[2:]) for c in cs}) == 1 and [c[1] for c in cs] == list(range(sizes[1]))


def test_backends_hold_a_spec_and_read_through_it():
    spec = MeshSpec("rows:2;cols:2", "batch:rows;hidden:cols", storage="io:rows")
    impl = mtf.PlacementMeshImpl(spec)
    assert impl.spec is spec and convert_to_mesh_spec(impl) is spec
    assert impl.shape == spec.shape and impl.storage_rules == spec.storage_rules and impl.size == 4
    same = mtf.PlacementMeshImpl("rows:2;cols:2", "batch:rows;hidden:cols", storage="io:rows")
    assert same.spec == spec
    with pytest.raises(ValueError, match="either a MeshSpec"):
        mtf.PlacementMeshImpl(spec, "batch:rows")
    with pytest.raises(TypeError, match="MeshSpec"):
        convert_to_mesh_spec("rows:2")


def _mlp():
    graph = mtf.Graph(seed=0)
    mesh = mtf.Mesh(graph, "mesh")
    batch, io, hidden = mtf.Dimension("batch", 8), mtf.Dimension("io", 4), mtf.Dimension("hidden", 6)
    x = mtf.placeholder(mesh, "x", [batch, io])
    w1 = mtf.get_variable(mesh, "w1", [io, hidden])
    w2 = mtf.get_variable(mesh, "w2", [hidden, io])
    y = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[batch, hidden])), w2], output_shape=[batch, io])
    loss = mtf.reduce_mean(mtf.square(y - x))
    update = mtf.optim.SgdOptimizer(0.1).apply_grads(mtf.gradients([loss], [w1, w2]), [w1, w2])
    return graph, mesh, x, loss, update


def test_lowering_on_a_spec_equals_lowering_on_a_backend():
    """A spec runs on the placement backend; the program and the numbers are the backend's, and the planner
    holds specs only."""
    feed = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    spec = MeshSpec("rows:2;cols:2", "batch:rows;hidden:cols", storage="io:rows")
    results = []
    for value in (spec, mtf.PlacementMeshImpl("rows:2;cols:2", "batch:rows;hidden:cols", storage="io:rows")):
        graph, mesh, x, loss, update = _mlp()
        lw = mtf.Lowering(graph, {mesh: value})
        assert all(isinstance(s, MeshSpec) for s in lw.planner.mesh_to_spec.values())
        assert isinstance(lw.mesh_impl(loss), mtf.PlacementMeshImpl) and lw.mesh_spec(loss) == spec
        results.append([lw.run([loss] + update, feeds={x: feed})[0] for _ in range(3)])
        results.append(lw.to_json([loss]))
    assert results[1] == results[3]
    for a, b in zip(results[0], results[2], strict=True):
        assert torch.equal(a, b)


def test_session_refuses_a_backend_of_another_spec():
    graph, mesh, x, loss, update = _mlp()
    lw = mtf.Lowering(graph, {mesh: MeshSpec("rows:2;cols:2", "batch:rows")}, materialize=False)
    other = mtf.PlacementMeshImpl("rows:2;cols:2", "batch:cols")
    with pytest.raises(ValueError, match="planned as"):
        Session(lw.program, {"mesh": other}, lw.store)
    with pytest.raises(TypeError, match="MeshImpl or a MeshSpec"):
        mtf.Lowering(graph, {mesh: "rows:2;cols:2"})


def test_placement_mesh_impl_is_the_one_placement_factory():
    spec = MeshSpec("rows:2;cols:2", "batch:rows", storage="d:cols")
    assert placement_mesh_impl(spec).spec is spec
    on_cpu = placement_mesh_impl("all:2", "batch:all", device="cpu", storage="d:all")
    assert on_cpu.devices == [torch.device("cpu")] * 2 and str(on_cpu.storage_rules) == "d:all"
    single = make_mesh_impl("all:2", "batch:all", storage="d:all")  # one process: the same placement mesh
    assert type(single) is type(on_cpu) and single.spec == on_cpu.spec

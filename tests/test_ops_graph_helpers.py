"""Mesh TF's small graph helpers (ops/graph_helpers.py, import_laid_out_tensor, assign_fn): vs PyTorch."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


OP_CASES = [
    OpCase("anonymize", lambda mesh, x: mtf.anonymize(x) * 2.0, {"x": ("b:4,h:8", _x(4, 8))}, lambda x: x * 2),
    OpCase("read_variable", lambda mesh, x: mtf.read_variable(x) * x, {"x": ("b:4,h:8", _x(4, 8))}, lambda x: x * x),
    OpCase("binary_op_with_broadcasting",
           lambda mesh, x, y: mtf.binary_op_with_broadcasting(torch.atan2, x, y, output_shape="h:8,b:4"),
           {"x": ("b:4,h:8", _x(4, 8)), "y": ("h:8", _x(8, seed=1))}, lambda x, y: torch.atan2(x, y).T, grad=False),
    OpCase("binary_arguments_scalar", lambda mesh, x: mtf.add(*mtf.binary_arguments_to_tensors(2.5, x)),
           {"x": ("b:4,h:8", _x(4, 8))}, lambda x: x + 2.5),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert any(m == "rows:2;cols:2" for m, _ in layouts)


def test_anonymized_dims_are_never_split():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    y = mtf.anonymize(mtf.zeros(mesh, "b:4,h:8"))
    assert list(y.shape.dimension_names) == ["_anonymous_0", "_anonymous_1"]
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "b:rows;h:cols")})
    assert all(a is None for a in lw.tensor_layout(y))


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:4", "b:all"), ("rows:2;cols:2", "b:rows;h:cols")])
def test_import_laid_out_tensor_reassembles_slices(mesh_shape, layout):
    full = _x(4, 8)
    impl = mtf.PlacementMeshImpl(mesh_shape, layout)
    shape = mtf.convert_to_shape("b:4,h:8")
    tl = impl.tensor_layout(shape)
    sizes = impl.slice_shape(shape, tl)
    slices = []
    for p in range(impl.size):  # cut by hand from the processor coordinates: independent of import_full
        begin = impl.slice_begin(shape, p, tl)
        slices.append(full[begin[0]:begin[0] + sizes[0], begin[1]:begin[1] + sizes[1]].clone())
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    y = mtf.import_laid_out_tensor(mesh, slices, shape) * 3.0
    (out,) = mtf.Lowering(g, {mesh: impl}).run([y])
    torch.testing.assert_close(out, full * 3.0)


def test_import_laid_out_tensor_rejects_wrong_slices():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    y = mtf.import_laid_out_tensor(mesh, [torch.zeros(4, 8)] * 4, "b:4,h:8")
    with pytest.raises(mtf.ShapeError, match="slice 0"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "b:all")}).run([y])


@pytest.mark.parametrize("mesh_shape,layout", [("all:4", "h:all"), ("rows:2;cols:2", "b:rows;h:cols")])
def test_assign_fns(mesh_shape, layout):
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    v = mtf.get_variable(mesh, "v", "b:4,h:8", initializer=1.0)
    d = mtf.import_tensor(mesh, _x(4, 8), "b:4,h:8")
    add, sub, put = (mtf.assign(v, d, assign_fn=mtf.assign_add_slice), mtf.assign_sub(v, d),
                     mtf.assign(v, d, mtf.assign_slice))
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    lw.run([add])
    torch.testing.assert_close(lw.run([v])[0], 1.0 + _x(4, 8))
    lw.run([sub])
    lw.run([sub])
    torch.testing.assert_close(lw.run([v])[0], 1.0 - _x(4, 8))
    lw.run([put])
    torch.testing.assert_close(lw.run([v])[0], _x(4, 8))
    with pytest.raises(ValueError, match="assign_fn"):
        mtf.assign(v, d, assign_fn=lambda var, s, val: s)


def test_get_variable_dtype_overrides_build_a_variable_dtype():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    w = mtf.get_variable(mesh, "w", "a:4", master_dtype=torch.float32, slice_dtype=torch.float32,
                         activation_dtype=torch.bfloat16)
    var = w.operation.variable if hasattr(w.operation, "variable") else w.operation
    assert w.dtype == torch.bfloat16 and var.slice_dtype == torch.float32


def test_parallel_calls_once_per_device():
    out = mtf.parallel(["cpu", "cpu"], lambda a, b=0: torch.zeros(()).device.type + str(a + b), [1, 2], b=[10, 20])
    assert out == ["cpu11", "cpu22"]
    with pytest.raises(ValueError, match="same length"):
        mtf.parallel(["cpu"], lambda a: a, [1, 2])

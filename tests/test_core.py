"""Dimensions, shapes, layout rules and the errors for illegal layouts."""

import pytest
import torch

import meshtorch as mtf


def test_shape_from_string_and_pairs():
    s = mtf.Shape("batch:100,hidden:1024")
    assert s.dimension_names == ("batch", "hidden")
    assert s.to_integer_list() == [100, 1024]
    assert s == mtf.Shape([("batch", 100), mtf.Dimension("hidden", 1024)])
    assert mtf.Shape("a:2; b:3  c:4").size == 24
    assert (s - "batch") == mtf.Shape("hidden:1024")
    assert s.get_dim_by_name("hidden").size == 1024


def test_duplicate_dimension_name_is_an_error_naming_it():
    with pytest.raises(mtf.ShapeError, match="'batch'"):
        mtf.Shape("batch:4,batch:4")
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    with pytest.raises(mtf.ShapeError, match="'h'"):
        mtf.zeros(mesh, "h:4,h:8")


@pytest.mark.parametrize("bad", ["batch", "batch:x", "1abc:3", "b:0"])
def test_bad_dimension_strings(bad):
    with pytest.raises(mtf.ShapeError):
        mtf.Shape(bad)


def test_layout_rules_parse_separators():
    r = mtf.LayoutRules("batch:rows;hidden:cols")
    assert r.pairs == (("batch", "rows"), ("hidden", "cols"))
    assert mtf.LayoutRules("batch:rows, hidden:cols") == mtf.LayoutRules([("hidden", "cols"), ("batch", "rows")])
    assert mtf.LayoutRules("") .pairs == ()
    with pytest.raises(mtf.LayoutError, match="tensor_dim:mesh_axis"):
        mtf.LayoutRules("batch")


def test_rule_for_missing_mesh_axis_is_ignored():
    impl = mtf.PlacementMeshImpl("all:4", "batch:rows;hidden:all")
    assert impl.tensor_layout(mtf.Shape("batch:4,hidden:8")).tensor_axis_to_mesh_axis == (None, 0)


def test_processor_numbering_row_major_and_groups():
    impl = mtf.PlacementMeshImpl("rows:2;cols:3", "")
    assert impl.pnum_to_processor_coordinates(4) == (1, 1)
    assert impl.processor_coordinates_to_pnum((1, 2)) == 5
    assert impl.processor_groups([1]) == [[0, 1, 2], [3, 4, 5]]
    assert impl.processor_groups([0]) == [[0, 3], [1, 4], [2, 5]]
    assert impl.processor_groups([0, 1]) == [[0, 1, 2, 3, 4, 5]]


def _graph(shape_str, name="acts"):
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    x = mtf.placeholder(mesh, name, shape_str)
    return g, mesh, mtf.relu(x)


def test_not_divisible_names_tensor_dim_and_axis():
    g, mesh, _ = _graph("batch:6,hidden:8")
    with pytest.raises(mtf.LayoutError, match=r"acts.*'batch'.*6.*'all'.*4"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")})


def test_two_dims_on_one_mesh_axis():
    g, mesh, _ = _graph("batch:8,hidden:8")
    with pytest.raises(mtf.LayoutError, match=r"'batch' and 'hidden'.*'all'"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all;hidden:all")})


def test_one_dim_two_mesh_axes():
    g, mesh, _ = _graph("batch:8")
    with pytest.raises(mtf.LayoutError, match="'batch'.*one mesh axis"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "batch:rows;batch:cols")})


def test_unsplittable_dim_named():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    x = mtf.placeholder(mesh, "x", "b:4,t:8")
    mtf.slicewise(lambda a: torch.cumsum(a, 1), [x], unsplittable_dims=["t"], name="local_cumsum")
    with pytest.raises(mtf.LayoutError, match="'t'.*'all'"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "t:all")})


def test_feed_wrong_shape_names_placeholder():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    x = mtf.placeholder(mesh, "images", "batch:4,pixels:8")
    y = mtf.reduce_sum(x)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")})
    with pytest.raises(mtf.FeedError, match=r"'images'.*\[4, 8\].*\[8, 4\]"):
        lw.run(y, feeds={x: torch.zeros(8, 4)})
    with pytest.raises(mtf.FeedError, match="'images'.*not fed"):
        lw.run(y)
    assert lw.run(y, feeds={x: torch.ones(4, 8)}).item() == 32.0


def test_mesh_devices_count_checked():
    with pytest.raises(ValueError, match="4 processors"):
        mtf.PlacementMeshImpl("all:4", "", devices=["cpu"] * 3)


def test_register_gradient_rule_applies_to_subclasses_and_rejects_hidden_or_duplicate_rules():
    from meshtorch.core.graph import _GRADIENT_RULES, gradient_rule, register_gradient
    from meshtorch.ops.binary import BinaryOperation
    from meshtorch.ops.reduce import ReduceOperation

    class Scale(mtf.Operation):  # no gradient() of its own: the registered rule gives it
        def __init__(self, x):
            super().__init__([x], name="scale")
            self.outputs = [mtf.Tensor(self, x.shape, x.dtype)]

    class SubScale(Scale):
        pass

    class WithMethod(mtf.Operation):
        def gradient(self, grad_ys):
            return grad_ys

    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    x = mtf.zeros(mesh, "h:4")
    with pytest.raises(NotImplementedError, match="'scale'"):
        Scale(x).gradient([x])
    try:
        @register_gradient(Scale)
        def rule(op, grad_ys):
            return [mtf.negative(grad_ys[0], name="scale_rule_grad")]

        assert gradient_rule(SubScale) is rule
        y = SubScale(x).outputs[0]
        (dx,) = mtf.gradients([y], [x])
        assert dx.operation.name == "scale_rule_grad" and dx.operation.inputs[0].name == "scale_1_grad_seed"
        with pytest.raises(ValueError, match="already has a gradient rule"):
            register_gradient(Scale)
    finally:
        _GRADIENT_RULES.pop(Scale, None)
    with pytest.raises(TypeError, match="defines gradient"):
        register_gradient(WithMethod)
    with pytest.raises(TypeError, match="Operation subclass"):
        register_gradient(int)
    # the rules of meshtorch.ops.gradients are registered by importing any op module
    assert gradient_rule(BinaryOperation) is not None and gradient_rule(ReduceOperation) is not None

"""Unary ops: values and gradients under every layout vs plain PyTorch."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase

SHAPE = "b:4,h:8"


def _x(positive=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g)
    return x.abs() + 0.5 if positive else x


def _unary(name, op, ref, positive=False, grad=True):
    return OpCase(name, lambda mesh, x: op(x), {"x": (SHAPE, _x(positive))}, lambda x: ref(x), grad=grad)


def _sin_product(a, b):  # a module-level function: a kernel the program can serialise
    return a * torch.sin(b)


OP_CASES = [
    _unary("relu", mtf.relu, torch.relu),
    _unary("exp", mtf.exp, torch.exp),
    _unary("log", mtf.log, torch.log, True),
    _unary("sqrt", mtf.sqrt, torch.sqrt, True),
    _unary("rsqrt", mtf.rsqrt, torch.rsqrt, True),
    _unary("tanh", mtf.tanh, torch.tanh),
    _unary("sigmoid", mtf.sigmoid, torch.sigmoid),
    _unary("gelu", mtf.gelu, torch.nn.functional.gelu),
    _unary("gelu_tanh", lambda x: mtf.gelu(x, approximate="tanh"),
           lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    _unary("square", mtf.square, torch.square),
    _unary("negative", mtf.negative, torch.neg),
    _unary("neg_operator", lambda x: -x, lambda x: -x),
    _unary("reciprocal", mtf.reciprocal, torch.reciprocal, True),
    _unary("abs", mtf.abs, torch.abs),
    _unary("sign", mtf.sign, torch.sign, grad=False),
    _unary("identity", mtf.identity, lambda x: x * 1),
    _unary("cast64", lambda x: mtf.cast(mtf.cast(x, torch.float64) * 2.0, torch.float32),
           lambda x: (x.double() * 2).float()),
    _unary("scalar_ops", lambda x: (2.0 - x) * 3.0 / 2.0 + 1.0 - 0.5, lambda x: (2.0 - x) * 3.0 / 2.0 + 1.0 - 0.5),
    _unary("rdiv", lambda x: 2.0 / x, lambda x: 2.0 / x, True),
    _unary("rdiv_zero", lambda x: 0.0 / x, lambda x: 0.0 / x, True),  # regression: its gradient was NaN
    _unary("pow", lambda x: x ** 3, lambda x: x ** 3),
    _unary("stop_gradient", lambda x: mtf.stop_gradient(x) * x, lambda x: x.detach() * x),
    OpCase("slicewise_broadcast",
           lambda mesh, x, y: mtf.slicewise(_sin_product, [x, y], output_shape="b:4,h:8"),
           {"x": ("b:4,h:8", _x()), "y": ("h:8", torch.randn(8))}, lambda x, y: x * torch.sin(y), grad=False),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert ("rows:2;cols:2", "b:rows;h:cols") in layouts


def test_slicewise_with_a_lambda_runs_but_is_not_data():
    """A user's lambda in mtf.slicewise runs like any kernel, but the program cannot be written down:
    to_json names the op instead of writing something another process could not run."""
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.import_tensor(mesh, torch.arange(4.0), "b:4")
    y = mtf.slicewise(lambda a: a * 2, [x], name="doubler")
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "b:all")})
    assert torch.equal(lw.run(y), torch.arange(4.0) * 2)
    with pytest.raises(mtf.NotDataError, match="doubler"):
        lw.to_json([y])

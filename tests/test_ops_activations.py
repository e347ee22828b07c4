"""Mesh TF's extra elementwise ops (ops/activations.py): values and gradients under every layout vs PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.testing import OpCase

SHAPE = "b:4,h:8"


def _x(positive=False, seed=0):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    return x.abs() + 0.5 if positive else x


def _unary(name, op, ref, positive=False, grad=True):
    return OpCase(name, lambda mesh, x: op(x), {"x": (SHAPE, _x(positive))}, lambda x: ref(x), grad=grad)


def _ints():
    return torch.randint(-9, 10, (4, 8), generator=torch.Generator().manual_seed(3), dtype=torch.int32)


def _nonzero_ints():
    v = _ints()
    return torch.where(v == 0, torch.ones_like(v), v)


OP_CASES = [
    _unary("sin", mtf.sin, torch.sin),
    _unary("cos", mtf.cos, torch.cos),
    _unary("elu", mtf.elu, F.elu),
    _unary("selu", mtf.selu, F.selu),
    _unary("softplus", mtf.softplus, F.softplus),
    _unary("swish", mtf.swish, lambda x: x * torch.sigmoid(x)),
    _unary("squared_relu", mtf.squared_relu, lambda x: torch.relu(x) ** 2),
    _unary("leaky_relu", mtf.leaky_relu, lambda x: F.leaky_relu(x, 0.2)),
    _unary("leaky_relu_alpha", lambda x: mtf.leaky_relu(x, alpha=0.05), lambda x: F.leaky_relu(x, 0.05)),
    _unary("mtf_abs", mtf.mtf_abs, torch.abs),
    _unary("pow_scalar", lambda x: mtf.pow(x, 1.7), lambda x: x ** 1.7, positive=True),
    OpCase("pow_tensor", lambda mesh, x, y: mtf.pow(x, y), {"x": (SHAPE, _x(True)), "y": ("h:8", torch.randn(8))},
           lambda x, y: x ** y),
    _unary("to_float", lambda x: mtf.to_float(mtf.cast(x, torch.float64)) * 2.0, lambda x: x.double().float() * 2),
    _unary("to_bfloat16", lambda x: mtf.cast(mtf.to_bfloat16(x), torch.float32),
           lambda x: x.to(torch.bfloat16).float()),
    OpCase("to_int32", lambda mesh, x: mtf.to_int32(x), {"x": (SHAPE, _x() * 5)}, lambda x: x.to(torch.int32),
           grad=False),
    OpCase("logical_not", lambda mesh, x: mtf.logical_not(mtf.greater(x, 0.0)), {"x": (SHAPE, _x())},
           lambda x: torch.logical_not(x > 0), grad=False),
    OpCase("cwise", lambda mesh, x, y: mtf.cwise(torch.hypot, [x, y]), {"x": (SHAPE, _x()), "y": (SHAPE, _x(seed=1))},
           lambda x, y: torch.hypot(x, y), grad=False),
    OpCase("floordiv", lambda mesh, a, b: mtf.floordiv(a, b), {"a": (SHAPE, _ints()), "b": ("h:8", _nonzero_ints()[0])},
           lambda a, b: torch.div(a, b, rounding_mode="floor"), grad=False),
    OpCase("mod", lambda mesh, a, b: mtf.mod(a, b), {"a": (SHAPE, _ints()), "b": ("h:8", _nonzero_ints()[0])},
           lambda a, b: a - b * torch.div(a, b, rounding_mode="floor"), grad=False),
    OpCase("mod_scalar", lambda mesh, a: mtf.mod(a, 4), {"a": (SHAPE, _ints())}, lambda a: a % 4, grad=False),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert ("rows:2;cols:2", "b:rows;h:cols") in layouts


def test_cwise_lets_every_dim_split():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    x = mtf.zeros(mesh, "b:4,h:8")
    y = mtf.cwise(torch.neg, [x])
    assert y.shape == x.shape and y.operation.unsplittable_dims == ()

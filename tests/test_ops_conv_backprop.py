"""Mesh TF's explicit conv / pool gradients (ops/conv_backprop.py, pool_backprop): every layout vs torch autograd."""

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.testing import OpCase


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _vjp(fn, primal, dy):
    p = primal.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(p), p, dy)
    return g


def _conv_nhwc(x, w, stride):  # x [b,h,w,i], w [fh,fw,i,o]; VALID
    return F.conv2d(x.permute(0, 3, 1, 2), w.permute(3, 2, 0, 1), stride=stride).permute(0, 2, 3, 1)


def _convt_nhwc(x, w, stride):  # x [b,h,w,c], w [fh,fw,o,c]; k == stride: SAME == no padding
    return F.conv_transpose2d(x.permute(0, 3, 1, 2), w.permute(3, 2, 0, 1), stride=stride).permute(0, 2, 3, 1)


X = "b:2,h:6,w:6,i:4"
W = "fh:3,fw:3,i:4,o:4"
DY = "b:2,h:4,w:4,o:4"
XT, WT, DYT = "b:2,h:3,w:3,c:4", "fh:2,fw:2,o:4,c:4", "b:2,h:6,w:6,o:4"

OP_CASES = [
    OpCase("conv2d_backprop_input", lambda mesh, w, dy: mtf.conv2d_backprop_input(X, w, dy, [1, 1, 1, 1], "VALID"),
           {"w": (W, _r(3, 3, 4, 4)), "dy": (DY, _r(2, 4, 4, 4, seed=1))},
           lambda w, dy: _vjp(lambda x: _conv_nhwc(x, w, 1), torch.zeros(2, 6, 6, 4), dy), grad=False),
    OpCase("conv2d_backprop_filter", lambda mesh, x, dy: mtf.conv2d_backprop_filter(x, W, dy, (1, 1), "VALID"),
           {"x": (X, _r(2, 6, 6, 4)), "dy": (DY, _r(2, 4, 4, 4, seed=1))},
           lambda x, dy: _vjp(lambda w: _conv_nhwc(x, w, 1), torch.zeros(3, 3, 4, 4), dy), grad=False),
    OpCase("conv2d_transpose_backprop_input",
           lambda mesh, w, dy: mtf.conv2d_transpose_backprop_input(XT, w, dy, (2, 2), "SAME"),
           {"w": (WT, _r(2, 2, 4, 4)), "dy": (DYT, _r(2, 6, 6, 4, seed=1))},
           lambda w, dy: _vjp(lambda x: _convt_nhwc(x, w, 2), torch.zeros(2, 3, 3, 4), dy), grad=False),
    OpCase("conv2d_transpose_backprop_filter",
           lambda mesh, x, dy: mtf.conv2d_transpose_backprop_filter(x, WT, dy, (2, 2), "SAME"),
           {"x": (XT, _r(2, 3, 3, 4)), "dy": (DYT, _r(2, 6, 6, 4, seed=1))},
           lambda x, dy: _vjp(lambda w: _convt_nhwc(x, w, 2), torch.zeros(2, 2, 4, 4), dy), grad=False),
    OpCase("conv3d_backprop_input",
           lambda mesh, w, dy: mtf.conv3d_backprop_input("b:2,d:4,h:4,w:4,i:2", w, dy, 1, "VALID"),
           {"w": ("fd:3,fh:3,fw:3,i:2,o:2", _r(3, 3, 3, 2, 2)), "dy": ("b:2,d:2,h:2,w:2,o:2", _r(2, 2, 2, 2, 2))},
           lambda w, dy: _vjp(lambda x: F.conv3d(x.permute(0, 4, 1, 2, 3), w.permute(4, 3, 0, 1, 2)).permute(
               0, 2, 3, 4, 1), torch.zeros(2, 4, 4, 4, 2), dy), grad=False),
    OpCase("pool_backprop_max",
           lambda mesh, x, dy: mtf.pool_backprop(x, mtf.max_pool2d(x), dy, [2, 2], [2, 2], "MAX_2D"),
           {"x": ("b:4,h:4,w:4,c:4", _r(4, 4, 4, 4)), "dy": ("b:4,h:2,w:2,c:4", _r(4, 2, 2, 4, seed=1))},
           lambda x, dy: _vjp(lambda t: F.max_pool2d(t.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1), x, dy),
           grad=False),
    OpCase("pool_backprop_avg",
           lambda mesh, x, dy: mtf.pool_backprop(x, mtf.avg_pool2d(x), dy, (2, 2), (2, 2), "AVG_2D"),
           {"x": ("b:4,h:4,w:4,c:4", _r(4, 4, 4, 4)), "dy": ("b:4,h:2,w:2,c:4", _r(4, 2, 2, 4, seed=1))},
           lambda x, dy: _vjp(lambda t: F.avg_pool2d(t.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1), x, dy),
           grad=False),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert any(m == "rows:2;cols:2" for m, _ in layouts)


@pytest.mark.parametrize("name,kind,n", [("MAX_2D", "max", 2), ("AVG_3D", "avg", 3)])
def test_pool_fn_is_tf_pooling_on_nhwc_slices(name, kind, n):
    x = _r(2, *([4] * n), 3)
    got = mtf.pool_fn(name)(x, [1] + [2] * n + [1], [2] * n, "VALID")
    fn = getattr(F, f"{kind}_pool{n}d")
    want = fn(x.movedim(-1, 1), 2).movedim(1, -1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="MAX_1D"):
        mtf.pool_fn("MAX_1D")


def test_backprop_rejects_a_dy_of_the_wrong_shape():
    mesh = mtf.Mesh(mtf.Graph())
    w = mtf.zeros(mesh, W)
    with pytest.raises(mtf.ShapeError, match="dy"):
        mtf.conv2d_backprop_input(X, w, mtf.zeros(mesh, "b:2,h:5,w:4,o:4"), 1, "VALID")

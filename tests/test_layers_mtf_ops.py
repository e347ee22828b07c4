"""Mesh TF layers that are compositions without variables (or with their weights as inputs): OpCases,
values and gradients under every layout vs plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.testing import OpCase

L = mtf.layers


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _ClipGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, c):
        ctx.c = c
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy / torch.clamp(dy.square().mean().sqrt() / ctx.c, min=1.0), None


def _mask_ref(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-1, -2) + mask, -1) @ v


OP_CASES = [
    OpCase("dot_product_attention_no_scale",
           lambda m, q, k, v: L.dot_product_attention(q, k, v, None, is_training=False),
           {"q": ("b:2,h:4,l:4,d:4", _r(2, 4, 4, 4)), "k": ("b:2,h:4,m:6,d:4", _r(2, 4, 6, 4, seed=1)),
            "v": ("b:2,h:4,m:6,e:4", _r(2, 4, 6, 4, seed=2))},
           lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1) @ v),
    OpCase("dot_product_attention_mask_extra_logit",
           lambda m, q, k, v, mask: L.dot_product_attention(q, k, v, mask, False, extra_logit=0.0),
           {"q": ("b:2,h:4,l:4,d:4", _r(2, 4, 4, 4)), "k": ("b:2,h:4,m:4,d:4", _r(2, 4, 4, 4, seed=1)),
            "v": ("b:2,h:4,m:4,d:4", _r(2, 4, 4, 4, seed=2)), "mask": ("l:4,m:4", _r(4, 4, seed=3))},
           lambda q, k, v, mask: (torch.exp(q @ k.transpose(-1, -2) + mask) /
                                  (torch.exp(q @ k.transpose(-1, -2) + mask).sum(-1, keepdim=True) + 1.0)) @ v),
    OpCase("sigmoid_cross_entropy", lambda m, x, z: L.sigmoid_cross_entropy_with_logits(x, z),
           {"x": ("b:4,c:8", _r(4, 8) * 3), "z": ("b:4,c:8", torch.rand(4, 8, generator=torch.Generator()))},
           lambda x, z: F.binary_cross_entropy_with_logits(x, z, reduction="none")),
    OpCase("corr", lambda m, x: L.corr(x, mtf.Dimension("c", 4)), {"x": ("b:8,c:4", _r(8, 4))},
           lambda x: torch.corrcoef(x.T)),
    OpCase("compress_mean", lambda m, x: L.compress_mean(x, mtf.Dimension("l", 8), 4),
           {"x": ("b:4,l:8,c:4", _r(4, 8, 4))}, lambda x: x.reshape(4, 2, 4, 4).mean(2)),
    OpCase("max_pool2d", lambda m, x: L.max_pool2d(x), {"x": ("b:4,h:4,w:4,c:4", _r(4, 4, 4, 4))},
           lambda x: F.max_pool2d(x.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1)),
    OpCase("avg_pool3d", lambda m, x: L.avg_pool3d(x), {"x": ("b:4,d:2,h:4,w:4,c:4", _r(4, 2, 4, 4, 4))},
           lambda x: F.avg_pool3d(x.permute(0, 4, 1, 2, 3), 2).permute(0, 2, 3, 4, 1)),
    OpCase("clip_activation_gradient", lambda m, x: L.clip_activation_gradient(x * 1.0, clip_rms_norm=0.1) * 2.0,
           {"x": ("b:4,c:8", _r(4, 8))}, lambda x: _ClipGrad.apply(x * 1.0, 0.1) * 2.0),
    OpCase("reversible_half_residual_and_swap",
           lambda m, x1, x2, w: L.reversible_half_residual_and_swap(
               x1, None, x2, None, lambda t: mtf.tanh(mtf.einsum([t, w], output_shape=t.shape))),
           {"x1": ("b:4,c:4", _r(4, 4)), "x2": ("b:4,c:4", _r(4, 4, seed=1)), "w": ("c:4", _r(4, seed=2))},
           lambda x1, x2, w: [x2, torch.zeros(4, 4), x1 + torch.tanh(x2 * w), torch.zeros(4, 4)]),
    OpCase("dense_expert_dims_and_kernel_weights",
           lambda m, x, w: L.dense(x, mtf.Dimension("o", 4), reduced_dims=[mtf.Dimension("i", 8)],
                                   expert_dims=[mtf.Dimension("e", 2)], kernel_weights=w, use_bias=False),
           {"x": ("e:2,b:4,i:8", _r(2, 4, 8)), "w": ("e:2,i:8,o:4", _r(2, 8, 4, seed=1))},
           lambda x, w: torch.einsum("ebi,eio->ebo", x, w)),
    OpCase("dense_product_glu",
           lambda m, x, w: L.dense_product(x, [mtf.Dimension("i", 8)], [mtf.Dimension("o", 4)],
                                           ["sigmoid", "linear"], kernel_weights=w, use_bias=False),
           {"x": ("b:4,i:8", _r(4, 8)), "w": ("i:8,o:4", _r(8, 4, seed=1))},
           lambda x, w: torch.sigmoid(x @ w) * (x @ w)),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert any(m == "rows:2;cols:2" for m, _ in layouts)


def test_sigmoid_cross_entropy_rejects_other_shapes():
    mesh = mtf.Mesh(mtf.Graph())
    with pytest.raises(mtf.ShapeError, match="targets"):
        L.sigmoid_cross_entropy_with_logits(mtf.zeros(mesh, "b:4"), mtf.zeros(mesh, "c:4"))

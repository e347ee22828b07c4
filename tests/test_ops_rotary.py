"""Rotary position embeddings (ops/rotary.py) and grouped-query attention (layers/attention.py): every layout
vs a plain-PyTorch reference written
from ``transformers``' ``rotate_half`` / ``apply_rotary_pos_emb`` (values and gradients)."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference(x, theta, length_axis=1):
    """HF's Llama rotary on ``[batch, length, heads, d]`` (independent of meshtorch's kernel)."""
    d, n = x.shape[-1], x.shape[length_axis]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.arange(n).float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]  # [length, 1, d]: broadcast over heads
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


OP_CASES = [
    OpCase("rotary", lambda mesh, x: mtf.rotary(x, "length", "d_kv", theta=10000.0),
           {"x": ("batch:4,length:6,heads:4,d_kv:8", _x(4, 6, 4, 8))}, lambda x: _reference(x, 10000.0)),
    OpCase("rotary_theta_other_order",
           lambda mesh, x: mtf.rotary(x, "length", "d_kv", theta=500.0),
           {"x": ("heads:4,batch:2,length:5,d_kv:4", _x(4, 2, 5, 4, seed=1))},
           lambda x: _reference(x.permute(1, 2, 0, 3), 500.0).permute(2, 0, 1, 3)),
]


def _gqa_reference(q, k, v, causal=True):
    """transformers' repeat_kv + scaled dot-product attention on [batch, length, heads, d] tensors."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal)
    return o.transpose(1, 2)


def _rope_gqa(mesh, q, k, v):
    q, k = mtf.rotary(q, "length", "d_kv", theta=100.0), mtf.rotary(k, "length", "d_kv", theta=100.0)
    return mtf.layers.grouped_query_attention(q, k, v, "length", "d_kv", "heads", "kv_heads", causal=True)


OP_CASES += [
    OpCase("grouped_query_attention",
           lambda mesh, q, k, v: mtf.layers.grouped_query_attention(q, k, v, "length", "d_kv", "heads", "kv_heads",
                                                                    causal=True),
           {"q": ("batch:2,length:4,heads:4,d_kv:8", _x(2, 4, 4, 8, seed=2)),
            "k": ("batch:2,length:4,kv_heads:2,d_kv:8", _x(2, 4, 2, 8, seed=3)),
            "v": ("batch:2,length:4,kv_heads:2,d_kv:8", _x(2, 4, 2, 8, seed=4))},
           _gqa_reference),
    OpCase("rotary_then_gqa", _rope_gqa,
           {"q": ("batch:2,length:4,heads:4,d_kv:4", _x(2, 4, 4, 4, seed=5)),
            "k": ("batch:2,length:4,kv_heads:2,d_kv:4", _x(2, 4, 2, 4, seed=6)),
            "v": ("batch:2,length:4,kv_heads:2,d_kv:4", _x(2, 4, 2, 4, seed=7))},
           lambda q, k, v: _gqa_reference(_reference(q, 100.0), _reference(k, 100.0), v)),
]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.name)
def test_layout_invariance(case):
    case.check()


def test_rotary_refuses_bad_dims():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    x = mtf.get_variable(mesh, "x", "length:4,d_kv:3", initializer=0.0)
    with pytest.raises(mtf.ShapeError, match="even"):
        mtf.rotary(x, "length", "d_kv")
    with pytest.raises(mtf.ShapeError, match="no dimension 'pos'"):
        mtf.rotary(x, "pos", "d_kv")

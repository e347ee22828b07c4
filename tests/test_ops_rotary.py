"""Rotary position embeddings (ops/rotary.py): every layout vs a plain-PyTorch reference written
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

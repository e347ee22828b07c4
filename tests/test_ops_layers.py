"""Transformer layers: norms, attention, feed-forward, under every layout vs plain PyTorch."""

import math

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.testing import OpCase

G = torch.Generator().manual_seed(11)
X = torch.randn(4, 8, 12, generator=G)   # [b:4, l:8, d:12]


def _t(*shape):
    return torch.randn(*shape, generator=G)


_Q, _K, _V = _t(4, 4, 8, 8), _t(4, 4, 8, 8), _t(4, 4, 8, 8)     # [b:4, h:4, l:8, k:8]
_KM, _VM = _t(4, 4, 12, 8), _t(4, 4, 12, 8)                   # memory length m:12
_BIAS = _t(4, 8, 12)                                           # [h:4, l:8, m:12]


def _ln_ref(x, d_axis):
    return F.layer_norm(x.movedim(d_axis, -1), [x.shape[d_axis]], eps=1e-6).movedim(-1, d_axis)


def _rms_ref(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


OP_CASES = [
    OpCase("layer_norm", lambda m, x: mtf.layers.layer_norm(x, "d"), {"x": ("b:4,l:8,d:12", X)},
           lambda x: _ln_ref(x, 2)),
    OpCase("layer_norm_middle_dim", lambda m, x: mtf.layers.layer_norm(x, "l"), {"x": ("b:4,l:8,d:12", X)},
           lambda x: _ln_ref(x, 1)),
    OpCase("rms_norm", lambda m, x: mtf.layers.rms_norm(x, "d"), {"x": ("b:4,l:8,d:12", X)}, _rms_ref),
    OpCase("self_attention_causal",
           lambda m, q, k, v: mtf.layers.scaled_dot_product_attention(q, k, v, "l", "k", causal=True),
           {"q": ("b:4,h:4,l:8,k:8", _Q), "k": ("b:4,h:4,l:8,k:8", _K), "v": ("b:4,h:4,l:8,k:8", _V)},
           lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    OpCase("cross_attention_bias",
           lambda m, q, k, v, bias: mtf.layers.scaled_dot_product_attention(q, k, v, "l", "k", memory_length_dim="m",
                                                                     bias=bias, scale=1.0),
           {"q": ("b:4,h:4,l:8,k:8", _Q), "k": ("b:4,h:4,m:12,k:8", _KM), "v": ("b:4,h:4,m:12,k:8", _VM),
            "bias": ("h:4,l:8,m:12", _BIAS)},
           lambda q, k, v, bias: torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v),
    OpCase("self_attention_bias_causal_transposed_inputs",
           lambda m, q, k, v, bias: mtf.layers.scaled_dot_product_attention(q, k, v, "l", "k", causal=True, bias=bias),
           {"q": ("l:8,b:4,k:8,h:4", _Q.permute(2, 0, 3, 1).contiguous()),
            "k": ("b:4,h:4,l:8,k:8", _K), "v": ("b:4,h:4,l:8,k:8", _V),
            "bias": ("h:4,l:8,memory_l:8", _BIAS[:, :, :8].contiguous())},
           lambda q, k, v, bias: torch.softmax(
               (q.permute(1, 3, 0, 2) @ k.transpose(-1, -2)) / math.sqrt(8) + bias
               + torch.full((8, 8), float("-inf")).triu(1), -1).matmul(v).permute(2, 0, 3, 1)),
]


def _mha_ref(x, kernels, causal):
    wq, wk, wv, wo = kernels
    q = torch.einsum("bld,dhk->bhlk", x, wq)
    k = torch.einsum("bld,dhk->bhlk", x, wk)
    v = torch.einsum("bld,dhk->bhlk", x, wv)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch.einsum("bhlk,hkd->bld", o, wo)


def _variables(build, inputs):
    """Initial values of the variables a layer creates (counter-based, identical for any layout)."""
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    ts = {n: mtf.get_variable(mesh, n, s, initializer=0.0) for n, (s, _) in inputs.items()}
    build(mesh, **ts)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    return {n: lw.variable_value(n) for n in lw.variable_names if n not in inputs}


def _mha_build(m, x):
    return mtf.layers.multihead_attention_layer(x, mtf.Dimension("heads", 4), mtf.Dimension("d_kv", 4), "l",
                                          causal=True, name="mha")


_MHA_IN = {"x": ("b:4,l:8,d:12", X)}
_MHA_VARS = _variables(_mha_build, _MHA_IN)


def _ffn_build(m, x):
    return mtf.layers.dense_act_dense(x, mtf.Dimension("d_ff", 16), activation="gelu", gated=True, name="ffn")


_FFN_VARS = _variables(_ffn_build, _MHA_IN)

OP_CASES += [
    OpCase("multihead_attention", _mha_build, _MHA_IN,
           lambda x: _mha_ref(x, [_MHA_VARS[f"mha/{p}"] for p in "qkvo"], True)),
    OpCase("ffn_geglu", _ffn_build, _MHA_IN,
           lambda x: (F.gelu(x @ _FFN_VARS["ffn/wi_gate/kernel"]) * (x @ _FFN_VARS["ffn/wi/kernel"]))
           @ _FFN_VARS["ffn/wo/kernel"]),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    case.check()


def test_attention_rejects_split_length():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    q = mtf.placeholder(mesh, "q", "b:4,l:8,k:8")
    mtf.layers.scaled_dot_product_attention(q, q, q, "l", "k")
    with pytest.raises(mtf.LayoutError, match="'l'"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "l:all")})

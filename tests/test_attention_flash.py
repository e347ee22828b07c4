"""Attention through PyTorch's CPU flash kernels (no bias, equal key/value sizes): values and gradients
under every layout vs plain PyTorch softmax attention, including cross attention, transposed inputs
and float64."""

import math

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase

G = torch.Generator().manual_seed(13)


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G, dtype=dtype)


_Q, _KM, _VM = _t(4, 4, 8, 8), _t(4, 4, 12, 8), _t(4, 4, 12, 8)      # [b:4, h:4, l:8 / m:12, k:8]
_Q64, _K64, _V64 = (_t(4, 2, 8, 4, dtype=torch.float64) for _ in range(3))


def _ref(q, k, v, scale, causal=False):
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s + torch.full(s.shape[-2:], float("-inf"), dtype=s.dtype).triu(1)
    return torch.softmax(s, -1) @ v


CASES = [
    OpCase("cross_attention_no_bias",
           lambda m, q, k, v: mtf.layers.scaled_dot_product_attention(q, k, v, "l", "k", memory_length_dim="m",
                                                                       scale=0.5),
           {"q": ("b:4,h:4,l:8,k:8", _Q), "k": ("b:4,h:4,m:12,k:8", _KM), "v": ("b:4,h:4,m:12,k:8", _VM)},
           lambda q, k, v: _ref(q, k, v, 0.5)),
    OpCase("causal_transposed_inputs",
           lambda m, q, k, v: mtf.layers.scaled_dot_product_attention(q, k, v, "l", "k", causal=True),
           {"q": ("l:8,b:4,k:8,h:4", _Q.permute(2, 0, 3, 1).contiguous()),
            "k": ("h:4,b:4,k:8,l:8", _KM[:, :, :8].permute(1, 0, 3, 2).contiguous()),
            "v": ("b:4,h:4,l:8,k:8", _VM[:, :, :8].contiguous())},
           lambda q, k, v: _ref(q.permute(1, 3, 0, 2), k.permute(1, 0, 3, 2), v, 1 / math.sqrt(8),
                                causal=True).permute(2, 0, 3, 1)),
    OpCase("causal_float64",
           lambda m, q, k, v: mtf.layers.scaled_dot_product_attention(q, k, v, "l", "k", causal=True),
           {"q": ("b:4,h:2,l:8,k:4", _Q64), "k": ("b:4,h:2,l:8,k:4", _K64), "v": ("b:4,h:2,l:8,k:4", _V64)},
           lambda q, k, v: _ref(q, k, v, 0.5, causal=True)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flash_attention_layouts(case):
    case.check()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_device_generic_path_layouts(case, monkeypatch):
    """The path taken on devices without the CPU flash kernel (CUDA): F.scaled_dot_product_attention forward,
    gradient by recompute under autograd. Forced on the CPU here; values and gradients vs plain softmax
    attention under every layout, as for the CPU kernel."""
    from meshtorch.layers import attention

    calls = []
    monkeypatch.setattr(attention, "_cpu_flash", lambda t: calls.append(t.device) or False)
    case.check()
    assert calls  # the generic path ran

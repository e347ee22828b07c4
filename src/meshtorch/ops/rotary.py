"""Rotary position embeddings (RoPE, Su et al. 2021, "RoFormer", section 3.4) on named dims.

``rotary(x, length_dim, feature_dim, theta)`` rotates each pair of features ``(j, j + d/2)`` of
``x`` at position ``p`` by the angle ``p * theta^(-2j/d)``, Hugging Face's ``rotate_half``
convention (``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``): the first and
second halves of the feature dim form the pairs, not interleaved neighbours (GPT-NeoX / Llama-HF,
unlike the original RoFormer and Mesh TF's ``rotary`` which pair ``2j`` and ``2j + 1``).

The sequence and feature dims are needed whole (``unsplittable_dims``); every other dim (batch,
heads, kv_heads) may be split with no communication. The map is linear and orthogonal, so a
pending partial sum passes through it and its gradient is the inverse rotation.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.dims import convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.ops.elementwise import SlicewiseOperation

__all__ = ["rotary", "rotary_cos_sin"]


def rotary_cos_sin(length: int, dim: int, theta: float, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[length, dim]``, computed as ``transformers``' ``LlamaRotaryEmbedding``
    (default rope type): ``inv_freq = 1 / theta^(arange(0, dim, 2) / dim)`` in float32, angles
    ``position x inv_freq`` in float32, duplicated over both halves, then cos / sin cast to ``dtype``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    pos = torch.arange(length, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def _k_rotary(t: torch.Tensor, *, length_axis: int, feature_axis: int, theta: float, inverse: bool) -> torch.Tensor:
    """Rotate slice ``t`` (whole length and feature axes): ``t cos + rotate_half(t) sin``; ``inverse``:
    the transpose ``t cos - rotate_half(t sin)``."""
    x = t.movedim((length_axis, feature_axis), (-2, -1))
    cos, sin = rotary_cos_sin(x.shape[-2], x.shape[-1], theta, x.dtype)
    cos, sin = cos.to(x.device), sin.to(x.device)
    y = x * cos - _rotate_half(x * sin) if inverse else x * cos + _rotate_half(x) * sin
    return y.movedim((-2, -1), (length_axis, feature_axis))


def _rotary_grad(op, dy, *, length: str, feature: str, theta: float, inverse: bool):
    return [_rotary(dy, length, feature, theta, not inverse, f"{op.name}_grad")]


def _rotary(x: Tensor, length: str, feature: str, theta: float, inverse: bool, name) -> Tensor:
    names = [d.name for d in x.shape]
    kernel = functools.partial(_k_rotary, length_axis=names.index(length), feature_axis=names.index(feature),
                               theta=float(theta), inverse=bool(inverse))
    grad = functools.partial(_rotary_grad, length=length, feature=feature, theta=float(theta), inverse=bool(inverse))
    return SlicewiseOperation(kernel, [x], output_shape=x.shape, grad_function=grad, name=name or "rotary",
                              linear=True, unsplittable_dims=(length, feature)).outputs[0]


def rotary(x: Tensor, length_dim, feature_dim, theta: float = 10000.0, name: str | None = None) -> Tensor:
    """Rotary position embedding of ``x`` over positions ``0 .. length - 1`` (HF ``rotate_half`` pairs).

    Args:
        x: float ``[..., length, ..., feature, ...]`` (e.g. queries ``[batch, length, heads, d_kv]``).
        length_dim: the position dim (Dimension or name); position ``p`` is its index.
        feature_dim: the rotated feature dim, of even size.
        theta: the base (``rope_theta`` of a Hugging Face config; 10000 in RoFormer).

    Returns:
        Tensor of ``x``'s shape and dtype. Layouts: any split of the other dims, no communication;
        ``length`` and ``feature`` are unsplittable.

    Raises:
        ShapeError: naming ``x`` if it lacks a dim or the feature size is odd.
    """
    length = length_dim if isinstance(length_dim, str) else convert_to_dimension(length_dim).name
    feature = feature_dim if isinstance(feature_dim, str) else convert_to_dimension(feature_dim).name
    for n in (length, feature):
        if n not in x.shape:
            raise ShapeError(f"rotary: tensor {x.name!r} {x.shape} has no dimension {n!r}.")
    if length == feature:
        raise ShapeError(f"rotary: length and feature dims of {x.name!r} must differ, both are {length!r}.")
    if x.shape.get_dim_by_name(feature).size % 2:
        raise ShapeError(f"rotary: feature dim {feature!r} of {x.name!r} {x.shape} must have an even size.")
    return _rotary(x, length, feature, theta, False, name)

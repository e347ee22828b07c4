"""Attention masks (additive biases) and loss weights, as Mesh TF's ``mtf.layers`` builds them.

Each mask is ``-1e9`` where attention is disallowed and ``0`` elsewhere, in ``dtype``; add it to the
attention logits. Memory positions carry the dimension ``memory_length``, renamed from ``length``
(Mesh TF's convention, :func:`rename_length_to_memory_length`). All are elementwise compositions of
graph ops: any layout of the inputs works with no communication beyond what broadcasting needs.
"""

from __future__ import annotations

import torch

from meshtorch.core.graph import Tensor
from meshtorch.ops.binary import equal, less, not_equal
from meshtorch.ops.elementwise import cast
from meshtorch.ops.reshape import rename_dimension

__all__ = ["rename_length_to_memory_length", "attention_mask_ignore_padding", "attention_mask_autoregressive",
           "attention_mask_same_segment", "weights_nonzero"]


def rename_length_to_memory_length(x: Tensor, length_name: str = "length",
                                   memory_length_name: str = "memory_length") -> Tensor:
    """``x`` with ``length_name`` renamed ``memory_length_name`` (Mesh TF ``layers.rename_length_to_memory_length``)."""
    return rename_dimension(x, length_name, memory_length_name)


def attention_mask_ignore_padding(inputs: Tensor, dtype=torch.float32) -> Tensor:
    """Bias hiding padding (id 0) memory positions (Mesh TF ``layers.attention_mask_ignore_padding``).

    Args:
        inputs: integer ids ``[..., length]``; 0 marks padding.
        dtype: float dtype of the result.

    Returns:
        ``[..., memory_length]``: ``-1e9`` where ``inputs == 0``, else 0.
    """
    inputs = rename_length_to_memory_length(inputs)
    return cast(equal(inputs, 0), dtype) * -1e9


def attention_mask_autoregressive(query_pos: Tensor, dtype=torch.float32) -> Tensor:
    """Bias hiding memory positions after the query position (Mesh TF ``layers.attention_mask_autoregressive``).

    Args:
        query_pos: integer positions ``[..., length]`` (e.g. ``mtf.range(mesh, length_dim)``).
        dtype: float dtype of the result.

    Returns:
        ``[..., length, memory_length]``: ``-1e9`` where ``query_pos < memory_pos``, else 0.
    """
    memory_pos = rename_length_to_memory_length(query_pos)
    return cast(less(query_pos, memory_pos), dtype) * -1e9


def attention_mask_same_segment(query_segment: Tensor, memory_segment: Tensor | None = None,
                                dtype=torch.float32) -> Tensor:
    """Bias hiding memory positions of another segment (Mesh TF ``layers.attention_mask_same_segment``).

    Args:
        query_segment: integer segment ids ``[..., length]``.
        memory_segment: integer segment ids ``[..., length]`` (renamed to ``memory_length``
            here); default ``query_segment`` (self-attention).
        dtype: float dtype of the result.

    Returns:
        ``[..., length, memory_length]``: ``-1e9`` where the segments differ, else 0.
    """
    memory_segment = rename_length_to_memory_length(query_segment if memory_segment is None else memory_segment)
    return cast(not_equal(query_segment, memory_segment), dtype) * -1e9


def weights_nonzero(targets: Tensor, dtype=torch.float32) -> Tensor:
    """Loss weights: 1 where ``targets != 0``, else 0, in ``dtype`` (Mesh TF ``layers.weights_nonzero``)."""
    return cast(not_equal(targets, 0), dtype)

"""Mesh TF's local (blocked) and memory-compressed self-attention layers: masked_local_attention_1d
(+ incremental), local_self_attention_spatial_blocks, local_2d_self_attention_spatial_blocks, their halo
exchanges, and multihead_self_attention_memory_compressed (mesh_tensorflow/layers.py).

Built from einsum, reshape, halo exchanges and :func:`~meshtorch.layers.mtf_attention.dot_product_attention`
(no logit scale, as Mesh TF). The block dims (``length`` after blocking, ``num_w_blocks``) may be split
over mesh axes: the halo exchange then sends the neighbouring block's keys and values.
"""

from __future__ import annotations

import torch

from meshtorch.core.dims import Dimension, Shape, convert_to_dimension
from meshtorch.core.graph import Tensor
from meshtorch.layers.misc import attention_bias_local_block, compress_mean
from meshtorch.layers.mtf_attention import dot_product_attention, qkvo_variables
from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import equal, greater, less_equal, mod
from meshtorch.ops.conv_blocks import halo_exchange
from meshtorch.ops.einsum import einsum
from meshtorch.ops.precision import VariableDType
from meshtorch.ops.reshape import rename_dimension, reshape
from meshtorch.ops.sequence import mtf_range
from meshtorch.ops.sequence_more import left_halo_exchange
from meshtorch.ops.shape import pad, where

__all__ = ["local_1d_halo_exchange", "local_self_attention_spatial_blocks", "masked_local_attention_1d",
           "masked_local_attention_1d_incremental", "local_2d_halo_exchange", "local_2d_self_attention_spatial_blocks",
           "multihead_self_attention_memory_compressed"]


def local_1d_halo_exchange(k: Tensor, v: Tensor, num_w_blocks, w_dim, mask_right):
    """Keys and values extended by one block of neighbours along ``w_dim`` (Mesh TF's helper): from the
    left only (``mask_right``) or both sides; zero padding when ``num_w_blocks`` is None."""
    w_dim = convert_to_dimension(w_dim)
    n = w_dim.size
    if num_w_blocks is not None:
        if mask_right:
            return (left_halo_exchange(k, num_w_blocks, w_dim, n), left_halo_exchange(v, num_w_blocks, w_dim, n))
        return halo_exchange(k, num_w_blocks, w_dim, n), halo_exchange(v, num_w_blocks, w_dim, n)
    pads = [n, 0] if mask_right else [n, n]
    return pad(k, pads, w_dim.name), pad(v, pads, w_dim.name)


def local_self_attention_spatial_blocks(query_antecedent: Tensor, kv_channels, heads, is_training, memory_w_dim=None,
                                        mask_right=False, master_dtype=torch.float32, slice_dtype=torch.float32,
                                        name=None) -> Tensor:
    """Attention within a block and its neighbour blocks (Mesh TF ``layers.local_self_attention_spatial_blocks``).

    Args:
        query_antecedent: ``[batch, num_w_blocks, w_dim, io_channels]``.
        kv_channels, heads: Dimensions. mask_right: attend only to the left block and causally within
            the block (decoder); else to both neighbours.

    Returns:
        ``[batch, num_w_blocks, w_dim, io_channels]``. Variables ``{name}/qkvo``.
    """
    kv_channels, heads = convert_to_dimension(kv_channels), convert_to_dimension(heads)
    w_dim, io_channels = query_antecedent.shape.dims[-2:]
    batch, num_w_blocks = query_antecedent.shape.dims[:2]
    mesh = query_antecedent.mesh
    scope = mesh.graph.unique_name(name or "multihead_attention")
    wq, wk, wv, wo = qkvo_variables(mesh, scope, heads, io_channels, kv_channels,
                                    VariableDType(master_dtype, slice_dtype, query_antecedent.dtype))
    memory = rename_dimension(query_antecedent, w_dim.name, "memory_" + w_dim.name)
    memory_w_dim = memory.shape.dims[-2]
    q = einsum([query_antecedent, wq], output_shape=Shape([batch, heads, num_w_blocks, w_dim, kv_channels]))
    k = einsum([memory, wk], output_shape=Shape([batch, heads, num_w_blocks, memory_w_dim, kv_channels]))
    v = einsum([memory, wv], output_shape=Shape([batch, heads, num_w_blocks, memory_w_dim, kv_channels]))
    k, v = local_1d_halo_exchange(k, v, num_w_blocks, memory_w_dim, mask_right)
    mask = attention_bias_local_block(mesh, w_dim, memory_w_dim) if mask_right else None
    out = dot_product_attention(q, k, v, mask=mask, is_training=is_training)
    return einsum([out, wo], output_shape=Shape([batch, num_w_blocks, w_dim, io_channels]))


def masked_local_attention_1d(x: Tensor, kv_channels, heads, is_training, window_size=128,
                              master_dtype=torch.float32, slice_dtype=torch.float32, length_per_split=None,
                              return_kv=None, params=None, name=None) -> Tensor:
    """Causal attention to the previous ``window_size`` positions (Mesh TF ``layers.masked_local_attention_1d``).

    ``length`` is cut into blocks of ``block_length`` (the largest divisor of ``length_per_split`` not
    above ``max(window_size, 128)``); each block attends to itself and ``window_size`` positions to its
    left (``left_halo_exchange``), masked so that position i sees ``(i - block_length, i]``.

    Args:
        x: ``[batch..., length, io_channels]``. kv_channels, heads: Dimensions.
        length_per_split: ``length`` per processor when it is split (default the whole length).
        return_kv: optional list; ``k`` and ``v`` (``[batch..., heads, length, kv]``) are appended.
        params: optional ``[wq, wk, wv, wo]`` instead of new variables ``{name}/qkvo``.

    Returns:
        ``[batch..., length, io_channels]``.
    """
    kv_channels, heads = convert_to_dimension(kv_channels), convert_to_dimension(heads)
    batch_dims = x.shape.dims[:-2]
    length, io_channels = x.shape.dims[-2:]
    scope = x.graph.unique_name(name or "masked_local_attention_1d")
    wq, wk, wv, wo = params if params is not None else qkvo_variables(
        x.mesh, scope, heads, io_channels, kv_channels, VariableDType(master_dtype, slice_dtype, x.dtype))
    qkv_shape = Shape(batch_dims + [heads, length, kv_channels])
    q, k, v = (einsum([x, w], output_shape=qkv_shape) for w in (wq, wk, wv))
    if return_kv is not None:
        return_kv.extend([k, v])
    length_per_split = length.size if length_per_split is None else length_per_split
    block_length = max(window_size, 128)
    while length_per_split % block_length != 0:
        block_length -= 1
    query_block = Dimension("query_block_length", block_length)
    memory_block = Dimension("memory_block_length", block_length)
    num_blocks = Dimension(length.name, length.size // block_length)
    q = reshape(q, batch_dims + [heads, num_blocks, query_block, kv_channels])
    k = reshape(k, batch_dims + [heads, num_blocks, memory_block, kv_channels])
    v = reshape(v, batch_dims + [heads, num_blocks, memory_block, kv_channels])
    k = left_halo_exchange(k, num_blocks, memory_block, window_size)
    v = left_halo_exchange(v, num_blocks, memory_block, window_size)
    padded = Dimension("memory_block_length", window_size + block_length)
    mpos = mtf_range(x.mesh, padded, torch.float32)
    qpos = mtf_range(x.mesh, query_block, torch.float32) + float(window_size)
    mask = ew.cast(greater(mpos, qpos), x.dtype) * -1e9
    mask = mask + ew.cast(less_equal(mpos, qpos - float(block_length)), x.dtype) * -1e9
    o = dot_product_attention(q, k, v, mask=mask, is_training=is_training)
    o = reshape(o, batch_dims + [heads, length, kv_channels])
    return einsum([o, wo], output_shape=Shape(batch_dims + [length, io_channels]))


def masked_local_attention_1d_incremental(x: Tensor, prev_k: Tensor, prev_v: Tensor, step_num, master_dtype=None,
                                          slice_dtype=None, params=None, name=None):
    """One decoding step of :func:`masked_local_attention_1d` with a circular cache of the last
    ``window_length`` keys and values (Mesh TF ``layers.masked_local_attention_1d_incremental``).

    Args:
        x: ``[batch..., io_channels]``. prev_k, prev_v: ``[batch..., heads, window_length, kv_channels]``.
        step_num: int Tensor; the new k, v go to slot ``step_num mod window_length``.

    Returns:
        ``(y [batch..., io_channels], new_k, new_v)``.
    """
    batch_dims = x.shape.dims[:-1]
    io_channels = x.shape.dims[-1]
    heads, window_length, kv_channels = prev_k.shape.dims[-3:]
    scope = x.graph.unique_name(name or "masked_local_attention_1d")
    wq, wk, wv, wo = params if params is not None else qkvo_variables(
        x.mesh, scope, heads, io_channels, kv_channels,
        VariableDType(master_dtype or x.dtype, slice_dtype or master_dtype or x.dtype, x.dtype))
    q, k, v = (einsum([x, w], output_shape=Shape(batch_dims + [heads, kv_channels])) for w in (wq, wk, wv))
    current = equal(mtf_range(x.mesh, window_length, dtype=step_num.dtype), mod(step_num, window_length.size))
    k = where(current, k, prev_k, output_shape=prev_k.shape)
    v = where(current, v, prev_v, output_shape=prev_v.shape)
    o = dot_product_attention(q, k, v, mask=None, is_training=False)
    return einsum([o, wo], output_shape=x.shape), k, v


def local_2d_halo_exchange(k: Tensor, v: Tensor, num_h_blocks, h_dim, num_w_blocks, w_dim, mask_right):
    """Keys and values extended by one block of neighbours along ``h_dim`` then ``w_dim`` (Mesh TF's
    helper): from the left/top only (``mask_right``) or both sides; zero padding for a None blocks dim."""
    for blocks_dim, size_dim in ((num_h_blocks, h_dim), (num_w_blocks, w_dim)):
        size_dim = convert_to_dimension(size_dim)
        n = size_dim.size
        if blocks_dim is not None:
            fn = left_halo_exchange if mask_right else halo_exchange
            k, v = fn(k, blocks_dim, size_dim, n), fn(v, blocks_dim, size_dim, n)
        else:
            pads = [n, 0] if mask_right else [n, n]
            k, v = pad(k, pads, size_dim.name), pad(v, pads, size_dim.name)
    return k, v


def local_2d_self_attention_spatial_blocks(query_antecedent: Tensor, kv_channels, heads, is_training,
                                           memory_h_dim=None, memory_w_dim=None, mask_right=False,
                                           master_dtype=torch.float32, slice_dtype=torch.float32,
                                           name=None) -> Tensor:
    """Attention within a 2-d block and its 8 neighbour blocks (Mesh TF
    ``layers.local_2d_self_attention_spatial_blocks``), no logit scale.

    Computed exactly as Mesh TF does: :func:`dot_product_attention` with keys ``[..., memory_h, memory_w,
    kv]`` takes the softmax over ``memory_w`` only, and its einsums sum over ``memory_h`` (the logits are
    summed over memory rows before the softmax, the values after it).

    Args:
        query_antecedent: ``[batch, num_h_blocks, num_w_blocks, h_dim, w_dim, io_channels]``.

    Returns:
        the query's shape. Variables ``{name}/qkvo``.

    Raises:
        ValueError: for ``mask_right=True``: Mesh TF 0.1.21 builds that mask with
            ``attention_bias_local_2d_block``, which cannot run (see the porting doc).
    """
    if mask_right:
        raise ValueError("local_2d_self_attention_spatial_blocks: mask_right=True needs Mesh TF's "
                         "attention_bias_local_2d_block, which cannot run in Mesh TF 0.1.21 either.")
    kv_channels, heads = convert_to_dimension(kv_channels), convert_to_dimension(heads)
    h_dim, w_dim, io_channels = query_antecedent.shape.dims[-3:]
    batch, num_h_blocks, num_w_blocks = query_antecedent.shape.dims[:3]
    mesh = query_antecedent.mesh
    scope = mesh.graph.unique_name(name or "multihead_attention")
    wq, wk, wv, wo = qkvo_variables(mesh, scope, heads, io_channels, kv_channels,
                                    VariableDType(master_dtype, slice_dtype, query_antecedent.dtype))
    memory = rename_dimension(query_antecedent, h_dim.name, "memory_" + h_dim.name)
    memory = rename_dimension(memory, w_dim.name, "memory_" + w_dim.name)
    memory_h_dim, memory_w_dim = memory.shape.dims[-3:-1]
    blocks = [batch, heads, num_h_blocks, num_w_blocks]
    q = einsum([query_antecedent, wq], output_shape=Shape(blocks + [h_dim, w_dim, kv_channels]))
    k = einsum([memory, wk], output_shape=Shape(blocks + [memory_h_dim, memory_w_dim, kv_channels]))
    v = einsum([memory, wv], output_shape=Shape(blocks + [memory_h_dim, memory_w_dim, kv_channels]))
    k, v = local_2d_halo_exchange(k, v, num_h_blocks, memory_h_dim, num_w_blocks, memory_w_dim, mask_right)
    out = dot_product_attention(q, k, v, mask=None, is_training=is_training)
    return einsum([out, wo], output_shape=Shape([batch, num_h_blocks, num_w_blocks, h_dim, w_dim, io_channels]))


def multihead_self_attention_memory_compressed(x: Tensor, mask_right, compression_factor, kv_channels, heads,
                                               is_training, dropout=0.0, dropout_broadcast_dims=None,
                                               master_dtype=torch.float32, slice_dtype=torch.float32,
                                               name="multihead_attention") -> Tensor:
    """Self-attention to a memory of ``length / compression_factor`` window means of x (Mesh TF
    ``layers.multihead_self_attention_memory_compressed``; Liu et al. 2018), with ``extra_logit=0``.

    ``mask_right``: query i sees compressed position m only if ``m * c + c - 1 <= i``.
    Returns ``[batch..., length, io_channels]``; variables ``{name}/qkvo``.
    """
    kv_channels, heads = convert_to_dimension(kv_channels), convert_to_dimension(heads)
    batch_dims = x.shape.dims[:-2]
    length, io_channels = x.shape.dims[-2:]
    scope = x.graph.unique_name(name or "compressed_attention")
    wq, wk, wv, wo = qkvo_variables(x.mesh, scope, heads, io_channels, kv_channels,
                                    VariableDType(master_dtype, slice_dtype, x.dtype))
    memory = rename_dimension(compress_mean(x, length, compression_factor), length.name, "memory_length")
    memory_length = memory.shape.dims[-2]
    q = einsum([x, wq], output_shape=Shape(batch_dims + [heads, length, kv_channels]))
    k = einsum([memory, wk], output_shape=Shape(batch_dims + [heads, memory_length, kv_channels]))
    v = einsum([memory, wv], output_shape=Shape(batch_dims + [heads, memory_length, kv_channels]))
    mask = None
    if mask_right:
        qpos = mtf_range(x.mesh, length, dtype=torch.int32)
        mpos = mtf_range(x.mesh, memory_length, dtype=torch.int32) * compression_factor + (compression_factor - 1)
        mask = ew.cast(greater(mpos, qpos), x.dtype) * -1e9
    o = dot_product_attention(q, k, v, mask, is_training, dropout, dropout_broadcast_dims, extra_logit=0.0)
    return einsum([o, wo], output_shape=Shape(batch_dims + [length, io_channels]))

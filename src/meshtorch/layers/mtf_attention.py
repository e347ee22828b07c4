"""Mesh TF's attention layers with Mesh TF's signatures: no logit scale, masks as additive tensors.

``dot_product_attention``, ``multihead_attention``, ``multihead_attention_params`` /
``multihead_attention_vars``, ``rename_length_to_memory_length``, ``multihead_self_attention_incremental``
and ``multihead_encdec_attention_incremental`` (mesh_tensorflow/layers.py), built from einsum, softmax
and dropout. As in Mesh TF no ``1/sqrt(d_kv)`` scale is applied (the initialisers of
``multihead_attention_params`` account for it). The attention itself is meshtorch's one implementation,
:func:`meshtorch.layers.attention.attention` (called with ``scale=1``); this module keeps Mesh TF's
signatures, variable names and initialisers.

Variable names: ``{name}/q``, ``/k``, ``/v``, ``/o`` (or ``{name}/qkvo`` when combined), where ``name``
is made unique in the graph (Mesh TF's ``tf.variable_scope(name)``).
"""

from __future__ import annotations

import torch

from meshtorch.core.dims import Dimension, Shape, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.layers.attention import attention
from meshtorch.ops import rng
from meshtorch.ops.binary import greater, multiply
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast
from meshtorch.ops.indexing import one_hot
from meshtorch.ops.initializers import Initializer, random_normal_initializer
from meshtorch.ops.precision import VariableDType
from meshtorch.ops.reshape import rename_dimension
from meshtorch.ops.sequence import mtf_range
from meshtorch.ops.shape import unstack
from meshtorch.ops.variables import get_variable

__all__ = ["dot_product_attention", "multihead_attention", "multihead_attention_params", "multihead_attention_vars",
           "rename_length_to_memory_length", "multihead_self_attention_incremental",
           "multihead_encdec_attention_incremental", "qkvo_variables"]


def dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask, is_training, dropout=0.0,
                          dropout_broadcast_dims=None, extra_logit=None) -> Tensor:
    """``dropout(softmax(q k^T + mask)) v`` over the last two dims (Mesh TF ``layers.dot_product_attention``).

    A Mesh-TF-signature wrapper of :func:`meshtorch.layers.attention.attention` (scale 1): the fused op
    where it applies, else the einsum/softmax composite.

    Args:
        q: ``[..., length_q, depth_k]``; k: ``[..., length_kv, depth_k]``; v: ``[..., length_kv, depth_v]``
            (the leading dims match q's). No scale is applied.
        mask: None or an additive float Tensor broadcastable to ``[..., length_q, length_kv]``
            (e.g. ``attention_mask_autoregressive``).
        is_training, dropout, dropout_broadcast_dims: dropout of the attention weights (rate
            ``dropout``; the mask is shared over ``dropout_broadcast_dims``).
        extra_logit: optional extra logit in the softmax (see :func:`meshtorch.softmax`).

    Returns:
        Tensor ``[..., length_q, depth_v]``.
    """
    return attention(q, k, v, k.shape.dims[-2], q.shape.dims[-1], v.shape.dims[-1], bias=mask, scale=1.0,
                     dropout_rate=dropout if is_training else 0.0, dropout_broadcast_dims=dropout_broadcast_dims,
                     extra_logit=extra_logit, output_shape=Shape(q.shape.dims[:-1] + [v.shape.dims[-1]]))


class _StackedNormal(Initializer):
    """Normal(0, stddevs[i]) for index i of the first dim (Mesh TF's ``qkvo_initializer``)."""

    def __init__(self, stddevs):
        self.stddevs = [float(s) for s in stddevs]

    def values(self, shape, dtype, seed, key, index):
        rest = shape.size // shape.dims[0].size
        scale = torch.tensor(self.stddevs, dtype=torch.float64, device=index.device)[index // rest]
        return rng.normal(seed, key, index) * scale


def multihead_attention_params(mesh, heads, io_channels, kv_channels, variable_dtype, combine=False):
    """Variables ``wq, wk, wv, wo``, each ``[heads, io_channels, kv_channels]`` (Mesh TF
    ``multihead_attention_params``), normal with stddev ``io^-0.5 kv^-0.25`` (q, k), ``io^-0.5`` (v),
    ``(io heads)^-0.5`` (o). ``combine=True``: one variable ``qkvo`` ``[qkvo:4, heads, io, kv]``, unstacked.

    Names: ``q``, ``k``, ``v``, ``o`` / ``qkvo`` made unique in the graph (Mesh TF: under the caller's
    variable scope).
    """
    heads, io_channels, kv_channels = (convert_to_dimension(d) for d in (heads, io_channels, kv_channels))
    qk = (io_channels.size ** -0.5) * (kv_channels.size ** -0.25)
    vs, os_ = io_channels.size ** -0.5, (io_channels.size * heads.size) ** -0.5
    g = mesh.graph
    if combine:
        var = get_variable(mesh, _free_name(g, "qkvo"), Shape([Dimension("qkvo", 4), heads, io_channels, kv_channels]),
                           initializer=_StackedNormal([qk, qk, vs, os_]), dtype=variable_dtype)
        return unstack(var, "qkvo")
    return [get_variable(mesh, _free_name(g, n), Shape([heads, io_channels, kv_channels]),
                         initializer=random_normal_initializer(stddev=s), dtype=variable_dtype)
            for n, s in zip("qkvo", [qk, qk, vs, os_], strict=True)]


def _free_name(graph, name: str) -> str:
    """``name``, or ``name_1``, ``name_2``... : the first not used in ``graph`` (not reserved here)."""
    cand, i = name, 0
    while graph.name_in_use(cand):
        i += 1
        cand = f"{name}_{i}"
    return cand


def multihead_attention_vars(mesh, heads, io_channels, kv_channels, master_dtype, slice_dtype, activation_dtype):
    """``multihead_attention_params(..., VariableDType(master, slice, activation), combine=True)``
    (Mesh TF's deprecated form)."""
    return multihead_attention_params(mesh, heads, io_channels, kv_channels,
                                      VariableDType(master_dtype, slice_dtype, activation_dtype), combine=True)


def rename_length_to_memory_length(x: Tensor, length_name="length", memory_length_name="memory_length") -> Tensor:
    """``rename_dimension(x, length_name, memory_length_name)`` (Mesh TF's helper)."""
    return rename_dimension(x, length_name, memory_length_name)


def multihead_attention(query_antecedent: Tensor, memory_antecedent, mask, kv_channels, heads, is_training,
                        dropout=0.0, dropout_broadcast_dims=None, master_dtype=torch.float32,
                        slice_dtype=torch.float32, name="multihead_attention") -> Tensor:
    """Multi-head attention with input and output projections (Mesh TF ``layers.multihead_attention``).

    Args:
        query_antecedent: ``[batch..., query_length, io_channels]``.
        memory_antecedent: ``[batch..., memory_length, io_channels]``, or None (self-attention: the
            query with its length renamed ``memory_length``).
        mask: additive mask for the logits ``[batch..., heads, query_length, memory_length]`` or a
            broadcastable subset, or None.
        kv_channels, heads: Dimensions. is_training, dropout, dropout_broadcast_dims: attention dropout.
        master_dtype, slice_dtype: the variables' dtypes (activations in the query's dtype).
        name: scope of the variables ``{name}/qkvo`` (combined, as Mesh TF).

    Returns:
        Tensor ``[batch..., query_length, io_channels]``. No logit scale (Mesh TF).

    Raises:
        ShapeError: if the memory's batch dims or channels differ from the query's.
    """
    batch_dims = query_antecedent.shape.dims[:-2]
    query_length, io_channels = query_antecedent.shape.dims[-2:]
    kv_channels, heads = convert_to_dimension(kv_channels), convert_to_dimension(heads)
    mesh = query_antecedent.mesh
    scope = mesh.graph.unique_name(name or "multihead_attention")
    wq, wk, wv, wo = qkvo_variables(mesh, scope, heads, io_channels, kv_channels,
                                    VariableDType(master_dtype, slice_dtype, query_antecedent.dtype))
    if memory_antecedent is None:
        memory_antecedent = rename_length_to_memory_length(query_antecedent, query_length.name)
    memory_length, memory_channels = memory_antecedent.shape.dims[-2:]
    if memory_antecedent.shape.dims[:-2] != batch_dims:
        raise ShapeError(f"multihead_attention {scope!r}: memory batch {memory_antecedent.shape.dims[:-2]} must "
                         f"equal query batch {batch_dims}.")
    if memory_channels != io_channels:
        raise ShapeError(f"multihead_attention {scope!r}: memory channels {memory_channels} must equal query "
                         f"channels {io_channels}.")
    q = einsum([query_antecedent, wq], output_shape=Shape(batch_dims + [heads, query_length, kv_channels]))
    k = einsum([memory_antecedent, wk], output_shape=Shape(batch_dims + [heads, memory_length, kv_channels]))
    v = einsum([memory_antecedent, wv], output_shape=Shape(batch_dims + [heads, memory_length, kv_channels]))
    o = dot_product_attention(q, k, v, mask, is_training, dropout, dropout_broadcast_dims)
    return einsum([o, wo], output_shape=Shape(batch_dims + [query_length, io_channels]))


def qkvo_variables(mesh, scope, heads, io_channels, kv_channels, variable_dtype):
    """``[wq, wk, wv, wo]`` unstacked from one variable ``{scope}/qkvo`` ``[qkvo:4, heads, io, kv]`` with Mesh
    TF's per-matrix stddevs (what ``multihead_attention_vars`` creates under a variable scope)."""
    var = get_variable(mesh, f"{scope}/qkvo", Shape([Dimension("qkvo", 4), heads, io_channels, kv_channels]),
                       initializer=_StackedNormal(_stddevs(io_channels, kv_channels, heads)), dtype=variable_dtype)
    return unstack(var, "qkvo")


def _stddevs(io_channels, kv_channels, heads):
    qk = (io_channels.size ** -0.5) * (kv_channels.size ** -0.25)
    return [qk, qk, io_channels.size ** -0.5, (io_channels.size * heads.size) ** -0.5]


def multihead_self_attention_incremental(query_antecedent: Tensor, prev_k: Tensor, prev_v: Tensor, step_num,
                                         master_dtype, slice_dtype, name="multihead_attention"):
    """One decoding step of self-attention (Mesh TF ``multihead_self_attention_incremental``).

    Args:
        query_antecedent: ``[batch..., io_channels]`` (this position). prev_k, prev_v:
            ``[batch..., heads, memory_length, kv_channels]`` caches. step_num: int Tensor ``[]`` (or
            with batch dims): the position being decoded.

    Returns:
        ``(y [batch..., io_channels], new_k, new_v)``: ``k`` / ``v`` of this position added into the
        caches at ``step_num`` (which must hold zeros there, as in Mesh TF).
        Uses the variables of :func:`multihead_attention` named ``name`` (``{name}/qkvo``).
    """
    batch_dims = query_antecedent.shape.dims[:-1]
    io_channels = query_antecedent.shape.dims[-1]
    heads, memory_length, kv_channels = prev_k.shape.dims[-3:]
    mesh = query_antecedent.mesh
    scope = mesh.graph.unique_name(name or "multihead_attention")
    wq, wk, wv, wo = qkvo_variables(mesh, scope, heads, io_channels, kv_channels,
                                    VariableDType(master_dtype, slice_dtype, query_antecedent.dtype))
    q = einsum([query_antecedent, wq], output_shape=Shape(batch_dims + [heads, kv_channels]))
    k = einsum([query_antecedent, wk], output_shape=Shape(batch_dims + [heads, kv_channels]))
    v = einsum([query_antecedent, wv], output_shape=Shape(batch_dims + [heads, kv_channels]))
    k = prev_k + multiply(k, one_hot(step_num, memory_length, dtype=prev_k.dtype), output_shape=prev_k.shape)
    v = prev_v + multiply(v, one_hot(step_num, memory_length, dtype=prev_v.dtype), output_shape=prev_v.shape)
    mask = cast(greater(mtf_range(mesh, memory_length, dtype=step_num.dtype), step_num), q.dtype) * -1e9
    o = dot_product_attention(q, k, v, mask, is_training=False)
    return einsum([o, wo], output_shape=query_antecedent.shape), k, v


def multihead_encdec_attention_incremental(query_antecedent: Tensor, wq: Tensor, wo: Tensor, k: Tensor, v: Tensor,
                                           mask, name="multihead_attention") -> Tensor:
    """One decoding step of encoder-decoder attention with precomputed ``k``, ``v``
    ``[batch..., heads, memory_length, kv_channels]`` (Mesh TF ``multihead_encdec_attention_incremental``).

    Returns ``[batch..., io_channels]``.
    """
    heads, _, kv_channels = k.shape.dims[-3:]
    batch_dims = query_antecedent.shape.dims[:-1]
    q = einsum([query_antecedent, wq], output_shape=Shape(batch_dims + [heads, kv_channels]))
    o = dot_product_attention(q, k, v, mask, is_training=False)
    return einsum([o, wo], output_shape=query_antecedent.shape)


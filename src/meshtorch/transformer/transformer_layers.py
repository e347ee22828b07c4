"""Layers for the Transformer (Mesh TF ``transformer/transformer_layers.py``): DenseReluDense,
SelfAttention, EncDecAttention.

Variable names inside a layer's scope (``<model>/block_000/layer_000/<ClassName>/``):
SelfAttention / EncDecAttention: ``q``, ``k``, ``v`` ``[d_model, heads(h*d_kv)]`` and ``o``
``[heads(h*d_kv), d_model]`` (see :mod:`meshtorch.transformer.attention`); DenseReluDense:
``wi/kernel`` ``[d_model, d_ff]`` and ``wo/kernel`` ``[d_ff, d_model]``.

Not ported: the ``"contextual"`` relative attention and relative encoder-decoder biases, hyper-prompts, the
``"hybrid"`` attention function, and Mesh TF's other layer classes (local / talking-heads /
synthesizer / convolutional attention): their arguments raise NotImplementedError when set.
"""

from __future__ import annotations

import copy
import math

import torch

from meshtorch.layers.dense_extra import product_factors
from meshtorch.layers.feedforward import feed_forward
from meshtorch.transformer import _mtf as mtf
from meshtorch.transformer import attention
from meshtorch.transformer._context import TransformerLayer
from meshtorch.transformer._dense import dense

__all__ = ["DenseReluDense", "attention_params", "SelfAttention", "EncDecAttention", "enc_dec_attention",
           "enc_dec_attention_bias"]


class DenseReluDense(TransformerLayer):
    """Two dense layers with an activation between (Mesh TF ``transformer_layers.DenseReluDense``).

    A Mesh-TF-named wrapper of :func:`meshtorch.layers.feedforward.feed_forward` (the CLI LM's feed-forward)
    built from ``scoped_dense``: the variables are Mesh TF's (below).

    Args:
        hidden_size: size of ``d_ff``.
        dropout_rate: dropout on the hidden layer in training (noise shared along length).
        activation: name, function, or list of them (a list gives a gated product, e.g.
            ``["gelu", "linear"]`` for GEGLU; variables ``wi_0``, ``wi_1``).
        use_bias: biases in both dense layers.
    """

    def __init__(self, hidden_size=4096, dropout_rate=0.0, activation="relu", use_bias=False):
        self.hidden_size = hidden_size
        self.dropout_rate = dropout_rate
        self.activation = activation
        self.use_bias = use_bias

    def call(self, context, x, losses=None):
        """``[batch..., length, d_model]`` -> same shape."""
        factors = product_factors(self.activation, "wi")  # dense_product's names: wi, or wi_0, wi_1, ...
        return feed_forward(x, mtf.Dimension("d_ff", self.hidden_size), factors, "wo", dense_fn=dense,
                            use_bias=self.use_bias, dropout_rate=self.dropout_rate if context.train else 0.0,
                            dropout_broadcast_dims=[context.length_dim], reduced_dims=x.shape.dims[-1:],
                            variable_dtype=context.variable_dtype, expert_dims=context.model.ensemble_dims)


def attention_params(context, kv_dim, num_heads, num_memory_heads=0, shared_kv=False, no_query=False,
                     combine_dims=True, keep_query_heads_dims=False, fold_scaling_into_initializer=True):
    """AttentionParams for a transformer layer (Mesh TF ``transformer_layers.attention_params``).

    ``num_memory_heads``: 0 = as many as ``num_heads``; 1 = multi-query (one key/value head);
    k > 1 = ``heads`` k and ``query_heads`` ``num_heads // k``.

    Raises:
        ValueError: if ``num_memory_heads`` does not divide ``num_heads``.
    """
    if num_heads == 1:
        query_heads_dims = memory_heads_dims = None
    elif num_memory_heads == 0:
        query_heads_dims = [mtf.Dimension("heads", num_heads)]
        memory_heads_dims = query_heads_dims
    elif num_memory_heads == 1:
        query_heads_dims = [mtf.Dimension("heads", num_heads)]
        memory_heads_dims = None
    else:
        if num_heads % num_memory_heads != 0:
            raise ValueError("num_memory_heads must divide num_heads")
        memory_heads_dims = [mtf.Dimension("heads", num_memory_heads)]
        query_heads_dims = memory_heads_dims + [mtf.Dimension("query_heads", num_heads // num_memory_heads)]
    return attention.AttentionParams(
        context.mesh, query_input_dim=context.model.model_dim, memory_input_dim=context.model.model_dim,
        output_dim=context.model.model_dim, key_dim=kv_dim, value_dim=kv_dim, query_heads_dims=query_heads_dims,
        memory_heads_dims=memory_heads_dims, variable_dtype=context.variable_dtype, shared_kv=shared_kv,
        no_query=no_query, ensemble_dim=context.model.ensemble_dim, combine_dims=combine_dims,
        keep_query_heads_dims=keep_query_heads_dims, fold_scaling_into_initializer=fold_scaling_into_initializer)


def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """Bucket of ``memory_position - query_position`` for relative attention (Mesh TF / T5).

    Exact buckets for small distances, logarithmic ones up to ``max_distance``; with
    ``bidirectional`` half the buckets are for memory positions after the query.

    Returns:
        int32 Tensor of ``relative_position``'s shape, values in ``[0, num_buckets)``.
    """
    ret = 0
    n = mtf.negative(relative_position)
    if bidirectional:
        num_buckets //= 2
        ret += mtf.to_int32(mtf.less(n, 0)) * num_buckets
        n = mtf.abs(n)
    else:
        n = mtf.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = mtf.less(n, max_exact)
    safe_n = mtf.maximum(mtf.cast(n, torch.float32), 1.0)  # log(0) is never selected; keep the cast finite
    val_if_large = max_exact + mtf.to_int32(mtf.log(safe_n / max_exact) / math.log(max_distance / max_exact)
                                            * (num_buckets - max_exact))
    val_if_large = mtf.minimum(val_if_large, num_buckets - 1)
    return mtf.where(is_small, mtf.to_int32(n), val_if_large) + ret


class SelfAttention(TransformerLayer):
    """Multi-head self-attention (Mesh TF ``transformer_layers.SelfAttention``; same arguments).

    Visibility: position ``a`` sees ``b`` iff ``read_priority[a] >= write_priority[b]`` (causal in
    an autoregressive model) and, given a sequence-id Tensor, both have the same id. No logit scale
    (folded into ``q``'s initialiser). In ``"first_part"`` / ``"incremental"`` modes the keys and
    values are the decoding states (one-hot written at ``context.position``).

    ``relative_attention_type`` ``"bias"`` adds a learned ``relative_attention_bias`` ``[heads,
    buckets]`` per layer, gathered at the T5 bucket of ``memory_position - position``;
    ``"bias_shared"`` creates it once (in the first layer's scope) and shares it across the layers.

    Raises:
        NotImplementedError: for ``relative_attention_type="contextual"``, ``attention_func="hybrid"`` or
            hyper-prompt arguments (not ported).
    """

    _RELATIVE_TYPES = (None, "bias", "bias_shared")

    def __init__(self, num_heads=8, num_memory_heads=0, key_value_size=128, shared_kv=False, dropout_rate=0.0,
                 attention_kwargs=None, relative_attention_type=None, relative_attention_num_buckets=32,
                 attention_func=None, combine_dims=True, keep_query_heads_dims=False,
                 fold_scaling_into_initializer=True, z_loss_coeff=None, use_hyperprompt=False,
                 hyperprompt_mtlshare=False, hyperprompt_length_encoder=None, hyperprompt_length_decoder=None,
                 hyperprompt_hidden_dim=None, hyperprompt_task_num=8):
        if relative_attention_type not in self._RELATIVE_TYPES:
            raise NotImplementedError(f"{type(self).__name__}: relative_attention_type={relative_attention_type!r} "
                                      f"is not ported to meshtorch; use one of {self._RELATIVE_TYPES}.")
        if attention_func is not None:
            raise NotImplementedError(f"{type(self).__name__}: attention_func={attention_func!r} is not ported.")
        if use_hyperprompt or hyperprompt_length_encoder or hyperprompt_length_decoder:
            raise NotImplementedError(f"{type(self).__name__}: hyper-prompts are not ported.")
        self.num_heads = num_heads
        self.num_memory_heads = num_memory_heads
        self.key_value_size = key_value_size
        self.shared_kv = shared_kv
        self.dropout_rate = dropout_rate
        self.attention_kwargs = attention_kwargs or {}
        self.relative_attention_type = relative_attention_type
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.attention_func = attention_func
        self.combine_dims = combine_dims
        self.keep_query_heads_dims = keep_query_heads_dims
        self.fold_scaling_into_initializer = fold_scaling_into_initializer
        self.z_loss_coeff = z_loss_coeff

    def layer_output_from_attention_output(self, context, attention_output, losses):
        return attention_output

    def expected_attention_output_shape(self, x, params):
        if self.keep_query_heads_dims:
            return mtf.Shape(list(x.shape.dims[:-1]) + params.query_heads_dims + list(x.shape.dims[-1:]))
        return x.shape

    def attention_kwargs_from_context(self, context):
        kwargs = copy.copy(self.attention_kwargs)
        kwargs["dropout_rate"] = self.dropout_rate if context.train else 0.0
        if "dropout_broadcast_dims" not in kwargs:
            kwargs["dropout_broadcast_dims"] = [context.length_dim]
        return kwargs

    def make_params(self, context):
        return attention_params(context=context, kv_dim=self.kv_dim, num_heads=self.num_heads,
                                num_memory_heads=self.num_memory_heads, shared_kv=self.shared_kv,
                                combine_dims=self.combine_dims, keep_query_heads_dims=self.keep_query_heads_dims,
                                fold_scaling_into_initializer=self.fold_scaling_into_initializer)

    def call(self, context, x, losses=None):
        """``[batch..., length, d_model]`` -> same shape (``[batch..., d_model]`` in incremental mode)."""
        params = self.make_params(context)
        q = params.compute_q(x)
        memory_length = self.memory_length(context)
        if context.mode == "incremental":
            m = x
        else:
            m = mtf.replace_dimensions(x, context.length_dim, memory_length)
        if self.shared_kv:
            kv = params.compute_kv(m)
        else:
            k = params.compute_k(m)
            v = params.compute_v(m)
        if context.mode == "incremental":
            one_hot = mtf.one_hot(context.position, memory_length, dtype=context.activation_dtype)
            inv_one_hot = 1.0 - one_hot
            if self.shared_kv:
                old_kv, = context.get_states(1)
                kv = old_kv * inv_one_hot + kv * one_hot
            else:
                old_k, old_v = context.get_states(2)
                k = old_k * inv_one_hot + k * one_hot
                v = old_v * inv_one_hot + v * one_hot
            memory_position = mtf.range(context.mesh, memory_length, torch.int32)
        else:
            memory_position = self.rename_length_to_memory_length(context.position, context)
        if context.mode in ("incremental", "first_part"):
            context.record_new_states([kv] if self.shared_kv else [k, v])
        if self.shared_kv:
            k = v = kv
        o = attention.attention(q, k, v, memory_length, self.kv_dim, self.kv_dim,
                                self.compute_bias(context, memory_position, x, params.query_heads_dims, q),
                                context=context, z_loss_coeff=self.z_loss_coeff,
                                **self.attention_kwargs_from_context(context))
        attention_output_shape = self.expected_attention_output_shape(x, params)
        attention_output = params.compute_output(o, output_shape=attention_output_shape)
        return self.layer_output_from_attention_output(context, attention_output, losses)

    def compute_bias(self, context, memory_position, x, heads_dims, q):
        """The attention bias: read/write-priority (causal) mask and same-sequence mask, or None."""
        biases = []
        if context.read_priority is not None:
            visible = mtf.greater_equal(context.read_priority,
                                        mtf.layers.rename_length_to_memory_length(context.write_priority))
            biases.append(attention.visibility_mask_to_attention_bias(visible, context.activation_dtype))
        sequence_id = None
        if isinstance(context.subsequence_id, mtf.Tensor):
            sequence_id = context.subsequence_id
        elif isinstance(context.sequence_id, mtf.Tensor):
            sequence_id = context.sequence_id
        if sequence_id is not None and context.length_dim in sequence_id.shape.dims:
            visible = mtf.equal(sequence_id, self.rename_length_to_memory_length(sequence_id, context))
            biases.append(attention.visibility_mask_to_attention_bias(visible, context.activation_dtype))
        if self.relative_attention_type is not None:
            buckets_dim = mtf.Dimension("buckets", self.relative_attention_num_buckets)
            relative_position = memory_position - context.position
            bidirectional = not context.model.fully_autoregressive
            rp_bucket = _relative_position_bucket(relative_position, bidirectional=bidirectional,
                                                  num_buckets=buckets_dim.size)
            cache = self.relative_attention_type == "bias_shared"
            cache_key = ("self_attention_bias", None, None, tuple(heads_dims))
            values = context.cache.get(cache_key) if cache else None
            if values is None:
                values = mtf.get_variable(context.mesh, "relative_attention_bias",
                                          context.model.ensemble_dims + heads_dims + [buckets_dim],
                                          dtype=context.variable_dtype)
            if cache:
                context.cache[cache_key] = values
            biases.append(mtf.gather(values, rp_bucket, buckets_dim))
        return mtf.add_n(biases) if biases else None

    @property
    def kv_dim(self):
        return mtf.Dimension("d_kv", self.key_value_size)

    def memory_length(self, context):
        return mtf.Dimension("memory_length", context.length_dim.size)

    def rename_length_to_memory_length(self, x, context):
        return mtf.replace_dimensions(x, context.length_dim, self.memory_length(context))

    def min_relative_position(self, context):
        return None

    def max_relative_position(self, context):
        return None

    @property
    def attention_fn(self):
        return attention.attention


def enc_dec_attention_bias(layer, context, heads_dims):
    """Bias of encoder-decoder attention: hide encoder positions of another sequence id (Mesh TF).

    With both sequence ids given (Bitransformer passes ``min(ids, 1)``), decoder position ``a``
    sees encoder position ``b`` iff ``sequence_id[a] == encoder_sequence_id[b]``.
    """
    del layer, heads_dims
    biases = []
    if context.encoder_sequence_id is not None and context.sequence_id is not None:
        if isinstance(context.sequence_id, mtf.Tensor):
            visible = mtf.equal(context.sequence_id, context.encoder_sequence_id)
        else:  # decoding passes sequence_id=1: hide the encoder's padding
            visible = mtf.equal(context.encoder_sequence_id, context.sequence_id)
        biases.append(attention.visibility_mask_to_attention_bias(visible, context.activation_dtype))
    return mtf.add_n(biases) if biases else None


def enc_dec_attention(self_attention_layer, memory_antecedent, context, x, losses, attention_fn=attention.attention,
                      z_loss_coeff=None):
    """Multi-head attention over the encoder output ``[batch..., memory_length, d_model]`` (Mesh TF).

    Raises:
        NotImplementedError: if the encoder output's channels differ from the decoder's d_model.
    """
    memory_input_dim = memory_antecedent.shape[-1]
    if memory_input_dim != context.model.model_dim:
        raise NotImplementedError("enc_dec_attention: the encoder and decoder must have the same d_model.")
    params = self_attention_layer.make_params(context)
    q = params.compute_q(x)
    if context.mode == "incremental":
        k, v, memory_length = context.get_constant_state()
    else:
        m = memory_antecedent
        if self_attention_layer.shared_kv:
            k = v = params.compute_kv(m)
        else:
            k = params.compute_k(m)
            v = params.compute_v(m)
        memory_length, = [d for d in m.shape.dims if d.name == "memory_length"]
        if context.mode == "first_part":
            context.record_constant_state((k, v, memory_length))
    bias = enc_dec_attention_bias(self_attention_layer, context, params.query_heads_dims)
    a = attention_fn(q, k, v, memory_length, self_attention_layer.kv_dim, self_attention_layer.kv_dim, bias,
                     context=context, z_loss_coeff=z_loss_coeff,
                     **self_attention_layer.attention_kwargs_from_context(context))
    attention_output_shape = self_attention_layer.expected_attention_output_shape(x, params)
    attention_output = params.compute_output(a, output_shape=attention_output_shape)
    return self_attention_layer.layer_output_from_attention_output(context, attention_output, losses)


class EncDecAttention(SelfAttention):
    """Multi-head attention over the encoder output (Mesh TF ``transformer_layers.EncDecAttention``)."""

    def __init__(self, relative_attention_type=None, **kwargs):
        super().__init__(relative_attention_type=relative_attention_type, **kwargs)

    def _get_memory_antecedent(self, context):
        return context.encoder_output

    def call(self, context, x, losses=None):
        return enc_dec_attention(self, self._get_memory_antecedent(context), context, x, losses,
                                 attention_fn=self.attention_fn, z_loss_coeff=self.z_loss_coeff)

"""Attention for the transformer package (Mesh TF ``transformer/attention.py``).

Mesh TF applies **no** ``1/sqrt(d_kv)`` scale in :func:`attention`: the scale is folded into the
initialiser of the ``q`` projection (``stddev = d_model**-0.5 * d_kv**-0.5``) when
``fold_scaling_into_initializer=True`` (the default), else applied to ``q`` in ``compute_q``.

With ``combine_dims=True`` (the default) the projection variables hold one combined dimension named
``heads`` of size ``heads x d_kv``: ``q``, ``k``, ``v`` are ``[d_model, heads(h*d_kv)]`` and ``o`` is
``[heads(h*d_kv), d_model]``; activations are reshaped to ``[heads(h), d_kv]`` after the projection
(a free reshape when ``heads`` is split: both split the same leading index).

The attention arithmetic is meshtorch's one implementation, :func:`meshtorch.layers.attention.attention`
(shared with the CLI's LM, the Hugging Face models and ``mtf.layers``); this module keeps Mesh TF's
signatures, the ``AttentionParams`` variable names, shapes and initialisers, and the z-loss bookkeeping.
Why this direction (the port wraps the native layer, not the reverse): ``layers`` sits below both
``models`` and ``transformer`` in the package layers, the CLI's checkpoints name the native variables,
and Mesh TF's names live in variable scopes that only the port opens.
"""

from __future__ import annotations

from meshtorch.layers import attention as layers_attention  # the module (its attention() is not re-exported)
from meshtorch.transformer import _mtf as mtf

__all__ = ["attention", "AttentionParams", "attention_params_simple", "visibility_mask_to_attention_bias"]


def attention(q, k, v, memory_length_dim, key_dim, value_dim, bias=None, dropout_rate=0.0,
              dropout_broadcast_dims=None, extra_logit=None, context=None, float32_logits=True, z_loss_coeff=None):
    """Dot-product attention with no scale (Mesh TF ``transformer.attention.attention``).

    Args:
        q: ``other_query_dims + [key_dim]`` (typically ``[batch, length, heads, d_kv]``).
        k: ``other_memory_dims + [memory_length_dim, key_dim]``; v: ``... + [memory_length_dim, value_dim]``.
        memory_length_dim / key_dim / value_dim: Dimensions.
        bias: optional Tensor added to the logits (e.g. ``-1e9`` masks).
        dropout_rate: dropout on the attention weights (only when ``context.train``).
        dropout_broadcast_dims: dims along which the dropout noise is shared.
        extra_logit: an extra logit in the softmax's normaliser (as :func:`meshtorch.softmax`).
        context: a transformer Context (for ``train`` and the z-loss list).
        float32_logits: compute the logits in float32.
        z_loss_coeff: if set, in training append ``coeff * mean(logsumexp(logits)^2 * nonpadding)``
            to ``context.losses``.

    Returns:
        Tensor ``q.shape - key_dim + value_dim``.

    A Mesh-TF-signature wrapper of :func:`meshtorch.layers.attention.attention` (scale 1; the fused op where
    no dropout, z-loss or extra logit asks for the einsum/softmax composite).
    """
    train = context is not None and context.train
    z_loss = z_loss_coeff is not None and train
    out = layers_attention.attention(q, k, v, memory_length_dim, key_dim, value_dim, bias=bias, scale=1.0,
                                     dropout_rate=dropout_rate if train else 0.0,
                                     dropout_broadcast_dims=dropout_broadcast_dims, extra_logit=extra_logit,
                                     float32_logits=float32_logits, return_log_z=z_loss,
                                     output_shape=q.shape - key_dim + value_dim)
    if not z_loss:
        return out
    out, log_z = out
    nonpadding = context.nonpadding
    loss = mtf.square(log_z)
    if isinstance(nonpadding, mtf.Tensor):
        loss = loss * mtf.cast(nonpadding, log_z.dtype)
    loss = mtf.reduce_mean(loss)
    if context.num_microbatches and context.num_microbatches > 1:
        loss /= context.num_microbatches
    loss *= z_loss_coeff
    context.losses.append(mtf.cast(loss, v.dtype))
    return out


def _combined_dim(dims):
    return mtf.Dimension(dims[0].name, mtf.Shape(dims).size)


class AttentionParams:
    """The projections of multi-head attention (Mesh TF ``transformer.attention.AttentionParams``; same arguments).

    Variables (in the current variable scope): ``q`` ``[query_input_dim, heads(h*d_kv)]`` (omitted
    with ``no_query``), ``k`` and ``v`` ``[memory_input_dim, heads(h*d_kv)]`` (or one ``kv`` with
    ``shared_kv``), ``o`` ``[heads(h*d_kv), output_dim]``; with ``combine_dims=False`` the heads and
    key/value dims stay separate; ``ensemble_dim`` is prepended. Initialisers (normal): ``q`` std
    ``d_model**-0.5 * d_kv**-0.5`` (the attention scale, folded), ``k``/``v`` ``d_model**-0.5``,
    ``o`` ``(h*d_kv)**-0.5``.

    Raises:
        ValueError: ``shared_kv`` with different key and value dims.
    """

    def __init__(self, mesh, query_input_dim, memory_input_dim, output_dim, key_dim, value_dim, query_heads_dims,
                 memory_heads_dims, variable_dtype, shared_kv=False, no_query=False, combine_dims=True,
                 ensemble_dim=None, keep_query_heads_dims=False, fold_scaling_into_initializer=True,
                 make_attention_vars=True):
        if shared_kv and key_dim != value_dim:
            raise ValueError("shared_kv requires key_dim == value_dim")
        self.mesh = mesh
        self.query_input_dim = query_input_dim
        self.memory_input_dim = memory_input_dim
        self.output_dim = output_dim
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.query_heads_dims = query_heads_dims or []
        self.memory_heads_dims = memory_heads_dims or []
        self.variable_dtype = variable_dtype
        self.shared_kv = shared_kv
        self.no_query = no_query
        self.combine_dims = combine_dims
        self.keep_query_heads_dims = keep_query_heads_dims
        self.fold_scaling_into_initializer = fold_scaling_into_initializer
        self.make_attention_vars = make_attention_vars
        if combine_dims:
            self.q_shape = [query_input_dim, _combined_dim(self.q_dims)]
            self.k_shape = [memory_input_dim, _combined_dim(self.k_dims)]
            self.v_shape = [memory_input_dim, _combined_dim(self.v_dims)]
            self.o_shape = [_combined_dim(self.o_dims), output_dim]
        else:
            self.q_shape = [query_input_dim] + self.q_dims
            self.k_shape = [memory_input_dim] + self.k_dims
            self.v_shape = [memory_input_dim] + self.v_dims
            self.o_shape = self.o_dims + [output_dim]
        if ensemble_dim:
            self.q_shape = [ensemble_dim] + self.q_shape
            self.k_shape = [ensemble_dim] + self.k_shape
            self.v_shape = [ensemble_dim] + self.v_shape
            self.o_shape = [ensemble_dim] + self.o_shape
        self.init_weights()

    def init_weights(self):
        """Create the projection variables (see the class docstring)."""
        stddev = self.query_input_dim.size ** -0.5
        if self.fold_scaling_into_initializer:
            stddev *= self.key_dim.size ** -0.5
        q_init = mtf.random_normal_initializer(stddev=stddev)
        kv_init = mtf.random_normal_initializer(stddev=self.memory_input_dim.size ** -0.5)
        o_init = mtf.random_normal_initializer(stddev=mtf.Shape(self.query_heads_dims + [self.value_dim]).size ** -0.5)
        vd = self.variable_dtype
        if self.make_attention_vars:
            if not self.no_query:
                self.wq = mtf.get_variable(self.mesh, "q", self.q_shape, initializer=q_init, dtype=vd)
            if self.shared_kv:
                self.wkv = mtf.get_variable(self.mesh, "kv", self.k_shape, initializer=kv_init, dtype=vd)
            else:
                self.wk = mtf.get_variable(self.mesh, "k", self.k_shape, initializer=kv_init, dtype=vd)
                self.wv = mtf.get_variable(self.mesh, "v", self.v_shape, initializer=kv_init, dtype=vd)
        self.wo = mtf.get_variable(self.mesh, "o", self.o_shape, initializer=o_init, dtype=vd)

    def _project(self, antecedent, w, input_dim, dims):
        ret = mtf.einsum([antecedent, w], reduced_dims=[input_dim])
        if self.combine_dims:
            ret = mtf.replace_dimensions(ret, ret.shape.dims[-1], dims)
        return ret

    def compute_q(self, query_antecedent):
        """``query_heads_dims + [key_dim] + other dims`` from ``[query_input_dim] + other dims``."""
        ret = self._project(query_antecedent, self.wq, self.query_input_dim, self.q_dims)
        if not self.fold_scaling_into_initializer:
            ret *= self.key_dim.size ** -0.5
        return ret

    def compute_kv(self, memory_antecedent):
        if not self.shared_kv:
            raise ValueError("compute_kv can only be called with shared_kv")
        return self._project(memory_antecedent, self.wkv, self.memory_input_dim, self.k_dims)

    def compute_k(self, memory_antecedent):
        if self.shared_kv:
            raise ValueError("compute_k cannot be called with shared_kv")
        return self._project(memory_antecedent, self.wk, self.memory_input_dim, self.k_dims)

    def compute_v(self, memory_antecedent):
        if self.shared_kv:
            raise ValueError("compute_v cannot be called with shared_kv")
        return self._project(memory_antecedent, self.wv, self.memory_input_dim, self.v_dims)

    def compute_output(self, o, output_shape=None):
        """``[output_dim] + other dims`` from ``query_heads_dims + [value_dim] + other dims``."""
        if self.combine_dims:
            o = mtf.transpose(o, o.shape - self.o_dims + self.o_dims)
            o = mtf.replace_dimensions(o, self.o_dims, self.wo.shape.dims[-2])
            reduced_dims = [self.wo.shape.dims[-2]]
        else:
            reduced_dims = self.o_dims
        if self.keep_query_heads_dims:
            reduced_dims = [self.value_dim]
        if output_shape is not None:  # Mesh TF's einsum ignores reduced_dims given an output shape
            return mtf.einsum([o, self.wo], output_shape=output_shape)
        return mtf.einsum([o, self.wo], reduced_dims=reduced_dims)

    @property
    def q_dims(self):
        return self.query_heads_dims + [self.key_dim]

    @property
    def k_dims(self):
        return self.memory_heads_dims + [self.key_dim]

    @property
    def v_dims(self):
        return self.memory_heads_dims + [self.value_dim]

    @property
    def o_dims(self):
        return self.query_heads_dims + [self.value_dim]


def attention_params_simple(mesh, io_dim, kv_dim, heads_dim, variable_dtype):
    """AttentionParams with one ``heads`` dim for queries and memory (Mesh TF ``attention_params_simple``)."""
    return AttentionParams(mesh, query_input_dim=io_dim, memory_input_dim=io_dim, output_dim=io_dim, key_dim=kv_dim,
                           value_dim=kv_dim, query_heads_dims=[heads_dim], memory_heads_dims=[heads_dim],
                           variable_dtype=variable_dtype)


def visibility_mask_to_attention_bias(visible, dtype):
    """``-1e9`` where ``visible`` is False, else 0, in ``dtype`` (Mesh TF)."""
    return mtf.cast(mtf.logical_not(visible), dtype) * -1e9

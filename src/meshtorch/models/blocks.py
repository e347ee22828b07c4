"""The one pre-norm Transformer block of every model here, parametrised by a :class:`BlockSpec`.

:func:`block` is every decoder block of :func:`meshtorch.models.transformer.build_lm` (the native LM, its pipeline,
its KV-cache decoder and its pipeline stage programs) and of :func:`meshtorch.models.hf.build_hf_lm` (GPT-2, Llama,
Qwen2, Mistral), and every encoder and decoder block of :func:`meshtorch.models.hf_t5.build_t5` (T5) and
:func:`meshtorch.models.encdec.build_encdec`: ``x + dropout(attention(norm(x)))``, in a decoder block with an
encoder then ``+ dropout(cross-attention(norm(.)))``, then ``+ dropout(mlp(norm(.)))`` (Xiong et al. 2020's
pre-LN residual stack; Mesh TF ``transformer``'s pre-norm layers). What differs between the models is a
:class:`BlockSpec` and nothing else:

* norm: ``layer`` (LayerNorm with bias) or ``rms`` (RMSNorm, Zhang & Sennrich 2019), and its epsilon;
* positions: rotary q/k (RoPE, Su et al. 2021) with ``rope_theta``, T5's relative position bias
  (:class:`RelativeBias`), or none in the block (learned absolute positions are added to the embeddings by the
  model);
* attention: multi-head, or grouped-query (Ainslie et al. 2023: keys and values on ``kv_heads``), q/k/v and output
  projections with or without biases, scale ``1/sqrt(d_kv)`` or ``attn_scale``, causal through a
  :mod:`meshtorch.layers.kv_cache` ``FullSequence`` / ``Prefill`` / ``Step`` (training or KV-cache decoding; a
  ``Step`` of a multi-head block projects q, k and v by one matmul on a stacked copy of their kernels), or
  with masks as biases through an :class:`Attend` (T5, :mod:`meshtorch.models.encdec`: bidirectional encoders,
  and the encoder-decoder attention of a decoder block, its ``cross`` sublayer); Mesh TF's combined-heads kernels
  (``combined_heads``, T5's checkpoints);
* MLP: :func:`meshtorch.layers.feed_forward` with an activation of
  :func:`meshtorch.layers.feedforward.activation_function` (``relu``, ``gelu``, ``gelu_tanh``, ``silu``), plain or
  gated (ReLU / GELU MLP; SwiGLU, GEGLU: Shazeer 2020), with or without biases; or a Mixture-of-Experts layer
  (:func:`meshtorch.layers.moe_ffn`) where the caller asks for one;
* variable names (:class:`BlockNames`) and initialisers (variance scaling fan-in, Mesh TF's, or a given one such as
  ``transformers``' N(0, 0.02));
* dropout after each sublayer (training only).

The head (tied or untied) and the embeddings are the models'; the block is the same arithmetic for every spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshtorch import layers
from meshtorch.core.dims import Dimension, Shape
from meshtorch.core.graph import Tensor
from meshtorch.layers.attention import attention
from meshtorch.layers.feedforward import activation_function
from meshtorch.layers.kv_cache import FullSequence
from meshtorch.ops.activations import logical_not
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast
from meshtorch.ops.indexing import gather
from meshtorch.ops.initializers import Initializer, VarianceScalingInitializer, zeros_initializer
from meshtorch.ops.random import dropout as dropout_op
from meshtorch.ops.reshape import rename_dimension, replace_dimensions, transpose
from meshtorch.ops.shape import add_n, stack, unstack
from meshtorch.ops.variables import get_variable, import_tensor

__all__ = ["BlockNames", "MoEOptions", "RelativeBias", "BlockSpec", "Attend", "block", "norm", "mask_bias",
           "relative_position_buckets", "FULL_SEQUENCE", "NATIVE_NAMES", "HF_NAMES"]


@dataclass(frozen=True)
class BlockNames:
    """The variable names of a block's parts, under the block's prefix (``layer_0/``, ``layers0/``).

    Attributes:
        attn_norm / mlp_norm: the two norms' scopes (variables ``{scope}/scale``, ``/bias`` for LayerNorm).
        attn: the attention's scope: q/k/v/o kernels ``{attn}/{q,k,v,o}{attn_kernel}`` (``[d_model, heads, d_kv]``,
            ``[heads, d_kv, d_model]``) and biases ``{attn}/{q,k,v,o}/bias``.
        attn_kernel: the kernels' suffix: ``""`` (the native LM's ``attention/q``) or ``"/kernel"``.
        mlp: the MLP's scope: ``{mlp}/wi``, ``{mlp}/wi_gate`` (gated), ``{mlp}/wo`` (``/kernel``, ``/bias``).
        gate_first: a gated MLP makes ``wi_gate`` before ``wi`` (the variables' order in the graph: optimizer
            state, global-norm sums and checkpoints keep it).
        moe: a Mixture-of-Experts layer's scope (:func:`meshtorch.layers.moe_ffn`'s variables under it).
        mlp_in / mlp_gate: the MLP's input projections' names under ``mlp`` (T5: ``wi``; gated ``wi_1`` and the
            activated ``wi_0``).
        cross_norm / cross: the encoder-decoder attention's norm and attention scopes (a block given ``cross``).
    """

    attn_norm: str
    attn: str
    attn_kernel: str
    mlp_norm: str
    mlp: str
    gate_first: bool
    moe: str = "moe"
    mlp_in: str = "wi"
    mlp_gate: str = "wi_gate"
    cross_norm: str = "cross_attn_norm"
    cross: str = "cross_attn"


#: The native LM's names (:func:`meshtorch.models.transformer.build_lm`).
NATIVE_NAMES = BlockNames("attention_norm", "attention", "", "ffn_norm", "ffn", gate_first=False)
#: The Hugging Face families' names (:func:`meshtorch.models.hf.build_hf_lm`).
HF_NAMES = BlockNames("attn_norm", "attn", "/kernel", "mlp_norm", "mlp", gate_first=True)


@dataclass(frozen=True)
class MoEOptions:
    """A Mixture-of-Experts feed-forward's settings (:func:`meshtorch.layers.moe_ffn`'s arguments of the same
    meaning: GShard top-k gating, expert capacity ``capacity_factor`` x tokens / experts, at least
    ``min_expert_capacity``)."""

    capacity_factor: float = 1.25
    top_k: int = 2
    min_expert_capacity: int = 4


@dataclass(frozen=True)
class RelativeBias:
    """T5's relative position bias (Raffel et al. 2020, section 2.1; Mesh TF ``relative_attention_type=
    "bias_shared"``): a learned scalar per head and bucket added to the self-attention logits, the bucket of each
    (query, key) pair from :func:`relative_position_buckets` (bidirectional in an encoder, causal in a decoder: the
    :class:`Attend`'s ``bidirectional``).

    Attributes:
        table: the full name of the variable ``[heads, buckets]``: made by the first block that uses it and shared
            by the other blocks of its stack.
        num_buckets / max_distance: the bucketing's (T5: 32 and 128).
    """

    table: str
    num_buckets: int = 32
    max_distance: int = 128


@dataclass(frozen=True)
class BlockSpec:
    """Everything that makes one model's pre-norm block differ from another's (see the module docstring).

    Attributes:
        names: the variable names (:data:`NATIVE_NAMES`, :data:`HF_NAMES` or another :class:`BlockNames`).
        norm: ``rms`` or ``layer``; norm_eps: its epsilon.
        rope_theta: rotary positions on q and k with this base (None: no positions in the block).
        grouped_query: keys and values on the ``kv_heads`` dim (grouped-query attention); else on ``heads``.
        qkv_bias / o_bias / mlp_bias: biases of the q/k/v, output and MLP projections.
        activation: the MLP's activation name; gated: GLU MLP ``act(W_g x) * W_i x``.
        init: the projections' kernel initialiser (None: variance scaling, scale 1, fan-in, normal, over the
            projection's input dims: Mesh TF's default).
        dropout: rate of the dropout on each sublayer's output when the block is built for training.
        moe: the Mixture-of-Experts settings of the layers built with ``moe=True`` (None: no MoE layers).
        attn_scale: the attention logits' scale (None: ``1/sqrt(d_kv)``; T5: 1.0, the scale folded into its
            query initialisation).
        combined_heads: Mesh TF's projection kernels ``[d_model, heads(heads*d_kv)]`` and
            ``[heads(heads*d_kv), d_model]`` (one combined dim, reshaped to ``[heads, d_kv]`` after the
            projection; all four made before the first projection, as Mesh TF's ``AttentionParams``) instead of
            ``[d_model, heads, d_kv]`` / ``[heads, d_kv, d_model]``.
        relative: T5's relative position bias on the self-attention logits (:class:`RelativeBias`; needs an
            :class:`Attend` ``attend``), or None.
    """

    names: BlockNames
    norm: str = "rms"
    norm_eps: float = 1e-6
    rope_theta: float | None = None
    grouped_query: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "relu"
    gated: bool = False
    init: Initializer | None = None
    dropout: float = 0.0
    moe: MoEOptions | None = None
    attn_scale: float | None = None
    combined_heads: bool = False
    relative: RelativeBias | None = None

    def __post_init__(self):
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"BlockSpec: norm must be 'rms' or 'layer', got {self.norm!r}.")
        activation_function(self.activation)  # a clear error for an unknown activation name


#: Training: causal attention and rotary over the whole ``length`` window.
FULL_SEQUENCE = FullSequence()


def relative_position_buckets(query_length: int, memory_length: int, bidirectional: bool, num_buckets: int = 32,
                              max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of every (query, memory) pair: int64 ``[query_length, memory_length]``.

    With ``n = query - memory``: bidirectional, half the buckets are for ``n < 0`` (memory after the
    query) and ``|n|`` is bucketed in the other half; unidirectional, ``n`` is clamped at 0. Of the
    ``b`` buckets for ``|n|``, distances below ``b/2`` get their own bucket; larger ones share
    logarithmically spaced buckets up to ``max_distance`` (Mesh TF
    ``_relative_position_bucket``, T5 section 2.1).

    Raises:
        ValueError: if ``num_buckets`` is too small (< 2, or < 4 when bidirectional).
    """
    if num_buckets < (4 if bidirectional else 2):
        raise ValueError(f"relative_position_buckets: num_buckets={num_buckets} is too small.")
    n = torch.arange(query_length)[:, None] - torch.arange(memory_length)[None, :]
    ret = torch.zeros_like(n)
    nb = num_buckets
    if bidirectional:
        nb //= 2
        ret = ret + (n < 0).long() * nb
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = nb // 2
    large = max_exact + (torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
                         * (nb - max_exact)).long()
    large = large.clamp(max=nb - 1)
    return ret + torch.where(n < max_exact, n, large)


def mask_bias(visible: Tensor) -> Tensor:
    """``-1e9`` where the bool ``visible`` is False, else 0 (float32): a mask as an attention bias (Mesh TF's
    ``visibility_mask_to_attention_bias``)."""
    return cast(logical_not(visible), torch.float32) * -1e9


class Attend:
    """Attention over a whole window, or over a memory, with no causal mask but additive biases: Mesh TF
    ``transformer``'s attention (causal and padding masks as :func:`mask_bias` biases, summed in order with the
    :class:`RelativeBias`), the attention of T5's blocks; the ``attend`` of :func:`block` beside
    :mod:`meshtorch.layers.kv_cache`'s ``FullSequence``.

    Args:
        masks: bias Tensors, each broadcastable to ``[batch.., length, memory_length]``.
        memory: the keys' and values' source ``[batch.., memory_length, d_model]`` (encoder-decoder attention), or
            None: self-attention (keys and values of the block's input, ``length`` renamed ``memory_length``; not
            renamed when ``memory_length`` is ``length``).
        bidirectional: the relative bias's buckets (T5: True in the encoder, False in the decoder).
        causal: also mask the keys after the query (the fused op's causal mask; for masks given as biases, as
            Mesh TF's, leave it False).
    """

    derives = False  # no per-step weight copies (those are meshtorch.layers.kv_cache.Step's)

    def __init__(self, masks: list, memory: Tensor | None = None, bidirectional: bool = True, causal: bool = False,
                 length: str = "length", memory_length: str = "memory_length", key: str = "d_kv"):
        self.masks, self.memory, self.bidirectional, self.causal = list(masks), memory, bidirectional, causal
        self.length, self.memory_length, self.key = length, memory_length, key
        self._buckets: dict = {}

    def source(self, h: Tensor) -> Tensor:
        """The keys' and values' input: ``memory``, or ``h`` (``length`` renamed ``memory_length``)."""
        if self.memory is not None or self.memory_length == self.length:
            return self.memory if self.memory is not None else h
        return rename_dimension(h, self.length, self.memory_length)

    @property
    def cross(self) -> bool:
        """Encoder-decoder attention (keys and values of a memory; no relative bias)."""
        return self.memory is not None

    def keys_values(self, h: Tensor, project, name: str) -> tuple[Tensor, Tensor]:
        """The keys and values of the attention ``name`` whose queries come from ``h``: ``project(source(h), "k")``
        and ``"v"`` (a KV-cache pass writes them to, or reads them from, its caches instead)."""
        src = self.source(h)
        return project(src, "k"), project(src, "v")

    def relative(self, q: Tensor, k: Tensor, heads: Dimension, r: RelativeBias) -> Tensor:
        """``r``'s bias ``[heads, length, memory_length]``: its table gathered at the buckets of the pairs
        (:meth:`bucket_ids`)."""
        buckets = Dimension("buckets", r.num_buckets)
        table = get_variable(q.mesh, r.table, Shape([heads, buckets]), dtype=q.dtype)
        return gather(table, self.bucket_ids(q, k, r), buckets)

    def bucket_ids(self, q: Tensor, k: Tensor, r: RelativeBias) -> Tensor:
        """int64 ``[length, memory_length]``: the relative-position bucket of each query-key pair
        (:func:`relative_position_buckets`; one table per stack, shared by its blocks).

        Raises:
            ValueError: if ``memory_length`` is ``length`` (the pairs need two dims)."""
        if self.memory_length == self.length:
            raise ValueError(f"Attend: a relative bias needs keys on a dim other than {self.length!r}.")
        lq, lm = q.shape.get_dim_by_name(self.length), k.shape.get_dim_by_name(self.memory_length)
        key = (lq, lm, r.num_buckets, r.max_distance)
        if key not in self._buckets:
            ids = relative_position_buckets(lq.size, lm.size, self.bidirectional, r.num_buckets, r.max_distance)
            self._buckets[key] = import_tensor(q.mesh, ids, [lq, lm], name=f"{r.table}_buckets")
        return self._buckets[key]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float, name: str, bias: Tensor | None = None) -> Tensor:
        """``softmax(q k^T * scale + masks + bias) v`` (:func:`meshtorch.layers.attention.attention`, float32
        logits), ``q``'s shape."""
        biases = self.masks + ([bias] if bias is not None else [])
        return attention(q, k, v, self.memory_length, self.key, self.key, length_dim=self.length,
                         bias=add_n(biases) if biases else None, scale=scale, causal=self.causal,
                         float32_logits=True, output_shape=q.shape, name=name)


def norm(x: Tensor, dim, spec: BlockSpec, name: str) -> Tensor:
    """``spec.norm`` (:func:`meshtorch.layers.rms_norm` or :func:`~meshtorch.layers.layer_norm`) of ``x`` over
    ``dim`` (``d_model``) with ``spec.norm_eps``; variables ``{name}/scale`` (``/bias``) ``[dim]``."""
    if spec.norm == "layer":
        return layers.layer_norm(x, dim, epsilon=spec.norm_eps, name=name)
    return layers.rms_norm(x, dim, epsilon=spec.norm_eps, name=name)


def block(x: Tensor, d: dict, spec: BlockSpec, prefix: str, attend=FULL_SEQUENCE, train: bool = False,
          moe: bool = False, aux_losses: list | None = None, cross: Attend | None = None) -> Tensor:
    """One pre-norm block: ``x + dropout(attention(norm(x)))``, with ``cross`` then
    ``+ dropout(cross-attention(norm(.)))``, then ``+ dropout(mlp or moe(norm(.)))``.

    Args:
        x: ``[..., length, d_model]`` (leading dims such as a pipeline's ``stage`` are batch to every op), or
            ``[batch, d_model]`` in a decoding step.
        d: the model's Dimensions by name: ``d_model``, ``heads``, ``d_kv``, ``d_ff``, and ``kv_heads`` (grouped-query)
            / ``experts`` (MoE) where used.
        spec: the :class:`BlockSpec`.
        prefix: the variables' prefix (``layer_0/``, ``layers0/``).
        attend: the self-attention (:mod:`meshtorch.layers.kv_cache`'s causal ``FullSequence``, ``Prefill`` or
            ``Step``; or an :class:`Attend`: masks as biases, T5's relative bias).
        train: build the dropout (``spec.dropout > 0``).
        moe: this layer's feed-forward is a Mixture-of-Experts layer (``spec.moe``); its load-balancing loss
            is appended to ``aux_losses``.
        cross: the encoder-decoder attention over ``cross.memory`` (an :class:`Attend`; scopes
            ``names.cross_norm`` / ``names.cross``), between the self-attention and the MLP (a T5 decoder block).

    Returns:
        A Tensor of ``x``'s shape and dtype.

    Raises:
        ValueError: ``moe=True`` with ``spec.moe`` None or without ``aux_losses``.
    """
    n, dm = spec.names, d["d_model"]
    x = x + _dropout(_attention(norm(x, dm, spec, f"{prefix}{n.attn_norm}"), d, spec, f"{prefix}{n.attn}", attend),
                     spec, train)
    if cross is not None:
        h = norm(x, dm, spec, f"{prefix}{n.cross_norm}")
        x = x + _dropout(_attention(h, d, spec, f"{prefix}{n.cross}", cross), spec, train)
    h = norm(x, dm, spec, f"{prefix}{n.mlp_norm}")
    if moe:
        if spec.moe is None or aux_losses is None:
            raise ValueError(f"block {prefix!r}: moe=True needs BlockSpec.moe and an aux_losses list.")
        h, aux = layers.moe_ffn(h, d["experts"], d["d_ff"], capacity_factor=spec.moe.capacity_factor,
                                top_k=spec.moe.top_k, min_expert_capacity=spec.moe.min_expert_capacity,
                                activation=spec.activation, name=f"{prefix}{n.moe}")
        aux_losses.append(aux)
    else:
        h = _mlp(h, d, spec, f"{prefix}{n.mlp}")
    return x + _dropout(h, spec, train)


def _dropout(x: Tensor, spec: BlockSpec, train: bool) -> Tensor:
    if not train or spec.dropout <= 0:
        return x
    return dropout_op(x, rate=spec.dropout)


def _kernel(x: Tensor, new_dims: list, spec: BlockSpec, name: str, reduced: list) -> Tensor:
    """The projection kernel variable ``{name}{spec.names.attn_kernel}`` ``[reduced + new_dims]``, in ``x``'s dtype."""
    init = spec.init if spec.init is not None else VarianceScalingInitializer(reduced_dims=reduced, new_dims=new_dims)
    w = get_variable(x.mesh, f"{name}{spec.names.attn_kernel}", Shape(reduced + new_dims), initializer=init,
                     dtype=x.dtype)
    return w if w.dtype == x.dtype else cast(w, x.dtype)


def _projection(x: Tensor, new_dims: list, spec: BlockSpec, name: str, use_bias: bool,
                reduced_dims: list | None = None) -> Tensor:
    """:func:`meshtorch.layers.dense` whose kernel is the variable ``{name}{spec.names.attn_kernel}``
    ``[reduced_dims + new_dims]`` (bias ``{name}/bias`` ``[new_dims]``)."""
    reduced = reduced_dims if reduced_dims is not None else [x.shape[-1]]
    w = _kernel(x, new_dims, spec, name, reduced)
    # the ops' scope: the kernel's own name when the kernel is ``{name}/kernel``, else ``{name}_proj``
    return layers.dense(x, new_dims, reduced_dims, use_bias=use_bias, kernel_weights=w,
                        name=name if spec.names.attn_kernel else f"{name}_proj")


def _attention(h: Tensor, d: dict, spec: BlockSpec, scope: str, attend) -> Tensor:
    """Attention of ``h`` ``[..., d_model]``: q/k/v projections, rotary q/k (``spec.rope_theta``),
    multi-head or grouped-query attention through ``attend``, output projection."""
    scale = spec.attn_scale if spec.attn_scale is not None else 1.0 / math.sqrt(d["d_kv"].size)
    if spec.combined_heads or spec.relative is not None or isinstance(attend, Attend):
        return _mtf_attention(h, d, spec, scope, attend, scale)
    kv = "kv_heads" if spec.grouped_query else "heads"
    if attend.derives and not spec.grouped_query:
        q, k, v = _fused_qkv(h, d, spec, scope, attend)
    else:
        q, k, v = (_projection(h, [d[heads], d["d_kv"]], spec, f"{scope}/{w}", spec.qkv_bias)
                   for w, heads in (("q", "heads"), ("k", kv), ("v", kv)))
    if spec.rope_theta is not None:
        q = attend.rotary(q, spec.rope_theta, name=f"{scope}/q_rope")
        k = attend.rotary(k, spec.rope_theta, name=f"{scope}/k_rope")
    kind = "gqa" if spec.grouped_query else "sdpa"
    o = attend.attend(q, k, v, scale, name=f"{scope}/{kind}", kv_heads=kv if spec.grouped_query else None)
    return _projection(o, [d["d_model"]], spec, f"{scope}/o", spec.o_bias, reduced_dims=[d["heads"], d["d_kv"]])


def _mtf_attention(h: Tensor, d: dict, spec: BlockSpec, scope: str, attend: Attend, scale: float) -> Tensor:
    """Mesh TF ``transformer``'s multi-head attention (``SelfAttention`` / ``EncDecAttention`` with
    ``AttentionParams``; T5): the kernels ``{scope}/{q,k,v,o}`` (combined ``heads`` dim with
    ``spec.combined_heads``) made first, q from ``h``, k and v from ``attend.source(h)``, the relative bias of
    ``spec.relative`` (self-attention), attention through ``attend``, output projection to ``h``'s shape.

    Raises:
        ValueError: without an :class:`Attend`, or with rotary positions, grouped-query attention or biases
            (not Mesh TF's T5 attention)."""
    if not isinstance(attend, Attend) or spec.rope_theta is not None or spec.grouped_query or spec.qkv_bias \
            or spec.o_bias:
        raise ValueError(f"block {scope!r}: combined_heads / Attend attention is T5's: an Attend, no rotary, "
                         "grouped-query attention or projection biases.")
    heads, dkv, dm = d["heads"], d["d_kv"], d["d_model"]
    split = [heads, dkv]
    fused = [Dimension(heads.name, heads.size * dkv.size)] if spec.combined_heads else split
    w = {}
    for name in "qkvo":
        shape = Shape(fused + [dm] if name == "o" else [dm] + fused)
        reduced = shape.dims[:len(fused)] if name == "o" else [dm]
        init = spec.init or VarianceScalingInitializer(reduced_dims=reduced, new_dims=list(shape - reduced))
        w[name] = get_variable(h.mesh, f"{scope}/{name}{spec.names.attn_kernel}", shape, initializer=init,
                               dtype=h.dtype)

    def project(x: Tensor, name: str) -> Tensor:
        y = einsum([x, w[name]], reduced_dims=[dm])
        return replace_dimensions(y, y.shape.dims[-1], split) if spec.combined_heads else y

    q = project(h, "q")
    k, v = attend.keys_values(h, project, scope)
    bias = attend.relative(q, k, heads, spec.relative) if spec.relative is not None and not attend.cross else None
    o = attend.attend(q, k, v, scale, name=f"{scope}/attention", bias=bias)
    if spec.combined_heads:
        o = replace_dimensions(transpose(o, o.shape - split + split), split, fused[0])
    return einsum([o, w["o"]], output_shape=h.shape)


def _fused_qkv(h: Tensor, d: dict, spec: BlockSpec, scope: str, attend) -> list:
    """q, k, v ``[..., heads, d_kv]`` of a decoding step by one matmul (``transformers``' GPT-2 ``c_attn``): the
    three kernels (and biases) stacked on a ``qkv`` dim in a copy the step keeps (``attend.derive``). The
    variables are asked for in :func:`_projection`'s order (kernel then bias, q, k, v), so a pass that replays
    another's variables (:class:`meshtorch.layers.kv_cache.ReplayVariables`) hands out the same ones."""
    new, reduced, qkv = [d["heads"], d["d_kv"]], [d["d_model"]], Dimension("qkv", 3)
    kernels, biases = [], []
    for w in "qkv":
        kernels.append(_kernel(h, new, spec, f"{scope}/{w}", reduced))
        if spec.qkv_bias:
            biases.append(get_variable(h.mesh, f"{scope}/{w}/bias", Shape(new), initializer=zeros_initializer(),
                                       dtype=h.dtype))
    kernel = attend.derive(stack(kernels, qkv.name, axis=1, name=f"{scope}/qkv/stack"), f"{scope}/qkv/decode_kernel")
    y = einsum([h, kernel], output_shape=(h.shape - [d["d_model"].name]) + [qkv] + new, name=f"{scope}/qkv/einsum")
    if biases:
        y = y + attend.derive(stack(biases, qkv.name, axis=0, name=f"{scope}/qkv/bias_stack"),
                              f"{scope}/qkv/decode_bias")
    return unstack(y, qkv.name, name=f"{scope}/qkv/unstack")


def _mlp(h: Tensor, d: dict, spec: BlockSpec, scope: str) -> Tensor:
    """:func:`meshtorch.layers.feed_forward`: ``W_o act(W_i h)`` or gated ``W_o (act(W_g h) * W_i h)``."""
    act = activation_function(spec.activation)
    up, gate = f"{scope}/{spec.names.mlp_in}", f"{scope}/{spec.names.mlp_gate}"
    if not spec.gated:
        factors = [(up, act)]
    elif spec.names.gate_first:
        factors = [(gate, act), (up, None)]
    else:
        factors = [(up, None), (gate, act)]
    return layers.feed_forward(h, d["d_ff"], factors, f"{scope}/wo", use_bias=spec.mlp_bias,
                               kernel_initializer=spec.init)

"""The one pre-norm Transformer block of the decoder-only models, parametrised by a :class:`BlockSpec`.

:func:`block` is every decoder block of :func:`meshtorch.models.transformer.build_lm` (the native LM, its pipeline,
its KV-cache decoder and its pipeline stage programs) and of :func:`meshtorch.models.hf.build_hf_lm` (GPT-2, Llama,
Qwen2, Mistral): ``x + dropout(attention(norm(x)))``, then ``+ dropout(mlp(norm(.)))`` (Xiong et al. 2020's
pre-LN residual stack; Mesh TF ``transformer``'s pre-norm layers). What differs between the models is a
:class:`BlockSpec` and nothing else:

* norm: ``layer`` (LayerNorm with bias) or ``rms`` (RMSNorm, Zhang & Sennrich 2019), and its epsilon;
* positions: rotary q/k (RoPE, Su et al. 2021) with ``rope_theta``, or none in the block (learned absolute
  positions are added to the embeddings by the model; T5's relative bias is :mod:`meshtorch.transformer`'s);
* attention: multi-head, or grouped-query (Ainslie et al. 2023: keys and values on ``kv_heads``), q/k/v and output
  projections with or without biases, causal, scale ``1/sqrt(d_kv)``, through a
  :mod:`meshtorch.layers.kv_cache` ``FullSequence`` / ``Prefill`` / ``Step`` (training or KV-cache decoding; a
  ``Step`` of a multi-head block projects q, k and v by one matmul on a stacked copy of their kernels);
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

from meshtorch import layers
from meshtorch.core.dims import Dimension, Shape
from meshtorch.core.graph import Tensor
from meshtorch.layers.feedforward import activation_function
from meshtorch.layers.kv_cache import FullSequence
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast
from meshtorch.ops.initializers import Initializer, VarianceScalingInitializer, zeros_initializer
from meshtorch.ops.random import dropout as dropout_op
from meshtorch.ops.shape import stack, unstack
from meshtorch.ops.variables import get_variable

__all__ = ["BlockNames", "MoEOptions", "BlockSpec", "block", "norm", "FULL_SEQUENCE", "NATIVE_NAMES", "HF_NAMES"]


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
    """

    attn_norm: str
    attn: str
    attn_kernel: str
    mlp_norm: str
    mlp: str
    gate_first: bool
    moe: str = "moe"


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

    def __post_init__(self):
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"BlockSpec: norm must be 'rms' or 'layer', got {self.norm!r}.")
        activation_function(self.activation)  # a clear error for an unknown activation name


#: Training: causal attention and rotary over the whole ``length`` window.
FULL_SEQUENCE = FullSequence()


def norm(x: Tensor, dim, spec: BlockSpec, name: str) -> Tensor:
    """``spec.norm`` (:func:`meshtorch.layers.rms_norm` or :func:`~meshtorch.layers.layer_norm`) of ``x`` over
    ``dim`` (``d_model``) with ``spec.norm_eps``; variables ``{name}/scale`` (``/bias``) ``[dim]``."""
    if spec.norm == "layer":
        return layers.layer_norm(x, dim, epsilon=spec.norm_eps, name=name)
    return layers.rms_norm(x, dim, epsilon=spec.norm_eps, name=name)


def block(x: Tensor, d: dict, spec: BlockSpec, prefix: str, attend=FULL_SEQUENCE, train: bool = False,
          moe: bool = False, aux_losses: list | None = None) -> Tensor:
    """One pre-norm block: ``x + dropout(attention(norm(x)))``, then ``+ dropout(mlp or moe(norm(.)))``.

    Args:
        x: ``[..., length, d_model]`` (leading dims such as a pipeline's ``stage`` are batch to every op), or
            ``[batch, d_model]`` in a decoding step.
        d: the model's Dimensions by name: ``d_model``, ``heads``, ``d_kv``, ``d_ff``, and ``kv_heads`` (grouped-query)
            / ``experts`` (MoE) where used.
        spec: the :class:`BlockSpec`.
        prefix: the variables' prefix (``layer_0/``, ``layers0/``).
        attend: the causal self-attention (:mod:`meshtorch.layers.kv_cache`'s ``FullSequence``, ``Prefill`` or
            ``Step``).
        train: build the dropout (``spec.dropout > 0``).
        moe: this layer's feed-forward is a Mixture-of-Experts layer (``spec.moe``); its load-balancing loss
            is appended to ``aux_losses``.

    Returns:
        A Tensor of ``x``'s shape and dtype.

    Raises:
        ValueError: ``moe=True`` with ``spec.moe`` None or without ``aux_losses``.
    """
    n = spec.names
    h = _attention(norm(x, d["d_model"], spec, f"{prefix}{n.attn_norm}"), d, spec, f"{prefix}{n.attn}", attend)
    x = x + _dropout(h, spec, train)
    h = norm(x, d["d_model"], spec, f"{prefix}{n.mlp_norm}")
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
    """Causal self-attention of ``h`` ``[..., d_model]``: q/k/v projections, rotary q/k (``spec.rope_theta``),
    multi-head or grouped-query attention through ``attend``, output projection."""
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
    o = attend.attend(q, k, v, 1.0 / math.sqrt(d["d_kv"].size), name=f"{scope}/{kind}",
                      kv_heads=kv if spec.grouped_query else None)
    return _projection(o, [d["d_model"]], spec, f"{scope}/o", spec.o_bias, reduced_dims=[d["heads"], d["d_kv"]])


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
    if not spec.gated:
        factors = [(f"{scope}/wi", act)]
    elif spec.names.gate_first:
        factors = [(f"{scope}/wi_gate", act), (f"{scope}/wi", None)]
    else:
        factors = [(f"{scope}/wi", None), (f"{scope}/wi_gate", act)]
    return layers.feed_forward(h, d["d_ff"], factors, f"{scope}/wo", use_bias=spec.mlp_bias,
                               kernel_initializer=spec.init)

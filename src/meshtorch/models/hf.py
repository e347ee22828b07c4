"""Graphs of Hugging Face decoder-only families on named dims: GPT-2 and Llama.

:func:`build_hf_lm` builds, from an :class:`~meshtorch.models.hf_config.HFModelConfig`, the exact
computation of ``transformers``' ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (no dropout) over a
``length`` window; :func:`build_hf_decoder` the same model as a KV-cache decoder (a prefill and a
one-token step, :mod:`meshtorch.models.decoding`), which :mod:`meshtorch.runtime.generate` decodes with.

Dimension names are the CLI LM's (``batch``, ``length``, ``d_model``, ``heads``, ``kv_heads``,
``d_kv``, ``d_ff``, ``vocab``; GPT-2's position table adds ``positions``), so layouts such as
``batch:data;heads:model;d_ff:model;vocab:model`` (Llama: ``kv_heads:model`` too) and storage rules
``d_model:data`` apply. Variable names and their safetensors tensors: :func:`hf_tensor_map`.

Grouped-query attention (``num_key_value_heads < num_attention_heads``):
:func:`meshtorch.layers.grouped_query_attention` (queries ``[batch, length, heads, d_kv]``, keys and
values ``[batch, length, kv_heads, d_kv]``); split ``kv_heads`` with ``heads``
(``heads:model;kv_heads:model``) for Megatron-style model parallelism. A multi-head Llama
(``kv_heads == heads``) uses ``heads`` for keys and values too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from meshtorch import layers
from meshtorch.autodiff import recompute_grad
from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Graph, Mesh, Tensor
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.layers.kv_cache import FullSequence
from meshtorch.lowering import Lowering
from meshtorch.models.decoding import DecoderGraph, build_decoder
from meshtorch.models.hf_config import HFModelConfig, hf_dim_sizes, hf_tensor_map
from meshtorch.models.transformer import REMAT_POLICIES, keeps_matmuls, training_updates
from meshtorch.ops import elementwise as ew
from meshtorch.ops.activations import swish
from meshtorch.ops.einsum import einsum
from meshtorch.ops.initializers import random_normal_initializer
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import get_variable, import_tensor, placeholder

__all__ = ["HFGraph", "build_hf_lm", "build_hf_decoder", "hf_flops_per_token", "hf_tensor_map"]


@dataclass
class HFGraph:
    """The built graph of an imported model and its handles (the fields of ``LMGraph`` that
    :mod:`meshtorch.runtime.generate` and the training loop read)."""

    config: HFModelConfig
    graph: Graph
    mesh: Mesh
    inputs: Tensor  # int64 [batch, length]
    targets: Tensor  # int64 [batch, length]
    logits: Tensor  # float32 [batch, length, vocab]
    loss: Tensor  # scalar: mean next-token cross entropy in nats over batch x length
    updates: list
    task_loss: Tensor | None = None
    aux_loss: Tensor | None = None
    bitransformer: object | None = None  # T5: the mtf.transformer.Bitransformer
    decoded: Tensor | None = None  # T5 decode graphs: int32 [batch, decode length] greedy ids (logits, loss None)

    def lowering(self, mesh_shape="", layout="", mesh_impl=None) -> Lowering:
        """Lower on ``mesh_impl`` (a backend or a MeshSpec) or on ``MeshSpec(mesh_shape, layout)`` simulated in
        this process (see ``LMGraph.lowering``)."""
        impl = mesh_impl if mesh_impl is not None else MeshSpec(mesh_shape, layout)
        return Lowering(self.graph, {self.mesh: impl})


def _dims(c: HFModelConfig) -> dict[str, Dimension]:
    d = {n: Dimension(n, s) for n, s in hf_dim_sizes(c).items()}
    d["vocab"] = Dimension("vocab", c.padded_vocab)
    d["batch"], d["length"] = Dimension("batch", c.batch_size), Dimension("length", c.length)
    return d


class _Vars:
    """``get_variable`` with each variable's shape read from :func:`hf_tensor_map` (one source of truth)."""

    def __init__(self, mesh: Mesh, c: HFModelConfig, d: dict):
        self.mesh, self.d = mesh, d
        self.dims = {t.var: [n for g in t.groups for n in g] for t in hf_tensor_map(c)}
        self.std = 0.02

    def __call__(self, name: str, order: list[str] | None = None) -> Tensor:
        names = order or self.dims[name]
        if sorted(names) != sorted(self.dims[name]):
            raise AssertionError(f"hf variable {name!r}: dims {names} vs map {self.dims[name]}")
        init = 1.0 if name.endswith("/scale") else 0.0 if name.endswith("bias") else \
            random_normal_initializer(0.0, self.std)
        return get_variable(self.mesh, name, [self.d[n] for n in names], initializer=init)


_FULL = FullSequence()  # training: causal attention and rotary over the whole ``length`` window


def _proj(x: Tensor, w: Tensor, out_dims: list, name: str) -> Tensor:
    shape = (x.shape - ["d_model"]) + out_dims
    return einsum([x, w], output_shape=shape, name=name)


def _gpt2_block(x, v, d, c, i, attn=_FULL):
    p = f"h{i}/"
    h = layers.layer_norm(x, d["d_model"], epsilon=c.norm_eps, name=f"{p}ln_1")
    qkv = []
    for w in "qkv":
        t = _proj(h, v(f"{p}attn/{w}"), [d["heads"], d["d_kv"]], f"{p}attn/{w}_proj") + v(f"{p}attn/{w}_bias")
        qkv.append(t)
    o = attn.attend(*qkv, 1.0 / math.sqrt(c.d_kv), name=f"{p}attn/sdpa")
    x = x + (einsum([o, v(f"{p}attn/o")], output_shape=x.shape, name=f"{p}attn/o_proj") + v(f"{p}attn/o_bias"))
    h = layers.layer_norm(x, d["d_model"], epsilon=c.norm_eps, name=f"{p}ln_2")
    h = _proj(h, v(f"{p}mlp/wi"), [d["d_ff"]], f"{p}mlp/wi_proj") + v(f"{p}mlp/wi_bias")
    h = ew.gelu(h, approximate=c.activation)
    h = einsum([h, v(f"{p}mlp/wo")], output_shape=x.shape, name=f"{p}mlp/wo_proj") + v(f"{p}mlp/wo_bias")
    return x + h


def _llama_attention(h, v, d, c, p, attn):
    """Llama self-attention with rotary q/k; grouped-query attention when ``kv_heads < heads``."""
    kv = "heads" if c.num_kv_heads == c.num_heads else "kv_heads"
    q = attn.rotary(_proj(h, v(f"{p}attn/q", ["d_model", "heads", "d_kv"]), [d["heads"], d["d_kv"]],
                          f"{p}attn/q_proj"), c.rope_theta, name=f"{p}attn/q_rope")
    k = attn.rotary(_proj(h, v(f"{p}attn/k", ["d_model", kv, "d_kv"]), [d[kv], d["d_kv"]], f"{p}attn/k_proj"),
                    c.rope_theta, name=f"{p}attn/k_rope")
    val = _proj(h, v(f"{p}attn/v", ["d_model", kv, "d_kv"]), [d[kv], d["d_kv"]], f"{p}attn/v_proj")
    o = attn.attend(q, k, val, 1.0 / math.sqrt(c.d_kv), name=f"{p}attn/{'sdpa' if kv == 'heads' else 'gqa'}",
                    kv_heads=None if kv == "heads" else kv)
    return einsum([o, v(f"{p}attn/o", ["heads", "d_kv", "d_model"])], output_shape=h.shape, name=f"{p}attn/o_proj")


def _llama_block(x, v, d, c, i, attn=_FULL):
    p = f"layers{i}/"
    h = layers.rms_norm(x, d["d_model"], epsilon=c.norm_eps, name=f"{p}input_layernorm")
    x = x + _llama_attention(h, v, d, c, p, attn)
    h = layers.rms_norm(x, d["d_model"], epsilon=c.norm_eps, name=f"{p}post_attention_layernorm")
    gate = _proj(h, v(f"{p}mlp/gate", ["d_model", "d_ff"]), [d["d_ff"]], f"{p}mlp/gate_proj")
    up = _proj(h, v(f"{p}mlp/up", ["d_model", "d_ff"]), [d["d_ff"]], f"{p}mlp/up_proj")
    h = einsum([swish(gate) * up, v(f"{p}mlp/down", ["d_ff", "d_model"])], output_shape=x.shape,
               name=f"{p}mlp/down_proj")
    return x + h


def _remat(c: HFModelConfig, block, x, v, d, i, attn=_FULL):
    """Block ``i``, its activations recomputed in the backward pass under ``c.remat`` (``block``: keep only the
    block input; ``selective``: keep the matmul and attention outputs), as the native LM's blocks."""
    if c.remat == "none":
        return block(x, v, d, c, i, attn)
    return recompute_grad(lambda t: block(t, v, d, c, i, attn), [x],
                          keep=keeps_matmuls if c.remat == "selective" else None)


def hf_flops_per_token(c: HFModelConfig) -> float:
    """Training FLOPs per token of a GPT-2 / Llama graph (6N for the weights + attention scores, PaLM appendix
    B convention, as :func:`meshtorch.models.transformer.flops_per_token`)."""
    ffn = c.d_model * c.d_ff * (3 if c.family == "llama" else 2)
    attn_w = c.d_model * c.d_kv * (2 * c.num_heads + 2 * c.num_kv_heads)
    n = c.num_layers * (attn_w + ffn) + c.d_model * c.padded_vocab
    return 6 * n + 6 * c.num_layers * 2 * c.num_heads * c.d_kv * c.length


def _forward(c: HFModelConfig, d: dict, v: _Vars, mesh: Mesh, ids: Tensor, position, attn) -> Tensor:
    """Logits ``[batch, (length,) vocab]`` of ``ids`` ``[batch, length]`` (``position`` None) or ``[batch]`` at
    the int32 scalar ``position`` (a decoding step); self-attention through ``attn``
    (:mod:`meshtorch.layers.kv_cache`)."""
    out = [d["batch"]] + ([d["length"]] if position is None else []) + [d["vocab"]]
    if c.family == "gpt2":
        wte = v("wte")
        pos_ids = position if position is not None else import_tensor(mesh, torch.arange(c.length), [d["length"]],
                                                                      name="position_ids", dtype=torch.int64)
        x = layers.embedding_lookup(wte, ids, d["vocab"]) + layers.embedding_lookup(v("wpe"), pos_ids,
                                                                                   d["positions"])
        for i in range(c.num_layers):
            x = _remat(c, _gpt2_block, x, v, d, i, attn)
        x = layers.layer_norm(x, d["d_model"], epsilon=c.norm_eps, name="ln_f")
        emb = wte
    else:
        emb = v("embed_tokens")
        x = layers.embedding_lookup(emb, ids, d["vocab"])
        for i in range(c.num_layers):
            x = _remat(c, _llama_block, x, v, d, i, attn)
        x = layers.rms_norm(x, d["d_model"], epsilon=c.norm_eps, name="norm")
    head = emb if c.tied else v("lm_head")
    logits = layers.embedding_logits(x, head, d["d_model"], output_shape=out, name="lm_head_proj")
    if c.padded_vocab != c.vocab_size:  # padded classes never win: -1e9 added (no gradient), as the native LM
        mask = torch.zeros(c.padded_vocab)
        mask[c.vocab_size:] = -1e9
        logits = logits + import_tensor(mesh, mask.to(logits.dtype), [d["vocab"]], name="vocab_pad_mask")
    return logits


def build_hf_decoder(config: HFModelConfig, seed: int = 0) -> DecoderGraph:
    """The KV-cache decoder graph (:func:`meshtorch.models.decoding.build_decoder`) of :func:`build_hf_lm`'s
    GPT-2 / Llama model: the same variable names, a prefill over ``[batch, length]`` and a one-token step
    (GPT-2: position embedding of ``position``; Llama: rotary by ``position``); caches
    ``[batch, heads or kv_heads, memory_length, d_kv]``.

    Raises:
        ValueError: if ``config.length`` is 0 (call ``with_shape`` first) or the family is not GPT-2 / Llama.
    """
    c = replace(config, remat="none")
    if c.length < 1:
        raise ValueError("build_hf_decoder: config.length is 0; call config.with_shape(batch_size, length) first.")
    if c.family not in ("gpt2", "llama"):
        raise ValueError(f"build_hf_decoder: no KV-cache decoder for family {c.family!r} (GPT-2 and Llama have one).")
    d = _dims(c)
    return build_decoder(c, lambda mesh, ids, position, attn: _forward(c, d, _Vars(mesh, c, d), mesh, ids, position,
                                                       attn), seed)


def build_hf_lm(config: HFModelConfig, seed: int = 0, optimizer=None, clip_norm: float | None = None) -> HFGraph:
    """Build the graph of ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` for ``config`` (batch and length set
    by :meth:`HFModelConfig.with_shape`).

    Inputs ``inputs`` / ``targets`` int64 ``[batch, length]``; ``logits`` float32
    ``[batch, length, vocab]``; ``loss`` the mean cross entropy of ``logits`` against ``targets``
    (``transformers``' causal-LM loss on ``ids[:, :length + 1]`` when ``inputs = ids[:, :-1]`` and
    ``targets = ids[:, 1:]``). Variables are initialised N(0, 0.02) (norm scales 1, biases 0) until
    :func:`meshtorch.checkpoint.hf.load_hf_weights` fills them.

    ``config.vocab_multiple`` > 1 pads ``vocab`` to ``config.padded_vocab`` (so a mesh axis splits it): the padded
    logits get -1e9 added (never chosen, no share of the softmax, no gradient into the padded rows), as the
    native LM's. ``config.remat`` (``block`` / ``selective``) recomputes each block in the backward pass
    (:func:`meshtorch.autodiff.recompute_grad`, the native LM's policies).

    Args:
        optimizer: a ``meshtorch.optim`` optimizer; its update ops go to ``HFGraph.updates``.
        clip_norm: clip gradients to this global norm first.

    Raises:
        ValueError: if ``config.length`` is 0 (call ``with_shape`` first).
    """
    c = config
    if c.length < 1:
        raise ValueError("build_hf_lm: config.length is 0; call config.with_shape(batch_size, length) first.")
    if c.remat not in REMAT_POLICIES:
        raise ValueError(f"build_hf_lm: remat must be one of {', '.join(REMAT_POLICIES)}, got {c.remat!r}.")
    d = _dims(c)
    graph = Graph(seed=seed)
    mesh = Mesh(graph, "mesh")
    v = _Vars(mesh, c, d)
    inputs = placeholder(mesh, "inputs", [d["batch"], d["length"]], dtype=torch.int64)
    targets = placeholder(mesh, "targets", [d["batch"], d["length"]], dtype=torch.int64)
    logits = _forward(c, d, v, mesh, inputs, None, _FULL)
    xent = layers.softmax_cross_entropy_with_logits(logits, targets, d["vocab"])  # integer targets: no one-hot
    loss = reduce_mean(xent, name="loss")
    updates = training_updates(graph, loss, optimizer, clip_norm)
    return HFGraph(c, graph, mesh, inputs, targets, logits, loss, updates, task_loss=loss)

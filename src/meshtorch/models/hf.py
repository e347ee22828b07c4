"""The one graph builder of the Hugging Face decoder-only families (GPT-2, Llama, Qwen2, Mistral) on named dims.

:func:`build_hf_lm` builds, from an :class:`~meshtorch.models.hf_config.HFModelConfig`, the exact computation of
``transformers``' ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` (no
dropout) over a ``length`` window; :func:`build_hf_decoder` the same model as a KV-cache decoder (a prefill and a
one-token step, :mod:`meshtorch.models.decoding`), which :mod:`meshtorch.runtime.generate` decodes with. Nothing
here is per family: every block is :func:`meshtorch.models.blocks.block` (the one block builder, shared with the
native LM) with the :class:`~meshtorch.models.blocks.BlockSpec` of the config's block options
(:func:`block_spec`; :class:`meshtorch.models.hf_families.BlockOptions`: norm kind, learned or rotary positions,
MLP activation and gating, q/k/v, output and MLP biases, grouped-query attention); the head is tied or untied.

Dimension names are the CLI LM's (``batch``, ``length``, ``d_model``, ``heads``, ``kv_heads``, ``d_kv``, ``d_ff``,
``vocab``; a learned position table adds ``positions``), so layouts such as
``batch:data;heads:model;kv_heads:model;d_ff:model;vocab:model`` and storage rules ``d_model:data`` apply.
Variables: ``embed`` ``[vocab, d_model]``, ``positions``, ``layers{i}/attn_norm/scale`` (``/bias``),
``layers{i}/attn/{q,k,v,o}/kernel`` (``/bias``), ``layers{i}/mlp_norm/...``, ``layers{i}/mlp/{wi_gate,wi,wo}/kernel``
(``/bias``), ``final_norm/...``, ``lm_head``; their safetensors tensors: :func:`hf_tensor_map`.

Grouped-query attention (``num_key_value_heads < num_attention_heads``):
:func:`meshtorch.layers.grouped_query_attention` (queries ``[batch, length, heads, d_kv]``, keys and values
``[batch, length, kv_heads, d_kv]``); split ``kv_heads`` with ``heads`` (``heads:model;kv_heads:model``) for
Megatron-style model parallelism. A multi-head model (``kv_heads == heads``) uses ``heads`` for keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from meshtorch import layers
from meshtorch.autodiff import recompute_grad
from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Graph, Mesh, Tensor
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.core.pipeline import HF_STACKED_NAMES
from meshtorch.lowering import Lowering
from meshtorch.models.blocks import FULL_SEQUENCE, HF_NAMES, BlockSpec, block, norm
from meshtorch.models.decoding import DecoderGraph, build_decoder
from meshtorch.models.hf_config import HFModelConfig, hf_dim_sizes
from meshtorch.models.hf_families import hf_tensor_map
from meshtorch.models.hf_legacy import legacy_names
from meshtorch.models.lm_stages import StageParts
from meshtorch.models.transformer import REMAT_POLICIES, keeps_matmuls, pipelined_stack, training_updates
from meshtorch.ops.initializers import random_normal_initializer
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import get_variable, import_tensor, placeholder

__all__ = ["HFGraph", "build_hf_lm", "build_hf_decoder", "hf_flops_per_token", "hf_tensor_map", "stage_parts"]


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

    @property
    def encoder_decoder(self) -> bool:
        """An encoder-decoder model (T5): its batches are ``inputs | targets`` pairs."""
        return self.config.encoder_decoder

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


_FULL = FULL_SEQUENCE  # training: causal attention and rotary over the whole ``length`` window
_INIT = random_normal_initializer(0.0, 0.02)  # transformers' initializer_range (until weights are loaded)


def block_spec(c: HFModelConfig) -> BlockSpec:
    """The :class:`~meshtorch.models.blocks.BlockSpec` of a decoder-only family's config: its block options
    (:class:`meshtorch.models.hf_families.BlockOptions`: norm and its epsilon, rotary or learned positions, biases,
    activation and gating), grouped-query attention when ``num_kv_heads < num_heads``, N(0, 0.02) kernels,
    :data:`~meshtorch.models.blocks.HF_NAMES`, no dropout."""
    return BlockSpec(HF_NAMES, norm=c.norm, norm_eps=c.norm_eps,
                     rope_theta=c.rope_theta if c.positions == "rotary" else None,
                     grouped_query=c.num_kv_heads != c.num_heads, qkv_bias=c.qkv_bias, o_bias=c.o_bias,
                     mlp_bias=c.mlp_bias, activation=c.activation, gated=c.gated, init=_INIT)


def _norm(c: HFModelConfig, x: Tensor, d: dict, name: str) -> Tensor:
    return norm(x, d["d_model"], block_spec(c), name)


def _block(x: Tensor, d: dict, c: HFModelConfig, i: int, attn=_FULL) -> Tensor:
    """Pre-norm decoder block ``i`` of every decoder-only family: :func:`meshtorch.models.blocks.block` with
    :func:`block_spec`."""
    return block(x, d, block_spec(c), f"layers{i}/", attn)


def _remat(c: HFModelConfig, x, d, i, attn=_FULL):
    """Block ``i``, its activations recomputed in the backward pass under ``c.remat`` (``block``: keep only the
    block input; ``selective``: keep the matmul and attention outputs), as the native LM's blocks."""
    if c.remat == "none":
        return _block(x, d, c, i, attn)
    return recompute_grad(lambda t: _block(t, d, c, i, attn), [x],
                          keep=keeps_matmuls if c.remat == "selective" else None)


def hf_flops_per_token(c: HFModelConfig) -> float:
    """Training FLOPs per token of a decoder-only family's graph (6N for the weights + attention scores, PaLM appendix
    B convention, as :func:`meshtorch.models.transformer.flops_per_token`)."""
    ffn = c.d_model * c.d_ff * (3 if c.gated else 2)
    attn_w = c.d_model * c.d_kv * (2 * c.num_heads + 2 * c.num_kv_heads)
    n = c.num_layers * (attn_w + ffn) + c.d_model * c.padded_vocab
    return 6 * n + 6 * c.num_layers * 2 * c.num_heads * c.d_kv * c.length


def _forward(c: HFModelConfig, d: dict, mesh: Mesh, ids: Tensor, position, attn) -> Tensor:
    """Logits ``[batch, (length,) vocab]`` of ``ids`` ``[batch, length]`` (``position`` None) or ``[batch]`` at
    the int32 scalar ``position`` (a decoding step); self-attention through ``attn``
    (:mod:`meshtorch.layers.kv_cache`). A pipelined ``c`` (training only) runs the blocks as a pipeline
    (:func:`meshtorch.models.transformer.pipelined_stack`; stacked weights named by :data:`HF_STACKED_NAMES`)."""
    x = _embed(c, d, mesh, ids, position)
    if c.pipelined:
        x = pipelined_stack(c, d, x, lambda h, name: block(h, d, block_spec(c), f"{name}/", attn), HF_STACKED_NAMES)
    for i in range(0 if c.pipelined else c.num_layers):
        x = _remat(c, x, d, i, attn)
    return _head(c, d, mesh, x, position, attn)


def _embed(c: HFModelConfig, d: dict, mesh: Mesh, ids: Tensor, position=None) -> Tensor:
    """Token (and learned position) embeddings ``[batch, (length,) d_model]`` of ``ids``."""
    emb = get_variable(mesh, "embed", [d["vocab"], d["d_model"]], initializer=_INIT)
    x = layers.embedding_lookup(emb, ids, d["vocab"])
    if c.positions == "learned":
        pos_ids = position if position is not None else import_tensor(mesh, torch.arange(c.length), [d["length"]],
                                                                      name="position_ids", dtype=torch.int64)
        table = get_variable(mesh, "positions", [d["positions"], d["d_model"]], initializer=_INIT)
        x = x + layers.embedding_lookup(table, pos_ids, d["positions"])
    return x


def _head(c: HFModelConfig, d: dict, mesh: Mesh, x: Tensor, position=None, attn=_FULL) -> Tensor:
    """Final norm and logits ``[batch, (length,) vocab]`` of the last block's output ``x`` (a tied head reads
    ``embed``); padded classes get -1e9 added."""
    out = [d["batch"]] + ([d["length"]] if position is None else []) + [d["vocab"]]
    x = _norm(c, x, d, "final_norm")
    head = get_variable(mesh, "embed" if c.tied else "lm_head", [d["vocab"], d["d_model"]], initializer=_INIT)
    # a decoding step reads the head as a contiguous [d_model, vocab] copy (a matrix-vector product)
    head = attn.weight(head, [d["d_model"], d["vocab"]], "lm_head_proj/decode_kernel")
    logits = layers.embedding_logits(x, head, d["d_model"], output_shape=out, name="lm_head_proj")
    if c.padded_vocab != c.vocab_size:  # padded classes never win: -1e9 added (no gradient), as the native LM
        mask = torch.zeros(c.padded_vocab)
        mask[c.vocab_size:] = -1e9
        logits = logits + import_tensor(mesh, mask.to(logits.dtype), [d["vocab"]], name="vocab_pad_mask")
    return logits


def stage_parts(c: HFModelConfig) -> StageParts:
    """The pieces of the imported model that :func:`meshtorch.models.lm_stages.stage_programs` cuts into
    pipeline stages (the stage executor of ``--pipeline-schedule 1f1b`` etc.): embeddings, block ``i``
    (``layers{i}/...``, no remat: the stage executor stashes activations), head. A tied head reads ``embed`` in
    the last stage's graph, so the stage graphs of a tied model share that variable's name.

    Raises:
        ValueError: an encoder-decoder family (T5)."""
    if c.encoder_decoder:
        raise ValueError(f"hf.stage_parts: the encoder-decoder family {c.family!r} is not pipelined.")
    d = _dims(c)
    return StageParts(d, lambda mesh, ids: _embed(c, d, mesh, ids), lambda x, i: _block(x, d, c, i),
                      lambda mesh, x: _head(c, d, mesh, x), HF_STACKED_NAMES,
                      legacy_names=legacy_names(c))


def _check_map(graph: Graph, c: HFModelConfig) -> None:
    """Every variable of :func:`hf_tensor_map` exists with the map's dims (the builder and the records agree); in a
    pipelined graph as its stacked variable ``[stage, (repeat,) ...]``."""
    have = {v.name: [dim.name for dim in v.outputs[0].shape] for v in graph.all_variables}
    lead = ["stage"] + (["repeat"] if c.pipeline_repeats > 1 else [])
    for t in hf_tensor_map(c):
        want = [n for g in t.groups for n in g]
        split = HF_STACKED_NAMES.stacked(t.var) if c.pipelined else None
        name, want = (split[1], lead + want) if split else (t.var, want)
        if sorted(have.get(name, [])) != sorted(want):
            raise AssertionError(f"hf {c.family}: variable {name!r} has dims {have.get(name)}; the map says {want}.")


def build_hf_decoder(config: HFModelConfig, seed: int = 0) -> DecoderGraph:
    """The KV-cache decoder graph (:func:`meshtorch.models.decoding.build_decoder`) of :func:`build_hf_lm`'s
    decoder-only model: the same variable names, a prefill over ``[batch, length]`` and a one-token step
    (GPT-2: position embedding of ``position``; Llama: rotary by ``position``); caches
    ``[batch, heads or kv_heads, memory_length, d_kv]``.

    Raises:
        ValueError: if ``config.length`` is 0 (call ``with_shape`` first) or the family is an encoder-decoder (T5).
    """
    c = replace(config, remat="none", pipeline_stages=0, microbatches=1, pipeline_repeats=1)
    if c.length < 1:
        raise ValueError("build_hf_decoder: config.length is 0; call config.with_shape(batch_size, length) first.")
    if c.encoder_decoder:
        raise ValueError(f"build_hf_decoder: no KV-cache decoder for the encoder-decoder family {c.family!r}.")
    d = _dims(c)
    dec = build_decoder(c, lambda mesh, ids, position, attn: _forward(c, d, mesh, ids, position, attn), seed)
    dec.graph.legacy_names = legacy_names(c)  # checkpoints of main 22cc587 and earlier restore too
    dec.graph.stacked_names = HF_STACKED_NAMES  # a pipeline layout's (stacked) checkpoint restores too
    return dec


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
    graph.legacy_names = legacy_names(c)  # checkpoints of main 22cc587 and earlier restore too
    graph.stacked_names = HF_STACKED_NAMES  # checkpoints of the other (un)pipelined naming restore too
    mesh = Mesh(graph, "mesh")
    inputs = placeholder(mesh, "inputs", [d["batch"], d["length"]], dtype=torch.int64)
    targets = placeholder(mesh, "targets", [d["batch"], d["length"]], dtype=torch.int64)
    logits = _forward(c, d, mesh, inputs, None, _FULL)
    _check_map(graph, c)
    xent = layers.softmax_cross_entropy_with_logits(logits, targets, d["vocab"])  # integer targets: no one-hot
    loss = reduce_mean(xent, name="loss")
    updates = training_updates(graph, loss, optimizer, clip_norm)
    return HFGraph(c, graph, mesh, inputs, targets, logits, loss, updates, task_loss=loss)

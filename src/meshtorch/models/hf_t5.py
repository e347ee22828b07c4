"""T5 (``T5ForConditionalGeneration``, Raffel et al. 2020) on the one block builder: every encoder and decoder block
is :func:`meshtorch.models.blocks.block` with T5's :class:`~meshtorch.models.blocks.BlockSpec` (:func:`t5_block_specs`).

The model is Mesh TF's T5 (``transformer.Bitransformer`` of two ``Unitransformer`` stacks, as
:func:`meshtorch.transformer.t5.t5_bitransformer` builds it; decoded with a KV cache by
:func:`meshtorch.models.hf_t5_decoder.build_t5_decoder`): pre-norm RMS norms (no mean subtraction, no
bias, eps 1e-6); attention logits not scaled (T5 folds ``1/sqrt(d_kv)`` into the query's initialisation); a relative
position bias per stack (:class:`~meshtorch.models.blocks.RelativeBias`: made in the first block, shared by the
others; bidirectional buckets in the encoder, causal in the decoder); encoder-decoder attention in the decoder blocks;
the feed-forward ``wo(gelu_tanh(wi_0 x) * wi_1 x)`` (T5 v1.1's gated-gelu) or ``wo(relu(wi x))``; one input embedding
shared by both stacks, an untied head. Masks are Mesh TF's: id 0 is padding in inputs and targets, a position sees the
positions of its own sequence id (``min(ids, 1)``), the decoder's also only earlier ones, and each stack's output is
zeroed at padding; logits of non-padding positions equal ``transformers``' with ``attention_mask = ids != 0``. (Mesh
TF also zeroes the padding positions of each sublayer's input, ``sublayer_mask_padding``: no output, loss or gradient
depends on those values, which the masks above hide, so the builder does not; ``benchmarks/t5_bitwise.py`` checks the
graph bitwise against Mesh TF's.)

Dimension names: ``batch``, ``length`` (encoder inputs and decoder targets), ``memory_length`` (keys), ``d_model``,
``heads`` (also the combined ``heads x d_kv`` dim of the projection kernels, as Mesh TF), ``d_kv``, ``d_ff``,
``vocab``, ``buckets``. Variable names are Mesh TF's (:func:`meshtorch.models.hf_config.t5_tensor_map`):
``shared/embedding``, ``{encoder,decoder}/block_{i:03d}/layer_{j:03d}/{rms_norm/scale, SelfAttention/{q,k,v,o},
EncDecAttention/..., DenseReluDense/{wi_0,wi_1,wi,wo}/kernel}``, ``.../block_000/layer_000/SelfAttention/
relative_attention_bias``, ``{encoder,decoder}/rms_norm/scale``, ``decoder/logits/kernel``.
"""

from __future__ import annotations

import torch

from meshtorch import layers
from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Graph, Mesh, Tensor
from meshtorch.core.pipeline import T5_STACKED_NAMES
from meshtorch.models.blocks import Attend, BlockNames, BlockSpec, RelativeBias, block, mask_bias, norm
from meshtorch.models.hf import HFGraph
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.transformer import pipelined_stack, training_updates
from meshtorch.ops.binary import equal, greater, greater_equal, maximum, minimum, not_equal
from meshtorch.ops.elementwise import abs as abs_op
from meshtorch.ops.elementwise import cast
from meshtorch.ops.indexing import one_hot
from meshtorch.ops.reduce import reduce_sum
from meshtorch.ops.reshape import rename_dimension
from meshtorch.ops.sequence import mtf_range, shift
from meshtorch.ops.variables import get_variable, placeholder

__all__ = ["t5_block_specs", "build_t5", "t5_graph", "t5_stack", "t5_encode", "t5_decode_logits", "causal_mask"]

MAX_DISTANCE = 128  # T5's relative_attention_max_distance


def _names(gated: bool, decoder: bool) -> BlockNames:
    ffn = "layer_002" if decoder else "layer_001"
    return BlockNames("layer_000/rms_norm", "layer_000/SelfAttention", "", f"{ffn}/rms_norm", f"{ffn}/DenseReluDense",
                      gate_first=True, mlp_in="wi_1" if gated else "wi", mlp_gate="wi_0",
                      cross_norm="layer_001/rms_norm", cross="layer_001/EncDecAttention")


def t5_block_specs(c: HFModelConfig) -> tuple[BlockSpec, BlockSpec]:
    """The encoder's and the decoder's :class:`~meshtorch.models.blocks.BlockSpec` of the T5 config ``c``: RMS norm
    (``c.norm_eps``), unscaled logits, Mesh TF's combined-heads kernels and names, the stack's shared relative bias
    (``c.relative_buckets`` buckets, max distance 128), gated-gelu (tanh GELU) or ReLU feed-forward, no biases."""
    act = "gelu_tanh" if c.gated else "relu"
    return tuple(BlockSpec(_names(c.gated, stack == "decoder"), norm="rms", norm_eps=c.norm_eps, activation=act,
                           gated=c.gated, attn_scale=1.0, combined_heads=True,
                           relative=RelativeBias(f"{stack}/block_000/layer_000/SelfAttention/relative_attention_bias",
                                                 c.relative_buckets, MAX_DISTANCE))
                 for stack in ("encoder", "decoder"))


def t5_stack(x: Tensor, d: dict, spec: BlockSpec, stack: str, n: int, seq: Tensor | None, attend: Attend,
             cross: Attend | None = None, pipelined: HFModelConfig | None = None) -> Tensor:
    """``n`` blocks of ``spec`` under ``{stack}/block_{i:03d}/``, the final RMS norm ``{stack}/rms_norm``; positions of
    sequence id 0 (padding) zeroed at the output (Mesh TF; ``seq`` None: none zeroed, a decoder's own tokens).
    ``pipelined``: a pipelined config: the blocks run as its pipeline (:func:`_pipelined_blocks`)."""
    if pipelined is not None:
        x = _pipelined_blocks(pipelined, d, x, spec, stack, attend, cross)
    for i in range(0 if pipelined is not None else n):
        x = block(x, d, spec, f"{stack}/block_{i:03d}/", attend, cross=cross)
    x = norm(x, d["d_model"], spec, f"{stack}/rms_norm")
    return x if seq is None else x * cast(not_equal(seq, 0), torch.float32)


class _StackBias(Attend):
    """An :class:`Attend` whose relative bias is the stack's, gathered once outside the pipeline (the table is one
    variable of ``block_000``, not a per-layer one the pipeline could stack)."""

    def __init__(self, masks: list, bias: Tensor | None, memory: Tensor | None = None, bidirectional: bool = True):
        super().__init__(masks, memory=memory, bidirectional=bidirectional)
        self.bias = bias

    def relative(self, q, k, heads, r):
        return self.bias


def _pipelined_blocks(c: HFModelConfig, d: dict, x: Tensor, spec: BlockSpec, stack: str, attend: Attend,
                      cross: Attend | None) -> Tensor:
    """A T5 stack's blocks as ``c``'s pipeline (:func:`meshtorch.models.transformer.pipelined_stack`; the stacked
    weights ``{stack}/stack/...`` named by :data:`~meshtorch.core.pipeline.T5_STACKED_NAMES`), as Megatron-LM
    pipelines T5: the masks with a ``batch`` dim and the encoder output (``cross``'s memory) are side inputs, so
    each block reads its microbatch's slices; the relative bias ``[heads, length, memory_length]`` is gathered once
    outside and shared, as the causal mask.

    Raises:
        ValueError: the schedule's ``stages x repeats`` is not the stack's layer count."""
    sched, n = c.pipeline_schedule, (c.num_layers if stack == "encoder" else c.num_decoder_layers)
    if sched.stages * sched.repeats != n:
        raise ValueError(f"build_t5: the {stack} has {n} blocks; a pipeline of {sched.stages} stages x "
                         f"{sched.repeats} repeats needs stages x repeats = num_layers = num_decoder_layers.")
    names = T5_STACKED_NAMES[0 if stack == "encoder" else 1]
    rel = attend.relative(x, _memory(x), d["heads"], spec.relative)  # [heads, length, memory_length]
    per_batch = [i for i, m in enumerate(attend.masks) if "batch" in m.shape]
    cross_masks = cross.masks if cross is not None else []
    sides = [attend.masks[i] for i in per_batch] + list(cross_masks) + ([cross.memory] if cross is not None else [])

    def stage_fn(h: Tensor, name: str, *got: Tensor) -> Tensor:
        masks, got = list(attend.masks), list(got)
        for i in per_batch:
            masks[i] = got.pop(0)
        self_attn = _StackBias(masks, rel, bidirectional=attend.bidirectional)
        cross_t = None
        if cross is not None:
            cross_t = Attend(got[:len(cross_masks)], memory=got[len(cross_masks)])
        return block(h, d, spec, f"{name}/", self_attn, cross=cross_t)

    return pipelined_stack(c, d, x, stage_fn, names, side_inputs=sides, name=f"{stack}/pipeline")


def t5_graph(c: HFModelConfig, who: str, seed: int) -> tuple[dict[str, Dimension], Graph, Mesh]:
    """T5's Dimensions by name (``batch``, ``length`` from ``with_shape``; ``heads`` of ``num_heads``), a new Graph
    (``seed``) and its Mesh ``mesh``, for the builder ``who``.

    Raises:
        ValueError: naming ``who``, if ``c.length`` is 0 (call ``with_shape`` first) or ``c`` is not an
            encoder-decoder."""
    if c.length < 1:
        raise ValueError(f"{who}: config.length is 0; call config.with_shape(batch_size, length) first.")
    if not c.encoder_decoder:
        raise ValueError(f"{who}: {c.family!r} is not an encoder-decoder family; build it with build_hf_lm.")
    d = {n: Dimension(n, s) for n, s in (("batch", c.batch_size), ("length", c.length), ("d_model", c.d_model),
                                         ("heads", c.num_heads), ("d_kv", c.d_kv), ("d_ff", c.d_ff),
                                         ("vocab", c.vocab_size))}
    graph = Graph(seed=seed)
    return d, graph, Mesh(graph, "mesh")


def _memory(t: Tensor) -> Tensor:
    return rename_dimension(t, "length", "memory_length")


def t5_encode(c: HFModelConfig, d: dict, emb: Tensor, inputs: Tensor) -> tuple[Tensor, Tensor]:
    """The encoder stack of ``inputs`` (ids ``[batch, length]``, 0 padding): ``(output [batch, memory_length,
    d_model], sequence ids [batch, memory_length])`` (1 a token, 0 padding), the encoder-decoder attention's memory.
    A pipelined ``c`` runs the blocks as its pipeline."""
    enc_spec, _ = t5_block_specs(c)
    enc_seq = minimum(inputs, 1)  # sequence ids: 1 a token, 0 padding
    enc_self = Attend([_same_sequence(enc_seq, _memory(enc_seq))], bidirectional=True)
    x = t5_stack(layers.embedding_lookup(emb, inputs, d["vocab"]), d, enc_spec, "encoder", c.num_layers, enc_seq,
                 enc_self, pipelined=c if c.pipelined else None)
    return _memory(x), _memory(enc_seq)


def t5_decode_logits(c: HFModelConfig, d: dict, ids: Tensor, seq: Tensor | None, attend: Attend,
                     cross: Attend) -> Tensor:
    """The decoder stack and head on decoder input ids ``ids`` (``[batch, length]``, or ``[batch]`` in a decoding
    step): logits ``[batch, (length,) vocab]``; ``seq``: the sequence ids whose 0 zeroes the stack's output. A
    pipelined ``c`` runs the blocks as its pipeline (training: ``ids`` ``[batch, length]``)."""
    _, dec_spec = t5_block_specs(c)
    emb = get_variable(ids.mesh, "shared/embedding", [d["vocab"], d["d_model"]])
    x = t5_stack(layers.embedding_lookup(emb, ids, d["vocab"]), d, dec_spec, "decoder", c.num_decoder_layers, seq,
                 attend, cross, pipelined=c if c.pipelined else None)
    return layers.dense(x, d["vocab"], reduced_dims=[d["d_model"]], use_bias=False, name="decoder/logits")


def causal_mask(mesh: Mesh, length: Dimension) -> Tensor:
    """``-1e9`` where a key (``memory_length``) is after the query (``length``)."""
    pos = mtf_range(mesh, length, dtype=torch.int32)
    return mask_bias(greater_equal(pos, _memory(pos)))


def _same_sequence(seq: Tensor, memory_seq: Tensor) -> Tensor:
    """The padding mask: ``-1e9`` where a query and a key have different sequence ids."""
    return mask_bias(equal(seq, memory_seq))


def build_t5(config: HFModelConfig, seed: int = 0, optimizer=None, clip_norm: float | None = None) -> HFGraph:
    """The training / scoring graph of ``T5ForConditionalGeneration`` for the imported ``config`` (batch and length
    from :meth:`HFModelConfig.with_shape`; encoder and decoder both get ``length``).

    ``inputs``: int32 encoder ids ``[batch, length]``; ``targets``: int32 decoder labels ``[batch, length]`` (the
    decoder reads them shifted right with 0, T5's ``decoder_start_token_id``); id 0 is padding in both; ``logits``:
    float32 ``[batch, length, vocab]``; ``loss``: the cross entropy summed over the non-padding targets and divided
    by all ``batch x length`` target positions (Mesh TF's ``loss_denominator``). Variables are initialised as the
    builder's defaults until :func:`meshtorch.checkpoint.hf.load_hf_weights` fills them.

    Args:
        optimizer: a ``meshtorch.optim`` optimizer; its update ops go to ``HFGraph.updates``.
        clip_norm: clip gradients to this global norm first.

    A pipelined ``config`` (``pipeline_stages`` S > 1, a ``stage:pipe`` layout) runs the encoder's blocks, then the
    decoder's, as S-stage pipelines (GPipe; circular with ``pipeline_repeats``) over the same ``stage`` dim, as
    Megatron-LM pipelines T5 (encoder layers, then decoder layers, across the stages; the encoder output carried to
    the decoder's): every decoder block reads its microbatch's encoder output and masks
    (:func:`meshtorch.layers.pipeline.pipeline`'s side inputs). Its block weights are stacked,
    ``{encoder,decoder}/stack/...`` ``[stage, (repeat,) ...]`` (:data:`~meshtorch.core.pipeline.T5_STACKED_NAMES`).

    Raises:
        ValueError: if ``config.length`` is 0 (call ``with_shape`` first) or the family is not an encoder-decoder;
            a pipeline whose stages x repeats is not both stacks' block count.
    """
    c = config
    d, graph, mesh = t5_graph(c, "build_t5", seed)
    graph.stacked_names = T5_STACKED_NAMES  # checkpoints of the other (un)pipelined naming restore too
    inputs = placeholder(mesh, "inputs", [d["batch"], d["length"]], dtype=torch.int32)
    targets = placeholder(mesh, "targets", [d["batch"], d["length"]], dtype=torch.int32)
    dec_seq = minimum(targets, 1)  # sequence ids: 1 a token, 0 padding
    emb = get_variable(mesh, "shared/embedding", [d["vocab"], d["d_model"]])
    enc_out, enc_seq_mem = t5_encode(c, d, emb, inputs)
    # decoder inputs: the targets shifted right, 0 at each sequence's first position (Mesh TF autoregressive_inputs)
    first = equal(dec_seq, shift(dec_seq, 1, "length", wrap=False))
    dec_in = abs_op(shift(targets, 1, "length", wrap=False)) * cast(first, targets.dtype)
    dec_self = Attend([causal_mask(mesh, d["length"]), _same_sequence(dec_seq, _memory(dec_seq))],
                      bidirectional=False)
    cross = Attend([_same_sequence(dec_seq, enc_seq_mem)], memory=enc_out)
    logits = t5_decode_logits(c, d, dec_in, dec_seq, dec_self, cross)
    hot = one_hot(maximum(targets, 0), d["vocab"], dtype=torch.float32)
    xent = layers.softmax_cross_entropy_with_logits(logits, hot, d["vocab"])
    weights = cast(greater(targets, 0), torch.float32)
    loss = reduce_sum(xent * weights) / float(c.batch_size * c.length)
    updates = training_updates(graph, loss, optimizer, clip_norm)
    return HFGraph(c, graph, mesh, inputs, targets, logits, loss, updates, task_loss=loss)

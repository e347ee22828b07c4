"""Encoder-decoder Transformer (T5-style) on named dimensions.

Raffel et al. 2020 (T5), section 2.1, and Mesh TF ``transformer`` (Bitransformer): pre-norm
residual layers with RMS norm (no bias); the encoder's self-attention is bidirectional with a
padding mask; the decoder has causal self-attention, then encoder-decoder attention over the
encoder output, then the feed-forward block. Positions come from T5's relative-position bias
(bucketed signed distances, a learned scalar per bucket and head, one table per stack shared by its
layers) or, with ``relative_attention=False``, from learned absolute position embeddings.

Dimension names: ``batch``, ``length`` (the encoder's input positions and the decoder's target
positions; the sizes may differ), ``memory_length`` (the encoder output as the decoder's memory,
and the key positions of a self-attention bias), ``d_model``, ``heads``, ``d_kv``, ``d_ff``,
``vocab``, ``relative_buckets``. Split ``batch``, ``heads``, ``d_ff``, ``vocab`` (and ``d_model``)
as in the decoder-only LM; the attention sequence dims must stay whole.

Differences from T5: the attention logits are scaled by ``1/sqrt(d_kv)`` (T5 folds that into the
initialisation), the embedding is shared by encoder and decoder but not tied to the output layer
(T5.1.1), and padding is token id ``pad_id`` (0) in both inputs and targets: padded targets carry
no loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from meshtorch import layers
from meshtorch.autodiff import gradients
from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Graph, Mesh, Tensor
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering import Lowering
from meshtorch.models.blocks import Attend, BlockNames, BlockSpec, block, norm, relative_position_buckets
from meshtorch.models.config_base import TransformerSizes
from meshtorch.ops.binary import divide, equal, not_equal
from meshtorch.ops.elementwise import cast
from meshtorch.ops.indexing import gather, one_hot
from meshtorch.ops.initializers import random_normal_initializer
from meshtorch.ops.random import dropout
from meshtorch.ops.reduce import reduce_sum
from meshtorch.ops.reshape import rename_dimension
from meshtorch.ops.sequence import shift
from meshtorch.ops.variables import get_variable, import_tensor, placeholder

__all__ = ["EncDecConfig", "EncDecGraph", "build_encdec", "relative_position_buckets"]


@dataclass(frozen=True)
class EncDecConfig(TransformerSizes):
    """Hyper-parameters of the encoder-decoder model (the sizes first:
    :class:`~meshtorch.models.config_base.TransformerSizes`, with smaller defaults here)."""

    d_model: int = 128
    num_heads: int = 4
    d_ff: int = 512
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    input_length: int = 64
    target_length: int = 64
    relative_attention: bool = True
    num_buckets: int = 32
    max_distance: int = 128
    pad_id: int = 0
    vocab_multiple: int = 1


@dataclass
class EncDecGraph:
    """The built graph and its handles."""

    config: EncDecConfig
    graph: Graph
    mesh: Mesh
    inputs: Tensor  # int64 [batch, length(input_length)]
    targets: Tensor  # int64 [batch, length(target_length)]
    logits: Tensor  # [batch, length, vocab]
    loss: Tensor  # scalar: mean cross-entropy over the non-padding targets
    updates: list

    def lowering(self, mesh_shape="", layout="", mesh_impl=None) -> Lowering:
        """As :meth:`meshtorch.models.transformer.LMGraph.lowering`: on ``mesh_impl``, else on a
        ``MeshSpec(mesh_shape, layout)`` simulated in this process; LayoutError if the layout is illegal for
        this model."""
        impl = mesh_impl if mesh_impl is not None else MeshSpec(mesh_shape, layout)
        return Lowering(self.graph, {self.mesh: impl})


#: the blocks' variable names (:class:`meshtorch.models.blocks.BlockNames`)
_ENCODER = BlockNames("attention_norm", "attention", "", "ffn_norm", "ffn", gate_first=False)
_DECODER = BlockNames("self_attention_norm", "self_attention", "", "ffn_norm", "ffn", gate_first=False,
                      cross_norm="encdec_attention_norm", cross="encdec_attention")


def _dims(c: EncDecConfig):
    return {"batch": Dimension("batch", c.batch_size), "d_model": Dimension("d_model", c.d_model),
            "heads": Dimension("heads", c.num_heads), "d_kv": Dimension("d_kv", c.d_kv),
            "d_ff": Dimension("d_ff", c.d_ff), "vocab": Dimension("vocab", c.padded_vocab),
            "buckets": Dimension("relative_buckets", c.num_buckets)}


def _relative_bias(c, mesh, d, qlen: int, mlen: int, bidirectional: bool, name: str):
    """``[length, memory_length, heads]``: the stack's bias table gathered at the pairs' buckets."""
    table = get_variable(mesh, f"{name}/relative_attention_bias", [d["buckets"], d["heads"]],
                             initializer=random_normal_initializer(0.0, 1.0))
    ids = relative_position_buckets(qlen, mlen, bidirectional, c.num_buckets, c.max_distance)
    ids = import_tensor(mesh, ids, [Dimension("length", qlen), Dimension("memory_length", mlen)],
                            name=f"{name}/relative_buckets")
    return gather(table, ids, d["buckets"], name=f"{name}/relative_bias")


def build_encdec(config: EncDecConfig, seed: int = 0, optimizer=None, train: bool = True) -> EncDecGraph:
    """Build the encoder-decoder graph and its loss (teacher forcing: decoder inputs = targets shifted right).

    Variables: ``embedding`` [vocab, d_model] (shared by both stacks); ``{encoder,decoder}/
    relative_attention_bias`` [relative_buckets, heads] (or ``.../pos_embedding`` [length, d_model]);
    ``encoder/layer_{i}/{attention,attention_norm,ffn,ffn_norm}/...``;
    ``decoder/layer_{i}/{self_attention,self_attention_norm,encdec_attention,encdec_attention_norm,ffn,
    ffn_norm}/...``; ``{encoder,decoder}/final_norm/scale``; ``logits/kernel`` [d_model, vocab]. Every block is
    :func:`meshtorch.models.blocks.block` (attention kernels ``{q,k,v}`` [d_model, heads, d_kv], ``o``
    [heads, d_kv, d_model]; feed-forward ``wi``, ``wo``; the attention biases through an
    :class:`~meshtorch.models.blocks.Attend`).

    Args:
        config: the EncDecConfig.
        seed: graph seed (initial values and dropout).
        optimizer: an ``meshtorch.optim`` optimizer; its update ops go to ``EncDecGraph.updates``.
        train: build dropout (when ``config.dropout > 0``).
    """
    c = config
    d = _dims(c)
    graph = Graph(seed=seed)
    mesh = Mesh(graph, "mesh")
    in_len, tgt_len = Dimension("length", c.input_length), Dimension("length", c.target_length)
    inputs = placeholder(mesh, "inputs", [d["batch"], in_len], dtype=torch.int64)
    targets = placeholder(mesh, "targets", [d["batch"], tgt_len], dtype=torch.int64)
    emb = get_variable(mesh, "embedding", [d["vocab"], d["d_model"]],
                           initializer=random_normal_initializer(0.0, 1.0))
    spec = BlockSpec(_ENCODER, activation=c.activation, dropout=c.dropout)

    def drop(x):
        return dropout(x, rate=c.dropout) if train and c.dropout > 0 else x

    def embed(ids, length, name):
        x = layers.embedding_lookup(emb, ids, d["vocab"], name=f"{name}/embed")
        if not c.relative_attention:
            x = x + get_variable(mesh, f"{name}/pos_embedding", [length, d["d_model"]],
                                     initializer=random_normal_initializer(0.0, 0.02))
        return drop(x)

    # padding mask on the memory positions: -1e9 where the input is padding
    mem_ids = rename_dimension(inputs, "length", "memory_length")
    pad_bias = cast(equal(mem_ids, c.pad_id), torch.float32) * -1e9
    # ---- encoder: bidirectional self-attention (keys on ``length``, the bias on ``memory_length``)
    x = embed(inputs, in_len, "encoder")
    enc_bias = pad_bias
    if c.relative_attention:
        enc_bias = _relative_bias(c, mesh, d, c.input_length, c.input_length, True, "encoder") + pad_bias
    attend = Attend([enc_bias], memory_length="length")
    for i in range(c.num_encoder_layers):
        x = block(x, d, spec, f"encoder/layer_{i}/", attend, train=train)
    memory = rename_dimension(drop(norm(x, d["d_model"], spec, "encoder/final_norm")), "length", "memory_length")
    # ---- decoder: causal self-attention, then encoder-decoder attention over ``memory``
    dec_ids = shift(targets, 1, "length", wrap=False)  # start token = 0 (= pad_id in T5)
    x = embed(dec_ids, tgt_len, "decoder")
    dec_bias = []
    if c.relative_attention:
        dec_bias = [_relative_bias(c, mesh, d, c.target_length, c.target_length, False, "decoder")]
    attend, cross = Attend(dec_bias, causal=True, memory_length="length"), Attend([pad_bias], memory=memory)
    spec = replace(spec, names=_DECODER)
    for i in range(c.num_decoder_layers):
        x = block(x, d, spec, f"decoder/layer_{i}/", attend, train=train, cross=cross)
    x = drop(norm(x, d["d_model"], spec, "decoder/final_norm"))
    logits = layers.dense(x, d["vocab"], use_bias=False, name="logits")
    if c.padded_vocab != c.vocab_size:
        mask = torch.zeros(c.padded_vocab)
        mask[c.vocab_size:] = -1e9
        logits = logits + import_tensor(mesh, mask, [d["vocab"]], name="vocab_pad_mask")
    xent = layers.softmax_cross_entropy_with_logits(logits, one_hot(targets, d["vocab"]), d["vocab"])
    weights = cast(not_equal(targets, c.pad_id), torch.float32)
    loss = divide(reduce_sum(xent * weights), reduce_sum(weights), name="loss")
    updates = []
    if optimizer is not None:
        variables = graph.trainable_variables
        updates = optimizer.apply_grads(gradients([loss], variables), variables)
    return EncDecGraph(c, graph, mesh, inputs, targets, logits, loss, updates)

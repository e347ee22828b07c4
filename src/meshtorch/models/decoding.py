"""Decoder graphs with a KV cache: a prefill program and a one-token step program over one set of weights
(Mesh TF ``mtf.transformer``'s ``first_part`` and ``incremental`` modes; :mod:`meshtorch.layers.kv_cache`).

:func:`build_decoder` runs a model's forward twice in one graph: over a ``[batch, length]`` window with a
:class:`~meshtorch.layers.kv_cache.Prefill` (its logits are the training graph's logits; its cache writes
fill every layer's keys and values), then over one token per sequence with a
:class:`~meshtorch.layers.kv_cache.Step` at a fed ``position``. Both passes use the same variables, under
the training graph's names (the second pass gets them by :class:`~meshtorch.layers.kv_cache.ReplayVariables`),
so weights copied from a training lowering, or restored from its checkpoint (``strict=False``: the caches are
not in it), decode as trained. :func:`build_lm_decoder` is the native LM's; ``meshtorch.models.hf`` has the
decoder-only Hugging Face families' one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshtorch import layers
from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Graph, Mesh, Tensor
from meshtorch.core.scopes import variable_scope
from meshtorch.layers.kv_cache import Prefill, ReplayVariables, Step, reorder_rows
from meshtorch.lowering import Lowering
from meshtorch.models.transformer import LMConfig, decoder_block, dims, lm_logits
from meshtorch.ops.indexing import gather
from meshtorch.ops.initializers import random_normal_initializer
from meshtorch.ops.variables import get_variable, placeholder

__all__ = ["DecoderGraph", "build_decoder", "build_lm_decoder"]


@dataclass
class DecoderGraph:
    """A decoder graph and its handles.

    Attributes:
        prefill_ids: int64 ``[batch, length]`` placeholder; ``prefill_logits`` ``[batch, length, vocab]`` (as the
            training graph's ``logits``); ``prefill_writes``: the cache writes to fetch with them.
        step_ids: int64 ``[batch]`` placeholder (the token at ``position``); ``position``: int32 scalar
            placeholder (0-based, < length); ``step_logits`` ``[batch, vocab]`` (the next token's);
            ``step_writes``: the cache writes of the step.
        cache_names: the cache variables' names (not in checkpoints).
        reorder_src: int64 ``[beam_src]`` placeholder (``beam_src`` of the batch's size); ``reorder_writes``: the
            cache writes making row ``b`` the old row ``reorder_src[b]`` (beam search).
        derived: ``{name: [source variable names]}`` of the step's derived weights
            (:meth:`~meshtorch.layers.kv_cache.Step.derive`: copies of weights in the form its matmuls read
            fastest; not in checkpoints); ``refresh_writes``: the writes that recompute them from their sources,
            to run after every change of the weights.
        encoder_ids: an encoder-decoder's (T5's) int64 ``[batch, length]`` encoder input placeholder, fed with
            ``prefill_ids`` (:func:`meshtorch.models.hf_t5_decoder.build_t5_decoder`); None for a decoder-only model.
    """

    config: object
    graph: Graph
    mesh: Mesh
    prefill_ids: Tensor
    prefill_logits: Tensor
    prefill_writes: list
    step_ids: Tensor
    position: Tensor
    step_logits: Tensor
    step_writes: list
    cache_names: list
    reorder_src: Tensor
    reorder_writes: list
    derived: dict
    refresh_writes: list
    encoder_ids: Tensor | None = None

    def lowering(self, mesh_impl, init: str = "lazy", mode: str = "codegen") -> Lowering:
        """Lower on ``mesh_impl`` (a MeshImpl or MeshSpec); ``init="lazy"``: variables a copy or restore sets
        first are never drawn."""
        return Lowering(self.graph, {self.mesh: mesh_impl}, init=init, mode=mode)


def build_decoder(config, forward: Callable, seed: int = 0) -> DecoderGraph:
    """Build the prefill and step passes of ``forward`` in one graph.

    Args:
        config: the model config (``batch_size``, ``length``; kept on the result).
        forward: ``forward(mesh, ids, position, attn) -> logits``: the model on ``ids`` (``[batch, length]`` with
            ``position`` None, or ``[batch]`` at the int32 scalar ``position``), calling ``attn.rotary`` /
            ``attn.attend`` (or passing ``attn`` as ``attend`` to the layers) for its self-attention, and
            ``attn.weight`` / ``attn.derive`` for weights the step should read in another form.
        seed: graph seed (initial values before weights are copied in).
    """
    graph = Graph(seed=seed)
    mesh = Mesh(graph, "mesh")
    batch, length = Dimension("batch", config.batch_size), Dimension("length", config.length)
    prefill_ids = placeholder(mesh, "prefill_ids", [batch, length], dtype=torch.int64)
    step_ids = placeholder(mesh, "step_ids", [batch], dtype=torch.int64)
    position = placeholder(mesh, "position", [], dtype=torch.int32)
    replay = ReplayVariables()
    first = Prefill(config.length)
    with variable_scope("", custom_getter=replay.record):
        prefill_logits = forward(mesh, prefill_ids, None, first)
    step = Step(first, position)
    with variable_scope("", custom_getter=replay.replay):
        step_logits = forward(mesh, step_ids, position, step)
    names = [v.operation.name for pair in first.caches.pairs for v in pair]
    src = placeholder(mesh, "reorder_src", [Dimension("beam_src", config.batch_size)], dtype=torch.int64)
    return DecoderGraph(config, graph, mesh, prefill_ids, prefill_logits, first.assigns, step_ids, position,
                        step_logits, step.assigns, names, src, reorder_rows(first, src), step.derived, step.refresh)


def build_lm_decoder(config: LMConfig, seed: int = 0) -> DecoderGraph:
    """The decoder graph of :func:`meshtorch.models.transformer.build_lm`'s LM (same variable names).

    Raises:
        ValueError: naming the field, for a pipelined config (``pipeline_stages`` > 1: stacked weights) or one
            with MoE layers (``num_experts`` > 0); decode those with ``use_cache=False``.
    """
    c = config
    if c.pipelined:
        raise ValueError("build_lm_decoder: a pipelined LM (pipeline_stages > 1) has no KV-cache decoder; decode "
                         "with use_cache=False.")
    if any(c.is_moe_layer(i) for i in range(c.num_layers)):
        raise ValueError("build_lm_decoder: MoE layers (num_experts > 0) have no KV-cache decoder; decode with "
                         "use_cache=False.")
    d = dims(c)

    def forward(mesh, ids, position, attn):
        emb = get_variable(mesh, "embedding", [d["vocab"], d["d_model"]],
                           initializer=random_normal_initializer(0.0, 1.0))
        pos = get_variable(mesh, "pos_embedding", [d["length"], d["d_model"]],
                           initializer=random_normal_initializer(0.0, 0.02))
        x = layers.embedding_lookup(emb, ids, d["vocab"])
        x = x + (pos if position is None else gather(pos, position, d["length"]))
        for i in range(c.num_layers):
            x = decoder_block(c, d, x, f"layer_{i}", attn)
        return lm_logits(c, d, x)

    return build_decoder(c, forward, seed)

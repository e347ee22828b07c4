"""T5's KV-cache decoder on the one block builder: the encoder once, encoder-decoder keys and values cached once per
sequence, the decoder's self-attention keys and values cached and advanced one position per step (Mesh TF
``mtf.transformer``'s ``first_part`` / ``incremental`` modes; ``transformers``' T5 with ``past_key_values``).

:func:`build_t5_decoder` returns a :class:`~meshtorch.models.decoding.DecoderGraph` like the decoder-only families'
(:func:`meshtorch.models.hf.build_hf_decoder`), decoded by the same loop (:mod:`meshtorch.runtime.generate`), with one
more placeholder, ``encoder_ids`` (the encoder's input ``[batch, length]``, 0 padding), fed to the prefill:

* **prefill** (``first_part``): the encoder stack of ``encoder_ids``; each decoder block's encoder-decoder keys and
  values (``{block}/layer_001/EncDecAttention/attention/{k,v}_cache``), and the encoder's padding as an attention bias
  (``decoder/encoder_padding_bias`` ``[batch, memory_length]``), written into cache variables; then the decoder over
  the window ``prefill_ids`` ``[batch, length]`` (causal, T5's relative bias), writing each block's self-attention
  keys and values (:class:`~meshtorch.layers.kv_cache.Prefill`);
* **step** (``incremental``): the decoder on one token per sequence at ``position``: its self-attention keys and values
  written at ``position`` of the caches and attended over with the later positions masked
  (:class:`~meshtorch.layers.kv_cache.Step`), the relative bias of the query at ``position`` (row ``position`` of the
  causal bucket table), the encoder-decoder attention over the cached keys and values (no encoder, no projection of
  its output). A step does one position's matmuls plus attention over ``memory_length`` cached positions, whatever
  the position.

The encoder and the decoder share ``length`` (the encoder's input is padded to it); the caches' ``memory_length`` is
``length``, laid out by the layout rules (``batch:data``, ``heads:model``). Variables are those of
:func:`meshtorch.models.hf_t5.build_t5` (same names), so its weights copy in by name.
"""

from __future__ import annotations

import torch

from meshtorch.core.dims import Dimension
from meshtorch.core.graph import Tensor
from meshtorch.core.pipeline import T5_STACKED_NAMES
from meshtorch.core.scopes import variable_scope
from meshtorch.layers.kv_cache import MEMORY, Prefill, ReplayVariables, Step, reorder_rows
from meshtorch.models.blocks import Attend, RelativeBias, mask_bias, relative_position_buckets
from meshtorch.models.decoding import DecoderGraph
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.hf_t5 import causal_mask, t5_decode_logits, t5_encode, t5_graph
from meshtorch.ops.binary import not_equal
from meshtorch.ops.indexing import gather
from meshtorch.ops.variables import assign, get_variable, import_tensor, placeholder

__all__ = ["build_t5_decoder"]


class _Writes(Attend):
    """An :class:`~meshtorch.models.blocks.Attend` over a whole window whose keys and values are also written into
    ``caches`` (a :class:`~meshtorch.layers.kv_cache.Prefill`): the prefill's self-attention, or its encoder-decoder
    attention (``memory`` given)."""

    def __init__(self, caches: Prefill, masks: list, memory: Tensor | None = None):
        super().__init__(masks, memory=memory, bidirectional=False)
        self.caches = caches

    def keys_values(self, h, project, name):
        k, v = super().keys_values(h, project, name)
        self.caches.write(k, v, f"{name}/attention")
        return k, v


class _StepSelf(Attend):
    """A step's causal self-attention (one query per sequence at ``step.position``): keys and values written into
    the caches and attended over by :meth:`Step.attend`, with T5's relative bias of the query at ``position``."""

    def __init__(self, step: Step):
        super().__init__([], bidirectional=False)
        self.step = step

    def source(self, h):
        return h  # one position: no length dim to rename

    def bucket_ids(self, q: Tensor, k: Tensor, r: RelativeBias) -> Tensor:
        """int64 ``[memory_length]``: row ``position`` of the causal bucket table ``[length, memory_length]``."""
        key = (r.num_buckets, r.max_distance)
        if key not in self._buckets:
            mem = self.step.caches.memory
            rows = Dimension("query_positions", mem.size)
            ids = relative_position_buckets(mem.size, mem.size, False, r.num_buckets, r.max_distance)
            table = import_tensor(q.mesh, ids, [rows, mem], name=f"{r.table}_buckets")
            self._buckets[key] = gather(table, self.step.position, rows)
        return self._buckets[key]

    def attend(self, q, k, v, scale, name, bias=None):
        return self.step.attend(q, k, v, scale, name, bias=bias)


class _StepCross(Attend):
    """A step's encoder-decoder attention: the keys and values the prefill cached (``caches``' pairs, in block order),
    the encoder's padding masked by ``padding`` (``[batch, memory_length]`` bias)."""

    cross = True

    def __init__(self, caches: Prefill, padding: Tensor):
        super().__init__([padding], length=None, memory_length=MEMORY)
        self.pairs, self._next = caches.caches.pairs, 0

    def keys_values(self, h, project, name):
        pair = self.pairs[self._next]
        self._next += 1
        return pair


def build_t5_decoder(config: HFModelConfig, seed: int = 0) -> DecoderGraph:
    """The KV-cache decoder graph of :func:`meshtorch.models.hf_t5.build_t5`'s T5 (module docstring): ``encoder_ids``
    int64 ``[batch, length]`` and ``prefill_ids`` int64 ``[batch, length]`` (the decoder's input, starting with T5's
    ``decoder_start_token_id``) feed the prefill, whose ``prefill_logits`` ``[batch, length, vocab]`` are the
    training graph's for targets ``prefill_ids`` shifted left; ``step_ids`` ``[batch]`` at ``position`` feed the step
    (``step_logits`` ``[batch, vocab]``). Caches: per decoder block ``[batch, heads, memory_length, d_kv]`` for
    self-attention and for encoder-decoder attention, and the encoder's padding bias.

    Raises:
        ValueError: if ``config.length`` is 0 (call ``with_shape`` first) or the family is not an encoder-decoder.
    """
    c = config.replace(pipeline_stages=0, microbatches=1, pipeline_repeats=1)  # a pipelined run decodes unpipelined
    d, graph, mesh = t5_graph(c, "build_t5_decoder", seed)
    graph.stacked_names = T5_STACKED_NAMES  # a pipeline layout's (stacked) checkpoint restores too
    batch, length = d["batch"], d["length"]
    encoder_ids = placeholder(mesh, "encoder_ids", [batch, length], dtype=torch.int64)
    prefill_ids = placeholder(mesh, "prefill_ids", [batch, length], dtype=torch.int64)
    step_ids = placeholder(mesh, "step_ids", [batch], dtype=torch.int64)
    position = placeholder(mesh, "position", [], dtype=torch.int32)
    emb = get_variable(mesh, "shared/embedding", [d["vocab"], d["d_model"]])
    enc_out, enc_seq = t5_encode(c, d, emb, encoder_ids)  # once per sequence, in the prefill only
    padding = mask_bias(not_equal(enc_seq, 0))  # [batch, memory_length]: the encoder's padding
    pad_var = get_variable(mesh, "decoder/encoder_padding_bias", padding.shape, initializer=0.0, trainable=False)
    selfs, crosses = Prefill(c.length), Prefill(c.length)
    replay = ReplayVariables()  # the step gets the prefill's decoder variables (their scopes are graph-unique)
    with variable_scope("", custom_getter=replay.record):
        prefill_logits = t5_decode_logits(c, d, prefill_ids, None, _Writes(selfs, [causal_mask(mesh, length)]),
                                          _Writes(crosses, [padding], memory=enc_out))
    step = Step(selfs, position)
    with variable_scope("", custom_getter=replay.replay):
        step_logits = t5_decode_logits(c, d, step_ids, None, _StepSelf(step), _StepCross(crosses, pad_var))
    writes = selfs.assigns + crosses.assigns + [assign(pad_var, padding, name="decoder/encoder_padding_write")]
    more = [v for pair in crosses.caches.pairs for v in pair] + [pad_var]
    names = [v.operation.name for pair in selfs.caches.pairs for v in pair] + [v.operation.name for v in more]
    src = placeholder(mesh, "reorder_src", [Dimension("beam_src", c.batch_size)], dtype=torch.int64)
    return DecoderGraph(c, graph, mesh, prefill_ids, prefill_logits, writes, step_ids, position, step_logits,
                        step.assigns, names, src, reorder_rows(selfs, src, more=more), step.derived, step.refresh,
                        encoder_ids=encoder_ids)

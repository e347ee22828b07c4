"""``mtf.beam_search``: Mesh TF's beam search and greedy decoding (mesh_tensorflow/beam_search.py), on graph ops.

A transcription of Mesh TF 0.1.21's code with torch dtypes: the same algorithm (Wu et al. 2016,
arXiv:1609.08144, length penalty ``((5 + len) / 6) ** alpha``), the same loop state and tie rules,
built from :func:`meshtorch.while_loop`, ``top_k``, ``gather`` and ``one_hot``, so it runs under any
layout. Differences: the TPU-only prefiltering path (``use_tpu`` with ``layout`` and ``mesh_shape``)
is not taken (the exact top-k is used; Mesh TF calls the prefilter "theoretically lossy"), and
``greedy_decode`` does not ``mtf.Print`` the output length.

:func:`decode_loop` (meshtorch's, not Mesh TF's) is the one in-graph autoregressive loop: ``greedy_decode``
and ``mtf.transformer``'s ``sample_autoregressive`` are a choice rule and a stop rule passed to it.
"""

from __future__ import annotations

import torch

from meshtorch.core.dims import Dimension, Shape
from meshtorch.core.graph import Tensor
from meshtorch.ops import activations as act
from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import equal, greater, less, logical_and, logical_or, minimum
from meshtorch.ops.control import while_loop
from meshtorch.ops.einsum import einsum
from meshtorch.ops.indexing import gather, one_hot
from meshtorch.ops.reduce import log_softmax, reduce_min
from meshtorch.ops.reduce_more import reduce_all, reduce_any
from meshtorch.ops.reshape import rename_dimension, replace_dimensions, reshape, transpose
from meshtorch.ops.selection import sample_with_temperature, top_k
from meshtorch.ops.shape import broadcast, concat, where
from meshtorch.ops.variables import constant

__all__ = ["EOS_ID", "INF", "compute_topk_scores_and_seq", "beam_search", "greedy_decode", "decode_loop"]

EOS_ID = 1
INF = 1.0 * 10000000.0


def compute_topk_scores_and_seq(sequences: Tensor, scores: Tensor, scores_to_gather: Tensor, flags: Tensor, beam_dim,
                                prefix="default"):
    """The ``beam_dim.size`` best of ``sequences [batch, old_beam, length]`` by ``scores [batch, old_beam]``.

    Returns ``(topk_seq [batch, beam, length], topk_gathered_scores, topk_flags [batch, beam], selector
    [batch, beam, old_beam] one-hot float32)`` (Mesh TF ``beam_search.compute_topk_scores_and_seq``).
    """
    old_beam_dim = sequences.shape.dims[1]
    _, topk_indices = top_k(scores, old_beam_dim, k_dim=beam_dim)
    selector = one_hot(topk_indices, old_beam_dim, dtype=torch.float32)

    def pick(t):
        return gather(t, topk_indices, old_beam_dim,
                      output_shape=Shape([beam_dim if d == old_beam_dim else d for d in t.shape.dims]))
    return pick(sequences), pick(scores_to_gather), pick(flags), selector


def _penalty(steps, dtype, alpha):
    return act.mtf_pow((ew.cast(steps, dtype) + 5.0) / 6.0, alpha)


def beam_search(logits_fn, initial_ids: Tensor, alpha, states=None, eos_id=EOS_ID, stop_early=True,
                decode_length=None, use_tpu=True, dtype=torch.float32, layout=None, mesh_shape=None,
                num_prefilter=2):
    """Beam search (Mesh TF ``beam_search.beam_search``).

    Args:
        logits_fn: ``logits_fn(step_num, ids, states) -> (logits [batch, beam, vocab], new_states)`` (any
            dim order here; Mesh TF needs this one);
            ``step_num`` an int32 scalar Tensor, ``ids [batch, beam, length]``.
        initial_ids: int32 ``[batch, beam, length]`` (zeros, or a prefix).
        alpha: length-penalty exponent. states: list of Tensors with ``batch`` and ``beam`` dims,
            reordered with the beams. eos_id: end-of-sequence id. stop_early: stop once the best
            finished sequence cannot be beaten. decode_length: optional int32 scalar Tensor (at most
            ``length``). dtype: score dtype. use_tpu, layout, mesh_shape, num_prefilter: accepted; the
            TPU prefilter is not used.

    Returns:
        ``(decoded [batch, beam, length], scores [batch, beam])``: the finished beams (best first) or,
        for a batch entry with none finished, the alive beams and their log probabilities.
    """
    del use_tpu, layout, mesh_shape, num_prefilter
    batch_dim, beam_dim, length_dim = initial_ids.shape.dims
    batch_and_beam_dim = Dimension(batch_dim.name, batch_dim.size * beam_dim.size)
    mesh = initial_ids.mesh
    batch_by_beam = Shape([batch_dim, beam_dim])
    initial_log_probs = broadcast(one_hot(constant(mesh, 0, dtype=torch.int32), beam_dim, on_value=0.0,
                                          off_value=-INF, dtype=dtype), batch_by_beam)
    length_scalar = constant(mesh, length_dim.size, dtype=torch.int32)
    decode_length = length_scalar if decode_length is None else minimum(decode_length, length_scalar)
    finished_scores = constant(mesh, -INF, batch_by_beam, dtype=dtype)
    finished_flags = constant(mesh, False, batch_by_beam, torch.bool)
    states = list(states or [])

    def grow_finished(finished_seq, finished_scores, finished_flags, curr_seq, curr_scores, curr_finished):
        curr_scores = curr_scores + (1.0 - ew.cast(curr_finished, curr_scores.dtype)) * -INF

        def cat(a, b):
            return concat([rename_dimension(a, beam_dim.name, "triple_beam"),
                           rename_dimension(b, "double_beam", "triple_beam")], "triple_beam")
        scores = cat(finished_scores, curr_scores)
        return compute_topk_scores_and_seq(cat(finished_seq, curr_seq), scores, scores,
                                           cat(finished_flags, curr_finished), beam_dim, "grow_finished")

    def grow_alive(curr_seq, curr_scores, curr_log_probs, curr_finished):
        curr_scores = curr_scores + ew.cast(curr_finished, curr_scores.dtype) * -INF
        return compute_topk_scores_and_seq(curr_seq, curr_scores, curr_log_probs, curr_finished, beam_dim,
                                           "grow_alive")

    def grow_topk(i, alive_seq, alive_log_probs, states):
        logits, new_states = logits_fn(i, alive_seq, states)
        vocab_dim = [d for d in logits.shape.dims if d not in (batch_dim, beam_dim)][0]
        logits = transpose(logits, [batch_dim, beam_dim, vocab_dim])  # Mesh TF assumes this order
        log_probs = log_softmax(logits, vocab_dim) + alive_log_probs
        length_penalty = _penalty(i + 1, logits.dtype, alpha)
        curr_scores = log_probs / length_penalty
        double_beam = Dimension("double_beam", beam_dim.size * 2)
        beam_and_vocab = Dimension("beam_and_vocab", beam_dim.size * vocab_dim.size)
        flat = reshape(curr_scores, Shape([batch_dim, beam_and_vocab]), name="flatten_scores")
        top_scores, top_ids = top_k(flat, reduced_dim=beam_and_vocab, k_dim=double_beam)
        top_ids = ew.cast(top_ids, alive_seq.dtype)
        top_beam_index = top_ids // vocab_dim.size
        top_ids = top_ids % vocab_dim.size
        top_log_probs = top_scores * length_penalty
        selector = one_hot(top_beam_index, beam_dim, dtype=torch.float32)
        top_seq = gather(alive_seq, top_beam_index, beam_dim,
                         output_shape=Shape([double_beam if d == beam_dim else d for d in alive_seq.shape.dims]))
        top_seq = top_seq + top_ids * one_hot(i, length_dim, dtype=alive_seq.dtype)
        return top_seq, top_log_probs, top_scores, equal(top_ids, eos_id), new_states, selector

    def inner_loop(i, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags, *states):
        states = [replace_dimensions(s, batch_and_beam_dim, [batch_dim, beam_dim]) for s in states]
        top_seq, top_log_probs, top_scores, top_finished, new_states, first_selector = grow_topk(
            i, alive_seq, alive_log_probs, states)
        alive_seq, alive_log_probs, _, second_selector = grow_alive(top_seq, top_scores, top_log_probs, top_finished)
        finished_seq, finished_scores, finished_flags, _ = grow_finished(
            finished_seq, finished_scores, finished_flags, top_seq, top_scores, top_finished)
        old_beam_dim = Dimension("old_beam", beam_dim.size)
        selector = einsum([rename_dimension(first_selector, beam_dim.name, old_beam_dim.name), second_selector],
                          output_shape=[batch_dim, old_beam_dim, beam_dim])
        gathered = []
        for s in new_states or []:
            s2 = einsum([rename_dimension(s, beam_dim.name, old_beam_dim.name), ew.cast(selector, s.dtype)],
                        output_shape=s.shape)
            gathered.append(replace_dimensions(s2, [batch_dim, beam_dim], batch_and_beam_dim))
        return [i + 1, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags] + gathered

    def is_finished(i, unused_alive_seq, alive_log_probs, unused_finished_seq, finished_scores, finished_in_finished,
                    *unused_states):
        if not stop_early:
            return less(i, decode_length)
        max_penalty = _penalty(decode_length, finished_scores.dtype, alpha)
        lower_bound_alive = gather(alive_log_probs, constant(mesh, 0, dtype=torch.int32), beam_dim) / max_penalty
        lowest_finished = reduce_min(finished_scores * ew.cast(finished_in_finished, finished_scores.dtype),
                                     reduced_dim=beam_dim)
        lowest_finished = lowest_finished + (1.0 - ew.cast(reduce_any(finished_in_finished, reduced_dim=beam_dim),
                                                            finished_scores.dtype)) * -INF
        bound_is_met = reduce_all(greater(lowest_finished, lower_bound_alive))
        return logical_and(less(i, decode_length), act.logical_not(bound_is_met))

    states = [replace_dimensions(s, [batch_dim, beam_dim], batch_and_beam_dim) for s in states]
    inputs = [constant(mesh, 0, dtype=torch.int32), initial_ids, initial_log_probs, initial_ids, finished_scores,
              finished_flags] + states
    _, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags = while_loop(
        is_finished, inner_loop, inputs)[:6]
    any_finished = reduce_any(finished_flags, reduced_dim=beam_dim)
    return where(any_finished, finished_seq, alive_seq), where(any_finished, finished_scores, alive_log_probs)


def greedy_decode(logits_fn, initial_ids: Tensor, temperature=0.0, initial_states=None, eos_id=EOS_ID,
                  forced_ids=None, use_tpu=True) -> Tensor:
    """Sample (``temperature`` 0: argmax) one position per step until every sequence has an ``eos_id`` or
    ``length`` is reached (Mesh TF ``beam_search.greedy_decode``).

    Args:
        logits_fn: ``logits_fn(step_num, ids, states) -> (logits [..., vocab], new_states)``.
        initial_ids: int32 ``[..., length]`` of zeros. forced_ids: optional ``[..., length]``; nonzero
            entries are used instead of the samples.

    Returns:
        int32 ``[..., length]``.
    """
    del use_tpu
    length_dim = initial_ids.shape.dims[-1]
    mesh = initial_ids.mesh
    num_steps = constant(mesh, length_dim.size, dtype=torch.int32)

    def done_fn(step_num, ids):
        return logical_or(equal(step_num, num_steps), reduce_any(equal(ids, eos_id), reduced_dim=length_dim))

    def choose_fn(step_num, ids, logits):
        new_ids = ew.cast(sample_with_temperature(logits, logits.shape.dims[-1], temperature), ids.dtype)
        if forced_ids is not None:
            forced = gather(forced_ids, step_num, length_dim)
            new_ids = forced + new_ids * act.to_int32(equal(forced, 0))
        return new_ids

    return decode_loop(logits_fn, initial_ids, constant(mesh, 0, dtype=torch.int32), choose_fn, done_fn,
                       initial_states)


def decode_loop(logits_fn, ids: Tensor, position: Tensor, choose_fn, done_fn, states=None) -> Tensor:
    """The autoregressive loop of meshtorch's in-graph decoders (:func:`greedy_decode` and
    ``mtf.transformer``'s ``Unitransformer.sample_autoregressive``): one ``while_loop`` that, until every
    sequence is done, computes the logits at ``position``, chooses a token and writes it there (a one-hot
    add, so ``ids`` must hold zeros at the positions written), then advances ``position``.

    Args:
        logits_fn: ``logits_fn(position, ids, states) -> (logits [..., vocab], new_states)`` (``states``
            a tuple of the loop's state Tensors, e.g. attention key/value caches).
        ids: integer ``[batch..., length]``.
        position: int32 ``[]`` or ``[batch...]``: the position written at the first step.
        choose_fn: ``choose_fn(position, ids, logits) -> [batch...]`` token ids in ``ids``' dtype.
        done_fn: ``done_fn(position, ids) -> bool [] or [batch...]``; the loop runs while not all are done.
        states: initial state Tensors (None: none).

    Returns:
        the final ``ids``.
    """
    length_dim = ids.shape.dims[-1]

    def cond_fn(position, ids, *unused_states):
        return act.logical_not(reduce_all(done_fn(position, ids)))

    def body_fn(position, ids, *states):
        logits, new_states = logits_fn(position, ids, states)
        ids = ids + choose_fn(position, ids, logits) * one_hot(position, length_dim, dtype=ids.dtype)
        return [position + 1, ids] + list(new_states or [])

    return while_loop(cond_fn, body_fn, [position, ids] + list(states or []))[1]

"""Beam search with length penalty, as Mesh TF's ``mesh_tensorflow/beam_search.py`` ``beam_search`` (non-TPU path).

Used by ``Unitransformer.beam_search`` and ``Bitransformer.decode(beam_size > 1)``. The algorithm
(Wu et al. 2016, GNMT, section 7; Mesh TF after tensor2tensor): each step grows the ``beam`` alive
sequences to their ``2 * beam`` best one-token extensions, scored ``log_prob / ((5 + len) / 6)^alpha``;
the best ``beam`` extensions that did not just produce ``eos_id`` stay alive, the best ``beam`` among
the finished so far plus those that did become the finished set; with ``stop_early`` the loop ends
once no alive sequence can beat the worst finished one. Decoding states (attention keys and values)
follow their beams through a one-hot selector einsum.

Differences from Mesh TF: the states keep their ``[batch, beam]`` dims in the loop (Mesh TF folds
them into one dim for TPU while-loops; the values are the same), and ``use_tpu`` / ``layout`` /
``mesh_shape`` / ``num_prefilter`` (TPU top-k shortcuts) are accepted and ignored.
"""

from __future__ import annotations

import torch

from meshtorch.transformer import _mtf as mtf

INF = 1.0 * 1e7
EOS_ID = 1


def _pow(x, alpha: float):
    return mtf.exp(mtf.log(x) * float(alpha))


def _floordiv_mod(x, divisor: int):
    """``(x // divisor, x % divisor)`` for integer ``x >= 0`` (exact below 2**52)."""
    q = mtf.cast(mtf.cast(mtf.cast(x, torch.float64) * (1.0 / divisor) + 1e-9, torch.int64), x.dtype)
    return q, x - q * divisor


def _reduce_any(x, reduced_dim):
    return mtf.greater(mtf.reduce_max(mtf.to_int32(x), reduced_dim=reduced_dim), 0)


def compute_topk_scores_and_seq(sequences, scores, scores_to_gather, flags, beam_dim, prefix="default"):
    """The ``beam_dim.size`` best of ``sequences`` by ``scores`` (Mesh TF ``compute_topk_scores_and_seq``).

    Returns:
        ``(topk_seq, topk_gathered_scores, topk_flags, selector)``; selector is the one-hot of the
        chosen old beams ``[batch, beam, old_beam]``.
    """
    del prefix
    old_beam_dim = sequences.shape.dims[1]
    _, topk_indices = mtf.top_k(scores, old_beam_dim, k_dim=beam_dim)
    selector = mtf.one_hot(topk_indices, old_beam_dim, dtype=torch.float32)

    def gather(tensor):
        shape = mtf.Shape([beam_dim if d == old_beam_dim else d for d in tensor.shape.dims])
        return mtf.gather(tensor, topk_indices, old_beam_dim, output_shape=shape)

    return gather(sequences), gather(scores_to_gather), gather(flags), selector


def beam_search(logits_fn, initial_ids, alpha, states=None, eos_id=EOS_ID, stop_early=True, decode_length=None,
                use_tpu=True, dtype=torch.float32, layout=None, mesh_shape=None, num_prefilter=2):
    """Beam search (Mesh TF ``mtf.beam_search.beam_search``; same arguments).

    Args:
        logits_fn: ``(step_num scalar, ids [batch, beam, length], states) -> (logits [batch, beam, vocab],
            new_states)``.
        initial_ids: integer ``[batch, beam, length]`` (zeros).
        alpha: length-penalty exponent.
        states: list of Tensors with ``[batch, beam]`` dims, reordered with their beams.
        eos_id: end-of-sequence id; stop_early: stop once the best sequence is determined.
        decode_length: optional integer scalar Tensor (capped at the length dim).

    Returns:
        ``(sequences [batch, beam, length], scores [batch, beam])``, best first.
    """
    del use_tpu, layout, mesh_shape, num_prefilter
    batch_dim, beam_dim, length_dim = initial_ids.shape.dims
    mesh = initial_ids.mesh
    ids_dtype = initial_ids.dtype
    batch_by_beam = mtf.Shape([batch_dim, beam_dim])
    first_beam = mtf.one_hot(mtf.constant(mesh, 0, [], torch.int32), beam_dim, on_value=0.0, off_value=-INF,
                             dtype=dtype)
    initial_log_probs = mtf.broadcast(first_beam, batch_by_beam)
    length_scalar = mtf.constant(mesh, length_dim.size, [], torch.int32)
    decode_length = length_scalar if decode_length is None else mtf.minimum(mtf.to_int32(decode_length),
                                                                            length_scalar)
    finished_scores = mtf.constant(mesh, -INF, batch_by_beam, dtype)
    finished_flags = mtf.cast(mtf.zeros(mesh, batch_by_beam, torch.int32), torch.bool)
    double_beam = mtf.Dimension("double_beam", beam_dim.size * 2)

    def grow_finished(finished_seq, finished_scores, finished_flags, curr_seq, curr_scores, curr_finished):
        curr_scores = curr_scores + (1.0 - mtf.cast(curr_finished, curr_scores.dtype)) * -INF

        def concat(a, b):
            a = mtf.rename_dimension(a, beam_dim.name, "triple_beam")
            b = mtf.rename_dimension(b, double_beam.name, "triple_beam")
            return mtf.concat([a, b], "triple_beam")
        scores = concat(finished_scores, curr_scores)
        return compute_topk_scores_and_seq(concat(finished_seq, curr_seq), scores, scores,
                                           concat(finished_flags, curr_finished), beam_dim, "grow_finished")

    def grow_alive(curr_seq, curr_scores, curr_log_probs, curr_finished):
        curr_scores = curr_scores + mtf.cast(curr_finished, curr_scores.dtype) * -INF
        return compute_topk_scores_and_seq(curr_seq, curr_scores, curr_log_probs, curr_finished, beam_dim,
                                           "grow_alive")

    def grow_topk(i, alive_seq, alive_log_probs, states):
        logits, new_states = logits_fn(i, alive_seq, states)
        vocab_dim = logits.shape.dims[-1]
        log_probs = mtf.log_softmax(logits, vocab_dim) + alive_log_probs
        length_penalty = _pow((mtf.cast(i + 1, logits.dtype) + 5.0) / 6.0, alpha)
        curr_scores = log_probs / length_penalty
        beam_and_vocab = mtf.Dimension("beam_and_vocab", beam_dim.size * vocab_dim.size)
        flat = mtf.reshape(mtf.transpose(curr_scores, [batch_dim, beam_dim, vocab_dim]), [batch_dim, beam_and_vocab])
        top_scores, top_flat = mtf.top_k(flat, beam_and_vocab, k_dim=double_beam)
        top_beam_index, top_ids = _floordiv_mod(top_flat, vocab_dim.size)
        top_log_probs = top_scores * length_penalty
        selector = mtf.one_hot(top_beam_index, beam_dim, dtype=torch.float32)
        top_seq = mtf.gather(alive_seq, top_beam_index, beam_dim,
                             output_shape=mtf.Shape([double_beam if d == beam_dim else d for d in alive_seq.shape]))
        top_seq += mtf.cast(top_ids, ids_dtype) * mtf.one_hot(i, length_dim, dtype=ids_dtype)
        top_finished = mtf.equal(top_ids, eos_id)
        return top_seq, top_log_probs, top_scores, top_finished, new_states, selector

    def inner_loop(i, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags, *states):
        top2k_seq, top2k_log_probs, top2k_scores, top2k_finished, new_states, first_selector = grow_topk(
            i, alive_seq, alive_log_probs, list(states))
        alive_seq, alive_log_probs, _, second_selector = grow_alive(top2k_seq, top2k_scores, top2k_log_probs,
                                                                    top2k_finished)
        finished_seq, finished_scores, finished_flags, _ = grow_finished(
            finished_seq, finished_scores, finished_flags, top2k_seq, top2k_scores, top2k_finished)
        old_beam = mtf.Dimension("old_beam", beam_dim.size)
        selector = mtf.einsum([mtf.rename_dimension(first_selector, beam_dim.name, old_beam.name), second_selector],
                              output_shape=[batch_dim, old_beam, beam_dim])
        gathered = [mtf.einsum([mtf.rename_dimension(s, beam_dim.name, old_beam.name), mtf.cast(selector, s.dtype)],
                               output_shape=s.shape) for s in new_states]
        return [i + 1, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags] + gathered

    def is_not_finished(i, unused_alive_seq, alive_log_probs, unused_finished_seq, finished_scores,
                        finished_in_finished, *unused_states):
        if not stop_early:
            return mtf.less(i, decode_length)
        max_length_penalty = _pow((mtf.cast(decode_length, finished_scores.dtype) + 5.0) / 6.0, alpha)
        lower_bound_alive_scores = mtf.gather(alive_log_probs, mtf.constant(mesh, 0, [], torch.int32),
                                              beam_dim) / max_length_penalty
        lowest_finished = mtf.reduce_min(finished_scores * mtf.cast(finished_in_finished, finished_scores.dtype),
                                         reduced_dim=beam_dim)
        lowest_finished += (1.0 - mtf.cast(_reduce_any(finished_in_finished, beam_dim), finished_scores.dtype)) * -INF
        bound_is_met = mtf.reduce_all(mtf.greater(lowest_finished, lower_bound_alive_scores))
        return mtf.logical_and(mtf.less(i, decode_length), mtf.logical_not(bound_is_met))

    inputs = [mtf.constant(mesh, 0, [], torch.int32), initial_ids, initial_log_probs, initial_ids, finished_scores,
              finished_flags] + list(states or [])
    _, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags = mtf.while_loop(
        is_not_finished, inner_loop, inputs)[:6]
    any_finished = _reduce_any(finished_flags, beam_dim)
    return (mtf.where(any_finished, finished_seq, alive_seq),
            mtf.where(any_finished, finished_scores, alive_log_probs))

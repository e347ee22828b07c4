"""Autoregressive sampling for ``Unitransformer.sample_autoregressive`` (Mesh TF ``transformer.py``).

Mesh TF's algorithm, on meshtorch's one in-graph decoding loop (:func:`meshtorch.beam_search.decode_loop`,
which ``mtf.beam_search.greedy_decode`` runs too): one ``"first_part"`` call over the
(shifted) partial sequences records each self-attention layer's keys and values as loop states and
each encoder-decoder attention's keys and values as constant states; then each loop iteration runs
the model in ``"incremental"`` mode on one position per sequence (the states are updated by a
one-hot write at that position), picks the next token (argmax, or Gumbel-max sampling with a
temperature, optionally among the top k logits) and writes it. The loop ends when every sequence
has reached the end of ``length``, ``max_steps`` new tokens, or produced another ``stop_at_token``.

Difference from Mesh TF: the Gumbel noise for temperature sampling is drawn once per run for every
``[batch..., length, vocab]`` position outside the loop and read at each step's position
(meshtorch's random ops inside a loop body would repeat their values every iteration); the
distribution is the same.

The model's forward comes in as a function (``call``: the Unitransformer passes its own
``_call_internal``), so this module never reaches into a model's private methods.
"""

from __future__ import annotations

import torch

from meshtorch import beam_search as beam_search_lib
from meshtorch.transformer import _mtf as mtf
from meshtorch.transformer._context import Context
from meshtorch.transformer._sequences import autoregressive_inputs


def sample_autoregressive(model, call, partial_sequences, stop_at_token=1, max_steps=None, temperature=0.0,
                          variable_dtype=None, encoder_output=None, encoder_sequence_id=None, encoder_inputs=None,
                          shared_params=None, has_partial_sequences=True, encoder_layer_outputs=None,
                          never_end=False, remove_partial_sequences=False, sampling_keep_top_k=-1, bos_id=0):
    """See :meth:`meshtorch.transformer.transformer.Unitransformer.sample_autoregressive`; ``call(context, inputs)``
    is the model's forward (the Unitransformer passes its ``_call_internal``)."""
    if not model.autoregressive:
        raise ValueError("must be autoregressive")
    if remove_partial_sequences and has_partial_sequences:
        raise NotImplementedError("sample_autoregressive: remove_partial_sequences needs mtf.dynamic_shift, which "
                                  "meshtorch does not have yet; strip the prompt on the host.")
    if sampling_keep_top_k != -1 and sampling_keep_top_k <= 0:
        raise ValueError("sampling_keep_top_k must either be -1 or positive.")
    variable_dtype = variable_dtype or mtf.VariableDType(torch.float32)
    inputs = partial_sequences
    ids_dtype = inputs.dtype
    mesh = inputs.mesh
    batch_dims = list(inputs.shape.dims[:-1])
    length_dim = inputs.shape.dims[-1]
    vocab_dim = model.output_vocab_dim
    initial_position = mtf.reduce_sum(mtf.to_int32(mtf.not_equal(inputs, 0)), reduced_dim=length_dim)
    sequence_id = 1 if encoder_sequence_id is not None else None
    length_range = mtf.range(mesh, length_dim, torch.int32)
    if model.input_full_attention:
        read_priority = write_priority = length_range * mtf.to_int32(mtf.greater(length_range, initial_position))
    else:
        read_priority = write_priority = length_range

    passes = _Passes(model, call, batch_dims, length_dim, variable_dtype, write_priority, bos_id,
                     dict(sequence_id=sequence_id, encoder_output=encoder_output,
                          encoder_sequence_id=encoder_sequence_id, shared_params=shared_params,
                          encoder_layer_outputs=encoder_layer_outputs, encoder_inputs=encoder_inputs))
    first = passes.first_part(inputs, length_range, initial_position, read_priority)
    constant_states = first.constant_states
    if not has_partial_sequences:
        initial_states = [mtf.zeros_like(t) for t in first.new_states]
        eos_before = None
    else:
        initial_states = first.new_states
        eos_before = (mtf.reduce_sum(mtf.to_int32(mtf.equal(partial_sequences, stop_at_token)), reduced_dim=length_dim)
                      if stop_at_token is not None else None)
    gumbel = None
    if temperature != 0.0:
        u = mtf.random_uniform(mesh, mtf.Shape(batch_dims + [length_dim, vocab_dim]), minval=1e-9, maxval=1.0,
                               dtype=torch.float32)
        gumbel = mtf.negative(mtf.log(mtf.negative(mtf.log(u))))

    def done_fn(position, ids):
        is_done = mtf.greater_equal(position, length_dim.size)
        if max_steps:
            is_done = mtf.logical_or(is_done, mtf.greater_equal(position - initial_position, max_steps))
        if stop_at_token is not None:
            eos_count = mtf.reduce_sum(mtf.to_int32(mtf.equal(ids, stop_at_token)), reduced_dim=length_dim)
            extra = mtf.greater(eos_count, eos_before) if eos_before is not None else mtf.greater(eos_count, 0)
            is_done = mtf.logical_or(is_done, extra)
        return is_done

    def logits_fn(position, ids, states):
        logits, new_states = passes.step(position, ids, states, constant_states)
        if never_end:
            logits += mtf.one_hot(mtf.constant(mesh, stop_at_token, [], torch.int32), vocab_dim,
                                  on_value=-1e9, off_value=0.0, dtype=logits.dtype)
        return logits, new_states

    def choose_fn(position, ids, logits):
        if sampling_keep_top_k != -1:
            k_largest = mtf.nth_largest_element(logits, sampling_keep_top_k, vocab_dim)
            logits = mtf.where(mtf.less_equal(logits, k_largest), mtf.ones_like(logits) * -1e6, logits)
        if gumbel is not None:
            here = mtf.one_hot(position, length_dim, dtype=gumbel.dtype)
            logits = logits + mtf.reduce_sum(gumbel * here, reduced_dim=length_dim) * float(temperature)
        return mtf.cast(mtf.argmax(logits, vocab_dim), ids_dtype)

    return beam_search_lib.decode_loop(logits_fn, inputs, initial_position, choose_fn, done_fn, initial_states)


def beam_search(model, call, inputs, decode_length, variable_dtype=None, encoder_output=None, encoder_sequence_id=None,
                encoder_inputs=None, alpha=0.6, shared_params=None, encoder_layer_outputs=None, bos_id=0):
    """See :meth:`meshtorch.transformer.transformer.Unitransformer.beam_search`; ``call`` as in
    :func:`sample_autoregressive`."""
    if not model.autoregressive:
        raise ValueError("must be autoregressive")
    batch_dims = list(inputs.shape.dims[:-2])
    if len(batch_dims) != 1:
        raise NotImplementedError("beam search supports exactly one batch dimension.")
    if model.input_full_attention:
        raise NotImplementedError("Beam search for language models not yet implemented")
    variable_dtype = variable_dtype or mtf.VariableDType(torch.float32)
    mesh = inputs.mesh
    beam_dim, length_dim = inputs.shape.dims[-2], inputs.shape.dims[-1]
    length_range = mtf.range(mesh, length_dim, torch.int32)
    sequence_id = 1 if encoder_sequence_id is not None else None

    passes = _Passes(model, call, batch_dims + [beam_dim], length_dim, variable_dtype, length_range, bos_id,
                     dict(sequence_id=sequence_id, encoder_output=encoder_output,
                          encoder_sequence_id=encoder_sequence_id, shared_params=shared_params,
                          encoder_layer_outputs=encoder_layer_outputs, encoder_inputs=encoder_inputs))
    initial_position = mtf.reduce_sum(mtf.to_int32(mtf.not_equal(inputs, 0)), reduced_dim=length_dim)
    first = passes.first_part(inputs, length_range, initial_position, length_range)
    initial_states = [mtf.zeros_like(t) for t in first.new_states]  # no partial targets
    constant_states = first.constant_states

    def logits_fn(step_num, ids, states):
        logits, new_states = passes.step(step_num, ids, states, constant_states)
        return mtf.cast(logits, torch.float32), new_states

    beams, _ = beam_search_lib.beam_search(logits_fn, inputs, alpha, states=initial_states,
                                           decode_length=decode_length, dtype=torch.float32,
                                           mesh_shape=model.mesh_shape, layout=model.layout)
    return mtf.gather(beams, mtf.constant(mesh, 0, [], torch.int32), beam_dim)


class _Passes:
    """The model's passes when decoding (Mesh TF's ``sample_autoregressive`` / ``beam_search`` closures): one
    ``"first_part"`` pass over the given tokens, then ``"incremental"`` steps of one position each."""

    def __init__(self, model, call, batch_dims, length_dim, variable_dtype, write_priority, bos_id, extra: dict):
        self.model, self.call, self.length_dim, self.bos_id = model, call, length_dim, bos_id
        self.common = dict(model=model, batch_dims=batch_dims, length_dim=length_dim, variable_dtype=variable_dtype,
                           write_priority=write_priority, **extra)

    def _context(self, mode, mesh, **kw) -> Context:
        return Context(mesh=mesh, mode=mode, new_states=[], **self.common, **kw)  # a fresh list per pass

    def first_part(self, inputs, position, initial_position, read_priority) -> Context:
        """Run the model over ``autoregressive_inputs(inputs)``; the context holds the recorded states."""
        first = self._context("first_part", inputs.mesh, position=position, position_is_default=True,
                              initial_position=initial_position, constant_states=[], read_priority=read_priority,
                              inputs=inputs)
        with mtf.variable_scope(self.model.name):
            self.call(first, autoregressive_inputs(inputs))
        return first

    def step(self, position, ids, states, constant_states):
        """``(logits, new_states)`` of the token at ``position - 1`` (``bos_id`` at position 0)."""
        inputs_this_step = mtf.gather(ids, position - 1, self.length_dim)
        if self.bos_id:
            inputs_this_step += mtf.cast(mtf.equal(position, 0), ids.dtype) * self.bos_id
        inc = self._context("incremental", ids.mesh, position=position, states=states,
                            constant_states=constant_states, read_priority=position, inputs=inputs_this_step)
        with mtf.variable_scope(self.model.name, reuse=True):
            logits = self.call(inc, inputs_this_step)
        return logits, inc.new_states

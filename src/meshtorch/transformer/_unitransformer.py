"""``Unitransformer`` and ``autoregressive_inputs`` (Mesh TF ``transformer/transformer.py``).

Dimension names: ``batch`` (or the caller's batch dims), ``length``, ``memory_length``,
``d_model``, ``heads`` (combined ``heads x d_kv`` in the variables), ``d_kv``, ``d_ff``, ``vocab``,
``max_length``; ``ensemble`` with ensembles. Mesh TF's ``layouts/*.gin`` name the same dims, so
its layouts apply as layout strings (``docs/transformer.md``).
"""

from __future__ import annotations

import math

import torch

from meshtorch.transformer import _mtf as mtf
from meshtorch.transformer._context import TRAIN, Context, check_mode
from meshtorch.transformer._decoding import beam_search as _beam_search
from meshtorch.transformer._decoding import sample_autoregressive as _sample_autoregressive
from meshtorch.transformer._dense import dense
from meshtorch.transformer._sequences import _round_up_to_multiple, delimited_lm_inputs_mask
from meshtorch.transformer.vocab_embeddings import get_vocab_embedding_cls


def sinusoid_positional_embedding_weights(mesh, max_length_dim, model_dim, dtype, min_timescale=1.0,
                                          max_timescale=1.0e4):
    """Sinusoids ``[max_length, d_model]``: sin then cos halves (Mesh TF, after tensor2tensor's timing signal).

    Computed once in torch and imported as a constant.

    Raises:
        ValueError: if ``model_dim`` is odd.
    """
    if model_dim.size % 2:
        raise ValueError("model_dim must be divisible by 2")
    num_timescales = model_dim.size // 2
    log_inc = math.log(float(max_timescale) / float(min_timescale)) / max(float(num_timescales) - 1, 1)
    inv = min_timescale * torch.exp(torch.arange(num_timescales, dtype=torch.float32) * -log_inc)
    scaled = torch.arange(max_length_dim.size, dtype=torch.float32)[:, None] * inv[None, :]
    table = torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1).to(dtype)
    return mtf.import_tensor(mesh, table, [max_length_dim, model_dim], name="sinusoid_positional_embedding")


def reduce_ensemble_logits(logits, ensemble_dim, vocab_dim):
    """Mean probability over the ensemble, as log-probabilities (Mesh TF's default reduce_fn)."""
    probs = mtf.reduce_mean(mtf.softmax(logits, vocab_dim), reduced_dim=ensemble_dim)
    return mtf.log(mtf.maximum(probs, 1e-20))


class Unitransformer:
    """A Transformer with one layer stack, e.g. a language model (Mesh TF ``transformer.Unitransformer``).

    Same constructor arguments and defaults as Mesh TF 0.1.21, without gin: ``input_vocab_size``,
    ``output_vocab_size``, ``autoregressive`` and ``max_length`` are required (``gin.REQUIRED``
    there). Vocabularies are padded to a multiple of ``vocab_divisor`` (128).

    Variables (inside ``variable_scope(name)``, default ``transformer``): ``embedding``
    ``[vocab, d_model]`` (unless shared through ``shared_params``), ``positional_embedding``
    ``[max_length, d_model]`` (with ``positional_embedding=True``), the layer stack's, and
    ``logits/kernel`` ``[d_model, vocab]`` unless ``shared_embedding_and_softmax_weights``.

    Loss (``call_simple(..., compute_loss=True)``): softmax cross-entropy against ``one_hot(targets)``
    (label-smoothed), plus ``z_loss * logsumexp^2`` in ``"train"`` mode only, weighted by
    ``targets > 0``, summed and divided by :meth:`loss_denominator` (the number of target tokens,
    padding included, times ``num_microbatches``; or ``loss_denominator``).

    Raises:
        ValueError: autoregressive without an output vocabulary; ``input_full_attention`` without
            ``autoregressive``.
        NotImplementedError: ``loss_fn`` / ``token_dropout_rate`` (not ported).
    """

    def __init__(self, layer_stack, d_model=1024, input_vocab_size=None, output_vocab_size=None, autoregressive=None,
                 max_length=None, shared_embedding_and_softmax_weights=False, label_smoothing=0.0, z_loss=1e-4,
                 name="transformer", layout=None, mesh_shape=None, vocab_divisor=128, ensemble=None, loss_fn=None,
                 positional_embedding=True, sinusoid_positional_embedding=False, input_full_attention=False,
                 loss_on_targets_only=False, loss_denominator=None, token_dropout_rate=0.0):
        for arg, val in (("input_vocab_size", input_vocab_size), ("autoregressive", autoregressive)):
            if val is None:
                raise ValueError(f"Unitransformer: {arg} is required (gin.REQUIRED in Mesh TF).")
        if max_length is None and (positional_embedding or sinusoid_positional_embedding):
            raise ValueError("Unitransformer: max_length is required with positional embeddings.")
        if token_dropout_rate:
            raise NotImplementedError("Unitransformer: token_dropout_rate is not ported (dropout of integer ids).")
        self.layer_stack = layer_stack
        self.model_dim = mtf.Dimension("d_model", d_model)
        self.input_vocab_size_unpadded = input_vocab_size
        self.input_vocab_dim = mtf.Dimension("vocab", _round_up_to_multiple(input_vocab_size, vocab_divisor))
        self.output_vocab_size_unpadded = output_vocab_size
        if output_vocab_size:
            self.output_vocab_dim = mtf.Dimension("vocab", _round_up_to_multiple(output_vocab_size, vocab_divisor))
        else:
            self.output_vocab_dim = None
            if autoregressive:
                raise ValueError("autoregressive Transformer needs output vocabulary")
        self.autoregressive = autoregressive
        if sinusoid_positional_embedding:
            positional_embedding = True
        self.max_length_dim = mtf.Dimension("max_length", max_length) if positional_embedding else None
        self.shared_embedding_and_softmax_weights = shared_embedding_and_softmax_weights
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.name = name
        self.layout = layout
        self.mesh_shape = mesh_shape
        self.ensemble_dim = mtf.Dimension("ensemble", ensemble) if ensemble else None
        self._loss_fn = loss_fn
        self.positional_embedding = positional_embedding
        self.sinusoid_positional_embedding = sinusoid_positional_embedding
        self.input_full_attention = input_full_attention
        self.loss_on_targets_only = loss_on_targets_only
        self._loss_denominator = loss_denominator
        if self.input_full_attention and not self.autoregressive:
            raise ValueError("input_full_attention only makes sense with autoregressive")
        self.token_dropout_rate = token_dropout_rate

    @property
    def fully_autoregressive(self):
        return self.autoregressive and not self.input_full_attention

    @property
    def ensemble_dims(self):
        return [self.ensemble_dim] if self.ensemble_dim else []

    def _compute_loss(self, context, logits, targets, output_vocab_dim):
        """Mean (see :meth:`loss_denominator`) weighted cross-entropy; z-loss only in training."""
        if self._loss_fn:
            return self._loss_fn(self, context, logits, targets, output_vocab_dim)
        off_value = self.label_smoothing / output_vocab_dim.size
        on_value = 1.0 - self.label_smoothing + off_value
        soft_targets = mtf.one_hot(mtf.maximum(targets, 0), output_vocab_dim, dtype=context.activation_dtype,
                                   on_value=on_value, off_value=off_value)
        loss = mtf.layers.softmax_cross_entropy_with_logits(logits, soft_targets, output_vocab_dim,
                                                            z_loss=self.z_loss if context.train else 0.0)
        weights = mtf.cast(mtf.greater(targets, 0), context.activation_dtype)
        if self.loss_on_targets_only:
            weights *= mtf.cast(mtf.logical_not(delimited_lm_inputs_mask(targets)), context.activation_dtype)
        return mtf.reduce_sum(loss * weights) / self.loss_denominator(targets, context.num_microbatches)

    def _call_internal(self, context, inputs, targets=None):
        """Logits ``[batch..., length, vocab]`` (or the stack's output without an output vocab)."""
        mesh = inputs.mesh
        if self.ensemble_dim and self.ensemble_dim not in inputs.shape.dims:
            inputs = mtf.broadcast(inputs, [self.ensemble_dim] + list(inputs.shape.dims))
            if targets is not None:
                targets = mtf.broadcast(targets, [self.ensemble_dim] + list(targets.shape.dims))
        if "embedding" in context.shared_params:
            vocab_embedding = context.shared_params["embedding"]
        else:
            vocab_embedding = get_vocab_embedding_cls()(mesh, self.input_vocab_dim, self.model_dim,
                                                        context.variable_dtype, name="embedding",
                                                        ensemble_dim=self.ensemble_dim)
        x = vocab_embedding.ids_to_embedding(inputs, context)
        context.input_embeddings = x
        if self.positional_embedding or self.sinusoid_positional_embedding:
            if self.sinusoid_positional_embedding:
                pos_emb_var = sinusoid_positional_embedding_weights(mesh, self.max_length_dim, self.model_dim,
                                                                    context.variable_dtype.activation_dtype)
            elif "positional_embedding" in context.shared_params:
                pos_emb_var = context.shared_params["positional_embedding"]
            else:
                pos_emb_var = mtf.layers.embedding_weights(mesh, self.max_length_dim, self.model_dim,
                                                           context.variable_dtype, "positional_embedding",
                                                           ensemble_dim=self.ensemble_dim)
            if (context.length_dim is not None and context.length_dim.size > self.max_length_dim.size
                    and context.position_is_default):
                raise ValueError("Length dimenison exceeds size of positional embedding table. "
                                 f"length_dim.size > max_length_dim.size {context.length_dim} vs "
                                 f"{self.max_length_dim}.")
            if context.position_is_default:
                pos_emb = mtf.rename_dimension(
                    mtf.slice(pos_emb_var, 0, context.length_dim.size, self.max_length_dim.name),
                    self.max_length_dim.name, context.length_dim.name)
            else:
                # Mesh TF passes output_shape=x.shape; the sum below broadcasts (a scalar position when beam searching)
                pos_emb = mtf.gather(pos_emb_var, context.position, self.max_length_dim)
            x += pos_emb
        x = self.layer_stack.call(context, x)
        if self.output_vocab_dim is None:
            return x
        if self.shared_embedding_and_softmax_weights:
            logits = vocab_embedding.hidden_to_logits(x, context)
        else:
            logits = dense(x, self.output_vocab_dim, use_bias=False, variable_dtype=context.variable_dtype,
                           reduced_dims=x.shape.dims[-1:], name="logits")
        if targets is not None and context.losses is not None:
            context.losses.append(self._compute_loss(context, logits, targets, self.output_vocab_dim))
        if self.ensemble_dim:
            logits = reduce_ensemble_logits(logits, self.ensemble_dim, self.output_vocab_dim)
        return logits

    def loss_denominator(self, targets, num_microbatches):
        """``loss_denominator`` if given, else ``targets.shape.size * num_microbatches / ensemble`` (a float)."""
        if self._loss_denominator is not None:
            return float(self._loss_denominator)
        ret = float(targets.shape.size) * num_microbatches
        if self.ensemble_dim:
            ret /= self.ensemble_dim.size
        return float(ret)

    def call_simple(self, inputs, targets, compute_loss, mode=TRAIN, variable_dtype=None, sequence_id=None,
                    subsequence_id=None, position=None, encoder_output=None, encoder_sequence_id=None,
                    encoder_inputs=None, shared_params=None, layer_outputs=None, encoder_layer_outputs=None,
                    num_microbatches=1):
        """Logits for all positions in parallel, and the loss (Mesh TF ``Unitransformer.call_simple``).

        Args:
            inputs: integer ``[batch..., length]``; for an autoregressive LM
                ``autoregressive_inputs(targets)``.
            targets: optional integer ``[batch..., length]`` (0 = padding, no loss).
            compute_loss: also return the loss.
            mode: ``"train"``, ``"eval"`` or ``"infer"``.
            variable_dtype: a ``mtf.VariableDType`` (default float32 everywhere).
            sequence_id / subsequence_id / position / encoder_*: as Mesh TF (packing, enc-dec).

        Returns:
            ``(logits [batch..., length, vocab], loss scalar or None)``.

        Raises:
            ValueError: for an unknown mode.
        """
        check_mode(mode)
        variable_dtype = variable_dtype or mtf.VariableDType(torch.float32)
        batch_dims = list(inputs.shape.dims[:-1])
        length_dim = inputs.shape.dims[-1]
        length_range = mtf.range(inputs.mesh, length_dim, dtype=torch.int32)
        if not self.positional_embedding:
            position = None
        if position is None:
            position_is_default = True
            position = length_range
        else:
            position_is_default = False
        if self.input_full_attention:
            region = delimited_lm_inputs_mask(targets)
            region = mtf.logical_or(region, mtf.shift(region, offset=1, dim=length_dim, wrap=False))
            read_priority = write_priority = length_range * mtf.to_int32(mtf.logical_not(region))
        elif self.autoregressive:
            read_priority = write_priority = length_range
        else:
            read_priority = write_priority = None
        context = Context(model=self, mesh=inputs.mesh, batch_dims=batch_dims, length_dim=length_dim,
                          variable_dtype=variable_dtype, mode=mode, losses=[] if compute_loss else None,
                          sequence_id=sequence_id, subsequence_id=subsequence_id, position=position,
                          position_is_default=position_is_default, encoder_output=encoder_output,
                          encoder_sequence_id=encoder_sequence_id, shared_params=shared_params,
                          layer_outputs=layer_outputs, encoder_layer_outputs=encoder_layer_outputs,
                          write_priority=write_priority, read_priority=read_priority, inputs=inputs,
                          encoder_inputs=encoder_inputs, num_microbatches=num_microbatches)
        with mtf.variable_scope(self.name):
            logits = self._call_internal(context, inputs, targets)
        loss = None
        if compute_loss:  # Mesh TF's add_n of no losses is 0 (e.g. an encoder without targets)
            loss = mtf.add_n(context.losses) if context.losses else 0
        return logits, loss

    def sample_autoregressive(self, partial_sequences, stop_at_token=1, max_steps=None, temperature=0.0,
                              variable_dtype=None, encoder_output=None, encoder_sequence_id=None, encoder_inputs=None,
                              shared_params=None, has_partial_sequences=True, encoder_layer_outputs=None,
                              never_end=False, remove_partial_sequences=False, sampling_keep_top_k=-1, bos_id=0):
        """Continue the partial sequences one token at a time (Mesh TF ``Unitransformer.sample_autoregressive``).

        An ``mtf.while_loop`` over positions with the attention keys and values as loop states
        (``"first_part"`` then ``"incremental"`` mode; :mod:`meshtorch.transformer._decoding`).

        Args:
            partial_sequences: integer ``[batch..., length]``: the given tokens first, zeros after
                (``has_partial_sequences=False`` with all zeros to sample from scratch).
            stop_at_token: end a sequence when it produces this id (None: never).
            max_steps: optional limit of new tokens.
            temperature: 0 = argmax; 1 = sample the model's distribution.
            sampling_keep_top_k: -1, or sample among the k largest logits.
            never_end: forbid ``stop_at_token``.
            bos_id: input id at position 0.
            encoder_*: the encoder output etc. when decoding a Bitransformer.

        Returns:
            integer ``[batch..., length]``: the partial sequences with the sampled tokens written after them.

        Raises:
            ValueError: not autoregressive; ``sampling_keep_top_k`` 0 or below -1.
            NotImplementedError: ``remove_partial_sequences`` with partial sequences (needs ``dynamic_shift``).
        """
        return _sample_autoregressive(
            self, self._call_internal, partial_sequences, stop_at_token=stop_at_token, max_steps=max_steps,
            temperature=temperature,
            variable_dtype=variable_dtype, encoder_output=encoder_output, encoder_sequence_id=encoder_sequence_id,
            encoder_inputs=encoder_inputs, shared_params=shared_params, has_partial_sequences=has_partial_sequences,
            encoder_layer_outputs=encoder_layer_outputs, never_end=never_end,
            remove_partial_sequences=remove_partial_sequences, sampling_keep_top_k=sampling_keep_top_k, bos_id=bos_id)

    def beam_search(self, inputs, decode_length, variable_dtype=None, encoder_output=None, encoder_sequence_id=None,
                    encoder_inputs=None, alpha=0.6, shared_params=None, encoder_layer_outputs=None, bos_id=0):
        """Beam search (Mesh TF ``Unitransformer.beam_search``): the best beam of each sequence.

        Args:
            inputs: integer zeros ``[batch, beam, length]`` (one batch dim).
            decode_length: integer scalar Tensor, the maximum decode length.
            alpha: length-penalty exponent (``((5 + len) / 6)^alpha``).
            encoder_*: the encoder output etc. when decoding a Bitransformer.

        Returns:
            integer ``[batch, length]``.

        Raises:
            ValueError: not autoregressive. NotImplementedError: more than one batch dim, or
            ``input_full_attention``.
        """
        return _beam_search(self, self._call_internal, inputs, decode_length, variable_dtype=variable_dtype,
                            encoder_output=encoder_output,
                            encoder_sequence_id=encoder_sequence_id, encoder_inputs=encoder_inputs, alpha=alpha,
                            shared_params=shared_params, encoder_layer_outputs=encoder_layer_outputs, bos_id=bos_id)

"""``Bitransformer`` and ``make_bitransformer`` (Mesh TF ``transformer/transformer.py``).

An encoder Unitransformer (``autoregressive=False``, no output vocabulary, scope ``encoder``) and a
decoder Unitransformer (autoregressive, scope ``decoder``) whose EncDecAttention layers read the
encoder output, renamed ``length`` -> ``memory_length``. With ``shared_embedding=True`` the token
embedding (and the positional table, when both use one of the same size) are created once under
``shared/`` and used by both.
"""

from __future__ import annotations

import torch

from meshtorch.transformer import _mtf as mtf
from meshtorch.transformer import transformer_layers
from meshtorch.transformer._context import PREDICT, TRAIN, check_mode
from meshtorch.transformer._layer_stack import make_layer_stack
from meshtorch.transformer._sequences import autoregressive_inputs
from meshtorch.transformer._unitransformer import Unitransformer, sinusoid_positional_embedding_weights
from meshtorch.transformer.vocab_embeddings import get_vocab_embedding_cls


class Bitransformer:
    """A sequence-to-sequence Transformer with two layer stacks (Mesh TF ``transformer.Bitransformer``).

    Args:
        encoder / decoder: Unitransformers.
        shared_embedding: share the token (and positional) embedding between them (variables
            ``shared/embedding``, ``shared/positional_embedding``).
    """

    def __init__(self, encoder, decoder, shared_embedding=True):
        self.encoder = encoder
        self.decoder = decoder
        self.shared_embedding = shared_embedding

    @property
    def output_vocab_dim(self):
        return self.decoder.output_vocab_dim

    def loss_denominator(self, targets, num_microbatches):
        return self.decoder.loss_denominator(targets, num_microbatches)

    @property
    def z_loss(self):
        return self.decoder.z_loss

    def _shared_params(self, mesh, variable_dtype):
        """The parameters shared by the encoder and the decoder (a dict).

        Raises:
            ValueError: ``shared_embedding`` with different d_model or input vocabularies.
        """
        shared_params = {}
        if self.shared_embedding:
            with mtf.variable_scope("shared"):
                if not (self.encoder.model_dim == self.decoder.model_dim
                        and self.encoder.input_vocab_dim == self.decoder.input_vocab_dim):
                    raise ValueError("shared_embedding requires encoder and decoder to have identical d_model and "
                                     "vocabulary sizes")
                shared_params["embedding"] = get_vocab_embedding_cls()(
                    mesh, self.encoder.input_vocab_dim, self.encoder.model_dim, variable_dtype, name="embedding",
                    ensemble_dim=self.encoder.ensemble_dim)
                if (self.encoder.positional_embedding and self.decoder.positional_embedding
                        and self.encoder.max_length_dim == self.decoder.max_length_dim):
                    if self.encoder.sinusoid_positional_embedding and self.decoder.sinusoid_positional_embedding:
                        pos_emb_var = sinusoid_positional_embedding_weights(
                            mesh, self.encoder.max_length_dim, self.encoder.model_dim, variable_dtype.activation_dtype)
                    else:
                        pos_emb_var = mtf.layers.embedding_weights(
                            mesh, self.encoder.max_length_dim, self.encoder.model_dim, variable_dtype,
                            "positional_embedding", ensemble_dim=self.encoder.ensemble_dim)
                    shared_params["positional_embedding"] = pos_emb_var
        return shared_params

    def call_simple(self, inputs, targets, compute_loss, mode=TRAIN, variable_dtype=None, encoder_sequence_id=None,
                    decoder_sequence_id=None, decoder_subsequence_id=None, encoder_position=None,
                    decoder_position=None, num_microbatches=1):
        """Decoder logits and loss for all positions in parallel (Mesh TF ``Bitransformer.call_simple``).

        Args:
            inputs: integer ``[batch..., length]`` encoder ids (0 = padding).
            targets: integer ``[batch..., length]`` decoder targets (0 = padding); the decoder reads
                ``autoregressive_inputs(targets, decoder_sequence_id)``.
            compute_loss: also return the loss (decoder loss plus any encoder losses).
            mode: ``"train"``, ``"eval"`` or ``"infer"``.
            variable_dtype: a ``mtf.VariableDType`` (default float32).
            encoder_sequence_id / decoder_sequence_id: default ``minimum(ids, 1)`` (padding = 0).

        Returns:
            ``(logits [batch..., length, vocab], loss or None)``.
        """
        check_mode(mode)
        variable_dtype = variable_dtype or mtf.VariableDType(torch.float32)
        if encoder_sequence_id is None:
            encoder_sequence_id = mtf.minimum(inputs, 1)
        if decoder_sequence_id is None:
            decoder_sequence_id = mtf.minimum(targets, 1)
        encoder_layer_outputs = []
        shared_params = self._shared_params(inputs.mesh, variable_dtype)
        encoder_output, encoder_loss = self.encoder.call_simple(
            inputs, None, compute_loss, mode=mode, variable_dtype=variable_dtype, sequence_id=encoder_sequence_id,
            position=encoder_position, shared_params=shared_params, layer_outputs=encoder_layer_outputs,
            num_microbatches=num_microbatches)
        encoder_output = mtf.layers.rename_length_to_memory_length(encoder_output)
        encoder_sequence_id = mtf.layers.rename_length_to_memory_length(encoder_sequence_id)
        logits, loss = self.decoder.call_simple(
            autoregressive_inputs(targets, sequence_id=decoder_sequence_id), targets, compute_loss, mode=mode,
            variable_dtype=variable_dtype, sequence_id=decoder_sequence_id, subsequence_id=decoder_subsequence_id,
            encoder_output=encoder_output, encoder_sequence_id=encoder_sequence_id,
            encoder_inputs=mtf.layers.rename_length_to_memory_length(inputs), position=decoder_position,
            shared_params=shared_params, encoder_layer_outputs=encoder_layer_outputs,
            num_microbatches=num_microbatches)
        if loss is not None and isinstance(encoder_loss, mtf.Tensor):
            loss += encoder_loss
        return logits, loss

    def decode(self, inputs, variable_dtype=None, beam_size=1, alpha=0.6, temperature=0.0, sampling_keep_top_k=-1,
               decode_length_multiplier=1.5, decode_length_constant=10, max_decode_length=None):
        """Sampling or beam search of the decoder given encoder ids (Mesh TF ``Bitransformer.decode``).

        Args:
            inputs: integer ``[batch..., length]`` encoder ids (0 = padding).
            beam_size: 1 = :meth:`Unitransformer.sample_autoregressive` (greedy at temperature 0);
                more = :meth:`Unitransformer.beam_search` with length penalty ``alpha`` and a decode
                length of ``max_input_length * decode_length_multiplier + decode_length_constant``.
            temperature / sampling_keep_top_k: sampling options (beam_size 1 only).
            max_decode_length: decoded length (default the input length).

        Returns:
            integer ``[batch..., length]`` decoded ids.

        Raises:
            ValueError: beam search with a nonzero temperature or a top-k.
        """
        variable_dtype = variable_dtype or mtf.VariableDType(torch.float32)
        encoder_layer_outputs = []
        shared_params = self._shared_params(inputs.mesh, variable_dtype)
        encoder_sequence_id = mtf.minimum(inputs, 1)
        encoder_output, _ = self.encoder.call_simple(
            inputs=inputs, targets=None, compute_loss=False, mode=PREDICT, variable_dtype=variable_dtype,
            sequence_id=encoder_sequence_id, shared_params=shared_params, layer_outputs=encoder_layer_outputs)
        encoder_output = mtf.layers.rename_length_to_memory_length(encoder_output)
        encoder_sequence_id = mtf.layers.rename_length_to_memory_length(encoder_sequence_id)
        batch_dims = list(inputs.shape.dims[:-1])
        length_dim = inputs.shape.dims[-1]
        decode_length_dim = length_dim if max_decode_length is None else mtf.Dimension("length", max_decode_length)
        if beam_size == 1:
            partial_sequences = mtf.zeros(inputs.mesh, mtf.Shape(batch_dims + [decode_length_dim]), dtype=inputs.dtype)
            return self.decoder.sample_autoregressive(
                partial_sequences, temperature=temperature, sampling_keep_top_k=sampling_keep_top_k,
                variable_dtype=variable_dtype, encoder_output=encoder_output,
                encoder_sequence_id=encoder_sequence_id,
                encoder_inputs=mtf.layers.rename_length_to_memory_length(inputs), shared_params=shared_params,
                has_partial_sequences=False, encoder_layer_outputs=encoder_layer_outputs)
        if temperature != 0:
            raise ValueError("don't know how to beam search with nonzero temperature")
        if sampling_keep_top_k != -1:
            raise ValueError("don't know how to beam search with top-k value other than -1.")
        beam_dim = mtf.Dimension("beam", beam_size)
        partial_sequences = mtf.zeros(inputs.mesh, mtf.Shape(batch_dims + [beam_dim, decode_length_dim]),
                                      dtype=inputs.dtype)
        input_length = mtf.reduce_sum(mtf.cast(mtf.not_equal(inputs, 0), torch.float32), reduced_dim=length_dim)
        max_input_length = mtf.reduce_max(input_length)
        decode_length = mtf.cast(max_input_length * decode_length_multiplier + decode_length_constant, torch.int32)
        return self.decoder.beam_search(
            partial_sequences, decode_length, variable_dtype=variable_dtype, encoder_output=encoder_output,
            encoder_sequence_id=encoder_sequence_id, encoder_inputs=inputs, alpha=alpha,
            shared_params=shared_params, encoder_layer_outputs=encoder_layer_outputs)


def make_bitransformer(input_vocab_size, output_vocab_size, layout=None, mesh_shape=None, encoder_name="encoder",
                       decoder_name="decoder", bitransformer_cls=Bitransformer, encoder_layers=None,
                       decoder_layers=None, num_layers=6, d_model=1024, max_length=512, **unitransformer_kwargs):
    """A Bitransformer with Mesh TF's ``defaults.gin`` layers (Mesh TF ``transformer.make_bitransformer``, gin-free).

    Where Mesh TF reads the layers, ``num_layers``, ``d_model`` and ``max_length`` from gin, they
    are arguments here: ``encoder_layers`` default ``[SelfAttention, DenseReluDense]``,
    ``decoder_layers`` ``[SelfAttention, EncDecAttention, DenseReluDense]`` (specifications as in
    :func:`make_layer_stack`). ``unitransformer_kwargs`` go to both Unitransformers.
    """
    tl = transformer_layers
    encoder_layers = encoder_layers or [tl.SelfAttention, tl.DenseReluDense]
    decoder_layers = decoder_layers or [tl.SelfAttention, tl.EncDecAttention, tl.DenseReluDense]
    common = dict(d_model=d_model, max_length=max_length, layout=layout, mesh_shape=mesh_shape,
                  **unitransformer_kwargs)
    encoder = Unitransformer(layer_stack=make_layer_stack(encoder_layers, num_layers=num_layers),
                             input_vocab_size=input_vocab_size, output_vocab_size=None, autoregressive=False,
                             name=encoder_name, **common)
    decoder = Unitransformer(layer_stack=make_layer_stack(decoder_layers, num_layers=num_layers),
                             input_vocab_size=output_vocab_size, output_vocab_size=output_vocab_size,
                             autoregressive=True, name=decoder_name, **common)
    return bitransformer_cls(encoder, decoder)

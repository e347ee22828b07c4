"""Mesh TF's ``mesh_tensorflow.transformer`` package on meshtorch (``mtf.transformer``).

Module layout as Mesh TF's: :mod:`~meshtorch.transformer.transformer` (Unitransformer,
Bitransformer, LayerStack, sublayers, make_layer_stack, autoregressive_inputs),
:mod:`~meshtorch.transformer.transformer_layers` (SelfAttention, EncDecAttention, DenseReluDense),
:mod:`~meshtorch.transformer.attention`, :mod:`~meshtorch.transformer.moe` (MoE1D) and
:mod:`~meshtorch.transformer.vocab_embeddings`. No gin: what Mesh TF's ``defaults.gin`` binds is the
default of the corresponding argument. See ``docs/transformer.md``.
"""

from meshtorch.transformer import attention, moe, transformer, transformer_layers, vocab_embeddings

__all__ = ["attention", "moe", "transformer", "transformer_layers", "vocab_embeddings"]

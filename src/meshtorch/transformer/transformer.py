"""Mesh TF's ``mesh_tensorflow.transformer.transformer`` module: models, layer stack, sublayers.

The classes live in small private modules and are re-exported here under Mesh TF's names, so
``from meshtorch.transformer import transformer`` then ``transformer.Unitransformer(...)`` ports
unchanged. See ``docs/transformer.md``.
"""

from meshtorch.transformer._bitransformer import Bitransformer, make_bitransformer
from meshtorch.transformer._context import EVAL, MODES, PREDICT, TRAIN, Context, TransformerLayer
from meshtorch.transformer._layer_stack import (
    LayerStack,
    make_layer_stack,
    sublayer_call_layer,
    sublayer_dropout,
    sublayer_layer_norm,
    sublayer_legacy_dropout,
    sublayer_legacy_final_rms_norm,
    sublayer_legacy_rms_norm,
    sublayer_mask_padding,
    sublayer_residual,
    sublayer_rezero,
    sublayer_rms_norm,
    sublayer_true_layer_norm,
)
from meshtorch.transformer._sequences import autoregressive_inputs, delimited_lm_inputs_mask
from meshtorch.transformer._unitransformer import (
    Unitransformer,
    reduce_ensemble_logits,
    sinusoid_positional_embedding_weights,
)
from meshtorch.transformer.vocab_embeddings import VocabEmbedding, get_vocab_embedding_cls

__all__ = ["Bitransformer", "make_bitransformer", "Context", "TransformerLayer", "TRAIN", "EVAL", "PREDICT", "MODES",
           "LayerStack", "make_layer_stack", "sublayer_call_layer", "sublayer_dropout", "sublayer_layer_norm",
           "sublayer_legacy_dropout", "sublayer_legacy_final_rms_norm", "sublayer_legacy_rms_norm",
           "sublayer_mask_padding", "sublayer_residual", "sublayer_rezero", "sublayer_rms_norm",
           "sublayer_true_layer_norm", "autoregressive_inputs", "delimited_lm_inputs_mask", "Unitransformer",
           "reduce_ensemble_logits", "sinusoid_positional_embedding_weights", "VocabEmbedding",
           "get_vocab_embedding_cls"]

"""Vocabulary embeddings (Mesh TF's ``transformer.VocabEmbedding``, defined in its ``transformer.py``).

Mesh TF's ``vocab_embeddings.py`` holds alternatives (factorized, adaptive, mixture-of-softmaxes)
that are not ported; the default class lives here and is re-exported by
:mod:`meshtorch.transformer.transformer` under its Mesh TF name. The table, the lookup and the tied
projection are meshtorch's (:mod:`meshtorch.layers.embedding`, shared with the CLI's LM and the
Hugging Face models); this class keeps Mesh TF's names, initialisers and scalings.
"""

from __future__ import annotations

from meshtorch.transformer import _mtf as mtf

__all__ = ["VocabEmbedding", "get_vocab_embedding_cls"]


class VocabEmbedding:
    """Ids -> model states, and (shared weights) model states -> logits (Mesh TF ``transformer.VocabEmbedding``).

    Args:
        mesh: the Mesh.
        vocab_dim / output_dim: Dimensions ``vocab`` and ``d_model``.
        variable_dtype: a VariableDType.
        name: variable name (``embedding``) within the current scope: ``[ensemble..., vocab, d_model]``,
            initialised normal with std 1 (or ``d_model**-0.5`` with
            ``scale_variable_like_classifier_weights``).
        ensemble_dim: optional Dimension.
        scale_variable_like_classifier_weights: Mesh TF option moving the ``d_model**0.5`` factor.

    ``hidden_to_logits`` multiplies the hidden state by ``d_model**-0.5`` before the einsum with the
    table (Mesh TF's shared embedding-and-softmax scaling).
    """

    def __init__(self, mesh, vocab_dim, output_dim, variable_dtype, name, ensemble_dim,
                 scale_variable_like_classifier_weights=False):
        self._vocab_dim = vocab_dim
        self._output_dim = output_dim
        self._scale_variable_like_classifier_weights = scale_variable_like_classifier_weights
        initializer = None
        if scale_variable_like_classifier_weights:
            initializer = mtf.random_normal_initializer(stddev=self._output_dim.size ** -0.5)
        self._embedding_weights = mtf.layers.embedding_weights(
            mesh=mesh, vocab_dim=vocab_dim, output_dim=output_dim, variable_dtype=variable_dtype, name=name,
            ensemble_dim=ensemble_dim, initializer=initializer)

    def ids_to_embedding(self, ids, context):
        """Integer ids ``[...]`` -> ``[..., d_model]`` (a gather on ``vocab``)."""
        del context
        ret = mtf.layers.embedding_lookup(self._embedding_weights, ids, self._vocab_dim)
        if self._scale_variable_like_classifier_weights:
            ret *= self._output_dim.size ** 0.5
        return ret

    def hidden_to_logits(self, hidden, context):
        """``[..., d_model]`` -> logits ``[..., vocab]`` with the same table."""
        del context
        if not self._scale_variable_like_classifier_weights:
            hidden *= self._output_dim.size ** -0.5
        return mtf.layers.embedding_logits(hidden, self._embedding_weights, self._output_dim)


def get_vocab_embedding_cls(cls=VocabEmbedding):
    """The vocab-embedding class to use (Mesh TF's gin hook; here just returns ``cls``)."""
    return cls

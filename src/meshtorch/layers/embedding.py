"""Embedding tables and lookups (Mesh TF ``mtf.layers.embedding_weights`` / ``embedding``).

The lookup is ``mtf.gather`` on the ``vocab`` dim: with ``vocab`` split over a mesh axis each
processor gathers the rows it holds (zeros elsewhere) and the result is a lazy all-reduce over that
axis; with ``d_model`` split it is local.

:func:`embedding_lookup` and :func:`embedding_logits` are the one lookup and the one tied
(embedding-and-softmax) projection: the CLI's LM, the Hugging Face models and
``mtf.transformer.VocabEmbedding`` call them.
"""

from __future__ import annotations

from meshtorch.core.dims import Shape, convert_to_dimension
from meshtorch.core.graph import Mesh, Tensor
from meshtorch.ops.einsum import einsum
from meshtorch.ops.indexing import gather
from meshtorch.ops.initializers import random_normal_initializer
from meshtorch.ops.variables import get_variable

__all__ = ["embedding_weights", "embedding", "embedding_lookup", "embedding_logits"]


def embedding_weights(mesh: Mesh, vocab_dim, output_dim, variable_dtype, name: str = "embedding",
                      ensemble_dim=None, initializer=None) -> Tensor:
    """The table ``[ensemble..., vocab_dim, output_dim]`` (Mesh TF ``layers.embedding_weights``).

    Args:
        mesh: the Mesh.
        vocab_dim / output_dim: Dimensions (e.g. ``vocab`` and ``d_model``).
        variable_dtype: a ``mtf.VariableDType`` or torch dtype.
        name: variable name within the current ``mtf.variable_scope``.
        ensemble_dim: optional Dimension (or list) prepended to the shape.
        initializer: default ``random_normal_initializer()`` (std 1), as Mesh TF.

    Returns:
        the variable's value Tensor.
    """
    if not ensemble_dim:
        ensemble = []
    elif isinstance(ensemble_dim, list):
        ensemble = [convert_to_dimension(d) for d in ensemble_dim]
    else:
        ensemble = [convert_to_dimension(ensemble_dim)]
    shape = Shape(ensemble + [convert_to_dimension(vocab_dim), convert_to_dimension(output_dim)])
    if initializer is None:
        initializer = random_normal_initializer()
    return get_variable(mesh, name, shape, dtype=variable_dtype, initializer=initializer)


def embedding(indices: Tensor, vocab_dim, output_dim, variable_dtype, name: str = "embedding") -> Tensor:
    """``gather(embedding_weights(...), indices, vocab_dim)`` (Mesh TF ``layers.embedding``).

    Args:
        indices: integer ids ``[...]``.
        vocab_dim / output_dim: Dimensions of the table.
        variable_dtype: a ``mtf.VariableDType`` or torch dtype.
        name: the table's variable name within the current ``mtf.variable_scope``.

    Returns:
        ``[..., output_dim]`` in the variable's activation dtype.
    """
    vocab_dim = convert_to_dimension(vocab_dim)
    weights = embedding_weights(indices.mesh, vocab_dim, output_dim, variable_dtype, name)
    return embedding_lookup(weights, indices, vocab_dim)


def embedding_lookup(weights: Tensor, ids: Tensor, vocab_dim, name=None) -> Tensor:
    """The rows ``ids`` of the table ``weights`` ``[..., vocab, d_model]``: ``gather`` on ``vocab_dim``.

    Args:
        weights: the table (any extra dims, e.g. an ensemble dim, are kept).
        ids: integer Tensor ``[...]``; vocab_dim: the table's vocabulary Dimension (or its name).

    Returns:
        ``ids.shape + (weights.shape - vocab)``, the table's dtype. Out-of-range ids give zero rows
        (:func:`meshtorch.gather`).
    """
    return gather(weights, ids, vocab_dim, name=name)


def embedding_logits(hidden: Tensor, weights: Tensor, model_dim, output_shape=None, name=None) -> Tensor:
    """Logits from hidden states with a ``[vocab, d_model]`` table: ``einsum`` contracting ``model_dim``
    (tied embedding and softmax, Press & Wolf 2017; Mesh TF ``VocabEmbedding.hidden_to_logits`` after its
    scaling; ``transformers``' tied ``lm_head``).

    Returns:
        ``hidden.shape - d_model + vocab`` (or ``output_shape``).
    """
    if output_shape is not None:
        return einsum([hidden, weights], output_shape=output_shape, name=name)
    return einsum([hidden, weights], reduced_dims=[convert_to_dimension(model_dim)], name=name)

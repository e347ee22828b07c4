"""Embedding tables and lookups (Mesh TF ``mtf.layers.embedding_weights`` / ``embedding``).

The lookup is ``mtf.gather`` on the ``vocab`` dim: with ``vocab`` split over a mesh axis each
processor gathers the rows it holds (zeros elsewhere) and the result is a lazy all-reduce over that
axis; with ``d_model`` split it is local.
"""

from __future__ import annotations

from meshtorch.core.dims import Shape, convert_to_dimension
from meshtorch.core.graph import Mesh, Tensor
from meshtorch.ops.indexing import gather
from meshtorch.ops.initializers import random_normal_initializer
from meshtorch.ops.variables import get_variable

__all__ = ["embedding_weights", "embedding"]


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
    return gather(weights, indices, vocab_dim)

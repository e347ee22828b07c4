"""Mesh TF's ``mtf.layers.dense`` / ``dense_product`` as the transformer package calls them.

Thin Mesh-TF-named aliases of meshtorch's one dense layer: :func:`meshtorch.layers.core.scoped_dense` and
:func:`meshtorch.layers.dense_extra.scoped_dense_product` (the arithmetic, initialiser and errors of
:func:`meshtorch.layers.dense`, shared with the CLI's LM) with Mesh TF's variable names: ``kernel`` and
``bias`` inside ``variable_scope(name, default_name="dense")``, ``dense_product``'s ``{name}_{i}`` for
several factors; a second call under the same scope (decoding loops) reuses the variables.
Initialiser: variance scaling, scale 1, fan-in over ``reduced_dims``, normal.
"""

from __future__ import annotations

from meshtorch.layers.core import scoped_dense as dense
from meshtorch.layers.dense_extra import scoped_dense_product as dense_product

__all__ = ["dense", "dense_product"]

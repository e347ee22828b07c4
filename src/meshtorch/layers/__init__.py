"""Neural-network layers on named dimensions (Mesh TF ``mtf.layers``)."""

from meshtorch.layers.core import dense, softmax_cross_entropy_with_logits

__all__ = ["dense", "softmax_cross_entropy_with_logits"]

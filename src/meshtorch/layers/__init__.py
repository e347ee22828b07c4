"""Neural-network layers on named dimensions (Mesh TF ``mtf.layers``)."""

from meshtorch.layers.conv import (
    conv1d,
    conv2d,
    conv2d_transpose,
    conv2d_with_blocks,
    conv3d,
    conv3d_transpose,
    conv3d_with_blocks,
)
from meshtorch.layers.core import dense, softmax_cross_entropy_with_logits

__all__ = ["dense", "softmax_cross_entropy_with_logits", "conv1d", "conv2d", "conv3d", "conv2d_with_blocks",
           "conv3d_with_blocks", "conv2d_transpose", "conv3d_transpose"]

"""Neural-network layers on named dimensions (Mesh TF ``mtf.layers``)."""

from meshtorch.layers.attention import AttentionOperation, dot_product_attention, multihead_attention
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
from meshtorch.layers.embedding import embedding, embedding_weights
from meshtorch.layers.feedforward import dense_relu_dense
from meshtorch.layers.masks import (
    attention_mask_autoregressive,
    attention_mask_ignore_padding,
    attention_mask_same_segment,
    rename_length_to_memory_length,
    weights_nonzero,
)
from meshtorch.layers.moe import expert_capacity, moe_apply, moe_ffn, top_k_gating
from meshtorch.layers.norms import layer_norm, rms_norm

__all__ = ["dense", "softmax_cross_entropy_with_logits", "layer_norm", "rms_norm", "dot_product_attention",
           "multihead_attention", "AttentionOperation", "dense_relu_dense", "moe_ffn", "moe_apply", "expert_capacity",
           "top_k_gating", "conv1d", "conv2d", "conv3d", "conv2d_with_blocks", "conv3d_with_blocks", "conv2d_transpose",
           "conv3d_transpose", "embedding", "embedding_weights", "attention_mask_autoregressive",
           "attention_mask_ignore_padding", "attention_mask_same_segment", "rename_length_to_memory_length",
           "weights_nonzero"]

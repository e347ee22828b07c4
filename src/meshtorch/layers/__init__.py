"""Neural-network layers on named dimensions (Mesh TF ``mtf.layers``)."""

from meshtorch.layers import dense_extra, local_attention, misc, mtf_attention
from meshtorch.layers.attention import (
    AttentionOperation,
    grouped_query_attention,
    multihead_attention_layer,
    scaled_dot_product_attention,
)
from meshtorch.layers.conv import (
    conv1d,
    conv2d,
    conv2d_transpose,
    conv2d_transpose_with_blocks,
    conv2d_with_blocks,
    conv3d,
    conv3d_transpose,
    conv3d_transpose_with_blocks,
    conv3d_with_blocks,
)
from meshtorch.layers.core import dense, get_dense_kernel_weights, softmax_cross_entropy_with_logits
from meshtorch.layers.dense_extra import *  # noqa: F403
from meshtorch.layers.embedding import embedding, embedding_weights
from meshtorch.layers.feedforward import dense_act_dense, dense_relu_dense
from meshtorch.layers.local_attention import *  # noqa: F403
from meshtorch.layers.masks import (
    attention_mask_autoregressive,
    attention_mask_ignore_padding,
    attention_mask_same_segment,
    rename_length_to_memory_length,
    weights_nonzero,
)
from meshtorch.layers.misc import *  # noqa: F403
from meshtorch.layers.moe import expert_capacity, moe_apply, moe_ffn, top_k_gating
from meshtorch.layers.mtf_attention import *  # noqa: F403
from meshtorch.layers.norms import layer_norm, rms_norm
from meshtorch.layers.pipeline import StackedVariables, pipeline

__all__ = ["dense", "get_dense_kernel_weights", "softmax_cross_entropy_with_logits", "layer_norm", "rms_norm",
           "scaled_dot_product_attention", "grouped_query_attention", "multihead_attention_layer", "AttentionOperation",
           "dense_act_dense",
           "dense_relu_dense", "moe_ffn", "moe_apply", "expert_capacity", "top_k_gating", "conv1d", "conv2d", "conv3d",
           "conv2d_with_blocks", "conv3d_with_blocks", "conv2d_transpose", "conv3d_transpose",
           "conv2d_transpose_with_blocks", "conv3d_transpose_with_blocks", "embedding", "embedding_weights",
           "attention_mask_autoregressive", "attention_mask_ignore_padding", "attention_mask_same_segment",
           "rename_length_to_memory_length", "weights_nonzero", "pipeline", "StackedVariables"]
__all__ += dense_extra.__all__ + local_attention.__all__ + misc.__all__ + mtf_attention.__all__

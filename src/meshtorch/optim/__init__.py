"""Optimizers, schedules and clipping as graph operations: ``apply_grads`` returns assign ops to fetch."""

from meshtorch.optim.adafactor import (
    AdafactorOptimizer,
    adafactor_decay_rate_adam,
    adafactor_decay_rate_pow,
    reduce_rms,
)
from meshtorch.optim.adam import AdamOptimizer, AdamWOptimizer
from meshtorch.optim.adam_weight_decay import AdamWeightDecayOptimizer, AdamWithMultiLRSchedule
from meshtorch.optim.base import Optimizer, get_or_create_global_step
from meshtorch.optim.clip import GlobalSumOfSquares, clip_by_global_norm, global_norm
from meshtorch.optim.schedules import (
    constant_schedule,
    cosine_decay_with_warmup,
    linear_warmup,
    product_schedule,
    rsqrt_decay,
    truncated_rsqrt,
)
from meshtorch.optim.sgd import MomentumOptimizer, SgdOptimizer

__all__ = [
    "Optimizer", "SgdOptimizer", "MomentumOptimizer", "AdamOptimizer", "AdamWOptimizer", "AdafactorOptimizer",
    "adafactor_decay_rate_pow", "adafactor_decay_rate_adam", "reduce_rms", "get_or_create_global_step",
    "GlobalSumOfSquares", "global_norm", "clip_by_global_norm",
    "constant_schedule", "linear_warmup", "rsqrt_decay", "truncated_rsqrt", "cosine_decay_with_warmup",
    "product_schedule", "AdamWeightDecayOptimizer", "AdamWithMultiLRSchedule",
]

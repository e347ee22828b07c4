"""``mtf.optimize``: Mesh TF's optimizer module names (mesh_tensorflow/optimize.py) on :mod:`meshtorch.optim`.

Same objects as ``mtf.optim`` where the update is the same; ``MomentumOptimizer`` here is Mesh TF's
(learning rate folded into the momentum, slot ``{var}_momentum_v``): a configuration of
``mtf.optim.MomentumOptimizer`` (torch's form), with which it agrees for a constant learning rate.
"""

from meshtorch.optim.adafactor import (
    AdafactorOptimizer,
    adafactor_decay_rate_adam,
    adafactor_decay_rate_pow,
    reduce_rms,
)
from meshtorch.optim.adam_weight_decay import AdamWeightDecayOptimizer, AdamWithMultiLRSchedule
from meshtorch.optim.base import Optimizer, get_or_create_global_step
from meshtorch.optim.multi_lr import (
    AdafactorWithMultiLRSchedule,
    adafactor_optimizer_from_hparams,
    compute_lr_for_step,
    make_optimizer,
    product_learning_rate,
)
from meshtorch.optim.sgd import MeshTFMomentumOptimizer as MomentumOptimizer
from meshtorch.optim.sgd import SgdOptimizer

__all__ = ["Optimizer", "SgdOptimizer", "MomentumOptimizer", "AdamWeightDecayOptimizer", "AdafactorOptimizer",
           "adafactor_decay_rate_adam", "adafactor_decay_rate_pow", "adafactor_optimizer_from_hparams", "reduce_rms",
           "product_learning_rate", "compute_lr_for_step", "AdafactorWithMultiLRSchedule", "AdamWithMultiLRSchedule",
           "make_optimizer", "get_or_create_global_step"]

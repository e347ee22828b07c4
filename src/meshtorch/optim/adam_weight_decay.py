"""Mesh TF's (BERT's) ``AdamWeightDecayOptimizer`` and ``AdamWithMultiLRSchedule``, as graph operations.

mesh_tensorflow/optimize.py's update, with no bias correction::

    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    u  = m / (sqrt(v) + eps) + wd * w        (wd only for variables no exclude regex matches)
    w <- w - lr * u

Slots ``{var}/adam_m`` and ``{var}/adam_v`` (float32, the variable's named shape: its layout, no
communication). For torch's bias-corrected Adam / AdamW use :mod:`meshtorch.optim.adam`.
"""

from __future__ import annotations

import re

import torch

from meshtorch.ops import elementwise as ew
from meshtorch.ops.initializers import zeros_initializer
from meshtorch.ops.variables import Assign, get_variable
from meshtorch.optim.base import Optimizer, check_grad

__all__ = ["AdamWeightDecayOptimizer", "AdamWithMultiLRSchedule", "lr_for_variable"]


class AdamWeightDecayOptimizer(Optimizer):
    """Adam with "correct" L2 weight decay and no bias correction (Mesh TF ``AdamWeightDecayOptimizer``).

    Args:
        learning_rate: float, scalar Tensor or schedule ``fn(step) -> Tensor``.
        weight_decay_rate: decay coefficient added to the update (not the gradient).
        beta_1, beta_2, epsilon: Adam's constants (Mesh TF's defaults 0.9, 0.999, 1e-6).
        exclude_from_weight_decay: regexes; variables whose name matches one get no decay.

    Shapes: the gradient has the variable's named shape; the update is computed in float32 and
    cast to the variable's dtype on assignment.
    """

    def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                 exclude_from_weight_decay=None):
        super().__init__(learning_rate)
        self.weight_decay_rate = float(weight_decay_rate)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        self.exclude_from_weight_decay = exclude_from_weight_decay

    def _do_use_weight_decay(self, param_name: str) -> bool:
        if not self.weight_decay_rate:
            return False
        return not any(re.search(r, param_name) for r in (self.exclude_from_weight_decay or ()))

    def variable_lr(self, var):
        """The learning rate for ``var``'s update (subclasses choose per variable)."""
        return self.lr(var.mesh)

    def apply_grad(self, grad, var):
        check_grad(grad, var, "AdamWeightDecayOptimizer")
        grad = ew.cast(grad, torch.float32)
        m = get_variable(var.mesh, f"{var.name}/adam_m", var.shape, initializer=zeros_initializer(), trainable=False)
        v = get_variable(var.mesh, f"{var.name}/adam_v", var.shape, initializer=zeros_initializer(), trainable=False)
        next_m = m * self.beta_1 + grad * (1.0 - self.beta_1)
        next_v = v * self.beta_2 + ew.square(grad) * (1.0 - self.beta_2)
        update = next_m / (ew.sqrt(next_v) + self.epsilon)
        w = ew.cast(var.value, torch.float32)
        if self._do_use_weight_decay(var.name):
            update = update + w * self.weight_decay_rate
        new_w = ew.cast(w - update * self.variable_lr(var), var.dtype)
        return [Assign([var, m.operation, v.operation], [new_w, next_m, next_v], name=f"{var.name}/adam_update")]


def lr_for_variable(opt: Optimizer, var, base_lr):
    """``base_lr``, or the alternative schedule of the first ``opt.variable_search`` regex matching
    ``var.name`` (resolved with the step, once per mesh and pattern)."""
    if opt.alt_lr_schedules is None or opt.variable_search is None:
        return base_lr
    for idx, pattern in enumerate(opt.variable_search):
        if re.search(pattern, var.name) is not None:
            return opt.hyper(opt.alt_lr_schedules[idx], f"alt_learning_rate_{idx}", var.mesh)
    return base_lr


class AdamWithMultiLRSchedule(AdamWeightDecayOptimizer):
    """:class:`AdamWeightDecayOptimizer` whose variables matching ``variable_search[i]`` (regexes) use
    ``alt_lr_schedules[i]`` (Mesh TF ``AdamWithMultiLRSchedule``).

    Each alternative is a number, a scalar Tensor or ``fn(step) -> Tensor`` (see
    :func:`meshtorch.optimize.compute_lr_for_step`, which builds them from Mesh TF's factor lists).
    Differs from Mesh TF in one point: Mesh TF's loop keeps only the result of the LAST pattern
    (an earlier matching pattern is overwritten); here the first matching pattern decides. With one
    pattern the two agree.
    """

    def __init__(self, variable_search=None, alt_lr_schedules=None, **kwargs):
        super().__init__(**kwargs)
        self.variable_search = variable_search
        self.alt_lr_schedules = alt_lr_schedules

    def variable_lr(self, var):
        return lr_for_variable(self, var, self.lr(var.mesh))

"""Mesh TF's learning-rate products, per-variable schedules and optimizer factories (mesh_tensorflow/optimize.py).

``product_learning_rate``, ``compute_lr_for_step``, ``AdafactorWithMultiLRSchedule``, ``make_optimizer``,
``adafactor_optimizer_from_hparams``, and (re-exported from :mod:`meshtorch.optim.sgd`)
``MeshTFMomentumOptimizer`` (Mesh TF's momentum update, exported as ``mtf.optimize.MomentumOptimizer``).
No gin: ``factors`` and schedules are passed directly.
"""

from __future__ import annotations

import functools

from meshtorch.optim.adafactor import AdafactorOptimizer, adafactor_decay_rate_adam, adafactor_decay_rate_pow
from meshtorch.optim.adam_weight_decay import lr_for_variable
from meshtorch.optim.sgd import MeshTFMomentumOptimizer, SgdOptimizer

__all__ = ["product_learning_rate", "compute_lr_for_step", "AdafactorWithMultiLRSchedule", "make_optimizer",
           "adafactor_optimizer_from_hparams", "MeshTFMomentumOptimizer"]


def product_learning_rate(step, total_train_steps, factors=None, offset=0):
    """The product of ``factors``: numbers, or functions ``f(step - offset, total_train_steps - offset)``
    (Mesh TF ``product_learning_rate``; there ``factors`` is a required gin parameter).

    ``step``: the float32 step Tensor (as an optimizer's schedule receives it) or a number.

    Raises:
        ValueError: if ``factors`` is not given.
    """
    if factors is None:
        raise ValueError("product_learning_rate: factors is required (a list of numbers and/or functions).")
    ret = 1.0
    for f in factors:
        ret = ret * (f(step - offset, total_train_steps - offset) if callable(f) else f)
    return ret


def compute_lr_for_step(schedules, learning_rate, train_steps=524288):
    """One learning rate per entry of ``schedules`` (Mesh TF ``compute_lr_for_step``): ``learning_rate``
    for None, else the schedule ``step -> product_learning_rate(step, train_steps, factors=entry)``.

    Mesh TF evaluates the schedules at ``tf.train.get_global_step()`` here; meshtorch optimizers take
    schedules as functions of the step, so the functions are returned (an optimizer evaluates them).
    """
    return [learning_rate if s is None else
            functools.partial(product_learning_rate, total_train_steps=train_steps, factors=s)
            for s in schedules]


class AdafactorWithMultiLRSchedule(AdafactorOptimizer):
    """Adafactor whose variables matching ``variable_search[i]`` (regexes) use ``alt_lr_schedules[i]``
    (Mesh TF ``AdafactorWithMultiLRSchedule``); ``**kwargs`` go to :class:`AdafactorOptimizer`.

    As :class:`~meshtorch.optim.adam_weight_decay.AdamWithMultiLRSchedule`: the first matching pattern
    decides (Mesh TF keeps the last pattern's result); the same with one pattern.
    """

    def __init__(self, variable_search=None, alt_lr_schedules=None, **kwargs):
        super().__init__(**kwargs)
        self.variable_search = variable_search
        self.alt_lr_schedules = alt_lr_schedules
        self._var_lr = None

    def lr(self, mesh):
        return self._var_lr if self._var_lr is not None else super().lr(mesh)

    def apply_grad(self, grad, var):
        self._var_lr = None
        alt = lr_for_variable(self, var, None)
        self._var_lr = alt
        try:
            return super().apply_grad(grad, var)
        finally:
            self._var_lr = None


def adafactor_optimizer_from_hparams(hparams, lr):
    """An :class:`AdafactorOptimizer` from Mesh TF / tensor2tensor hparams (any object with the
    attributes ``optimizer_adafactor_decay_type`` ("Adam" or "pow"), ``optimizer_adafactor_beta2``,
    ``optimizer_adafactor_memory_exponent``, ``optimizer_adafactor_multiply_by_parameter_scale``,
    ``optimizer_adafactor_beta1``, ``optimizer_adafactor_clipping_threshold``, ``optimizer_adafactor_factored``).

    Raises:
        ValueError: on an unknown decay type.
    """
    if hparams.optimizer_adafactor_decay_type == "Adam":
        decay_rate = adafactor_decay_rate_adam(hparams.optimizer_adafactor_beta2)
    elif hparams.optimizer_adafactor_decay_type == "pow":
        decay_rate = adafactor_decay_rate_pow(hparams.optimizer_adafactor_memory_exponent)
    else:
        raise ValueError(f"unknown optimizer_adafactor_decay_type {hparams.optimizer_adafactor_decay_type!r}; "
                         "use 'Adam' or 'pow'.")
    return AdafactorOptimizer(multiply_by_parameter_scale=hparams.optimizer_adafactor_multiply_by_parameter_scale,
                              learning_rate=lr, decay_rate=decay_rate, beta1=hparams.optimizer_adafactor_beta1,
                              clipping_threshold=hparams.optimizer_adafactor_clipping_threshold,
                              factored=hparams.optimizer_adafactor_factored)


def make_optimizer(hparams, lr):
    """``SgdOptimizer(lr)`` for ``hparams.optimizer == "SGD"``, Adafactor from hparams for "Adafactor"
    (Mesh TF ``make_optimizer``). Raises ValueError otherwise."""
    if hparams.optimizer == "SGD":
        return SgdOptimizer(lr)
    if hparams.optimizer == "Adafactor":
        return adafactor_optimizer_from_hparams(hparams, lr)
    raise ValueError(f"Unknown Optimizer {hparams.optimizer!r}; use 'SGD' or 'Adafactor'.")

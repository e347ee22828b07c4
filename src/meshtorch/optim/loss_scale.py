"""Dynamic loss scaling for float16 training: ``torch.amp.GradScaler``'s semantics as graph ops.

float16 has 5 exponent bits: small gradients of a float16 backward pass underflow to zero. The loss is
multiplied by a scale ``S`` before the backward pass, the float32 gradients of the masters are multiplied by
``1 / S`` (exact: ``S`` is a power of 2), and a step whose gradients hold an inf or NaN is skipped (no
variable, slot or step count changes) and halves ``S``; after ``growth_interval`` good steps in a row ``S``
doubles. ``S`` (float32) and the count of good steps (int32) are non-trainable replicated variables,
``loss_scale`` and ``loss_scale/growth_tracker``, saved with checkpoints; the update of the two is PyTorch's own
kernel (``torch._amp_update_scale_``).

Overflow detection: one float32 sum of the squares of every scaled gradient
(:class:`~meshtorch.optim.clip.GlobalSumOfSquares`, one scalar all-reduce whatever the layouts) is inf or NaN
exactly when some gradient element is (or when the float32 sum itself overflows, past ~1.8e19 per element:
counted as an overflow here, where GradScaler checks elements).

Source: PyTorch ``torch.amp.GradScaler`` (defaults: ``init_scale=2**16``, ``growth_factor=2``,
``backoff_factor=0.5``, ``growth_interval=2000``; ``unscale_`` then ``step`` with ``found_inf`` for fused
optimizers, then ``update``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops.initializers import constant_initializer, zeros_initializer
from meshtorch.ops.variables import Assign, get_variable
from meshtorch.optim.clip import GlobalSumOfSquares, ScaleGroup

__all__ = ["LOSS_SCALE_VARIABLES", "DynamicLossScale", "FoundInf", "UpdateLossScale", "unscale_gradients"]

SCALE_NAME = "loss_scale"
TRACKER_NAME = "loss_scale/growth_tracker"
#: the loss scaling state's variable names (a resumed run whose checkpoint lacks them starts them afresh)
LOSS_SCALE_VARIABLES = (SCALE_NAME, TRACKER_NAME)


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """``torch.amp.GradScaler``'s parameters (its defaults).

    Raises:
        ValueError: ``init_scale`` not > 0, ``growth_factor`` not > 1, ``backoff_factor`` not in (0, 1), or
            ``growth_interval`` < 1.
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ValueError(f"DynamicLossScale: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                             f"growth_interval >= 1, got {self}.")

    def variables(self, mesh) -> tuple[Tensor, Tensor]:
        """The scale (float32 scalar, starts at ``init_scale``) and the good-step count (int32 scalar) of ``mesh``."""
        scale = get_variable(mesh, SCALE_NAME, [], initializer=constant_initializer(self.init_scale),
                             dtype=torch.float32, trainable=False)
        tracker = get_variable(mesh, TRACKER_NAME, [], initializer=zeros_initializer(), dtype=torch.int32,
                               trainable=False)
        return scale, tracker

    def update(self, scale: Tensor, tracker: Tensor, found_inf: Tensor) -> Assign:
        """The assignment of the next scale and good-step count (``GradScaler.update``)."""
        op = UpdateLossScale(scale, tracker, found_inf, growth_factor=self.growth_factor,
                             backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)
        return Assign([scale.operation, tracker.operation], op.outputs, name="loss_scale_update")


def _k_found_inf(sum_squares):
    return (~torch.isfinite(sum_squares)).to(torch.float32)


class FoundInf(Operation):
    """1.0 if the float32 scalar ``x`` is inf or NaN, else 0.0 (float32 scalar). No gradient."""

    differentiable = False

    def __init__(self, x: Tensor, name=None):
        super().__init__([x], name=name or "found_inf")
        self.outputs = [Tensor(self, [], torch.float32)]

    def lower(self, lw):
        lw.set(self.outputs[0], lw.slicewise(_k_found_inf, lw.get(self.inputs[0])))


def _k_update_scale(scale, tracker, found_inf, *, growth_factor: float, backoff_factor: float, growth_interval: int):
    new_scale, new_tracker = scale.clone(), tracker.clone()
    torch._amp_update_scale_(new_scale, new_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    return new_scale, new_tracker


_k_update_scale.fresh_outputs = True


class UpdateLossScale(Operation):
    """The next loss scale and good-step count: ``torch._amp_update_scale_`` (``GradScaler.update``).

    Inputs: scale (float32 scalar), good-step count (int32 scalar), ``found_inf`` (float32 scalar). On
    ``found_inf`` = 1: scale x ``backoff_factor``, count 0; else count + 1, and at ``growth_interval`` scale x
    ``growth_factor`` (if finite) and count 0. No gradient.
    """

    differentiable = False

    def __init__(self, scale: Tensor, tracker: Tensor, found_inf: Tensor, *, growth_factor: float,
                 backoff_factor: float, growth_interval: int, name=None):
        super().__init__([scale, tracker, found_inf], name=name or "update_loss_scale")
        self.params = {"growth_factor": float(growth_factor), "backoff_factor": float(backoff_factor),
                       "growth_interval": int(growth_interval)}
        self.outputs = [Tensor(self, [], torch.float32, index=0), Tensor(self, [], torch.int32, index=1)]

    def lower(self, lw):
        kernel = functools.partial(_k_update_scale, **self.params)
        outs = lw.slicewise(kernel, *[lw.get(x) for x in self.inputs], num_outputs=2)
        for t, s in zip(self.outputs, outs, strict=True):
            lw.set(t, s)


def unscale_gradients(grads, scale: Tensor):
    """``(grads / scale, found_inf)``: the gradients of a scaled loss unscaled (``GradScaler.unscale_``), and
    1.0 if any of them holds an inf or NaN (float32 scalar, one all-reduce). None entries pass through.

    Built in the storage scope (with storage rules each gradient is reduce-scattered to its shard first).
    One multi-tensor multiply per dtype per processor (:class:`~meshtorch.optim.clip.ScaleGroup`).
    """
    grads = list(grads)
    present = [g for g in grads if g is not None]
    if not present:
        raise ValueError("unscale_gradients: every gradient is None.")
    with present[0].graph.storage_scope():
        found = FoundInf(GlobalSumOfSquares(present).outputs[0]).outputs[0]
        unscaled = iter(ScaleGroup(ew.reciprocal(scale), present).outputs)
    return [None if g is None else next(unscaled) for g in grads], found

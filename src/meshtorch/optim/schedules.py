"""Learning-rate schedules: graph functions of the step Tensor returning a float32 scalar Tensor.

Each ``schedule(step, ...)`` takes the step as a scalar Tensor (any numeric dtype; an optimizer
passes the float32 ``global_step`` read before its increment, so 0 at the first update, as Mesh
TF's ``learning_rate_schedules``) and returns a replicated float32 scalar Tensor. They are plain
slicewise graph ops on a scalar: no communication under any layout. To use one as a learning
rate, close over its arguments::

    opt = mtf.optim.AdamWOptimizer(lambda step: mtf.optim.cosine_decay_with_warmup(step, 3e-4, 100, 10000))

The formulas are computed in float32 from the step (no float64 op in a training step: float64 is slow on
GPUs); the step is exact in float32 up to 2^24 updates.
"""

from __future__ import annotations

import functools
import math

import torch

from meshtorch.core.graph import Tensor
from meshtorch.ops import elementwise as ew

__all__ = ["constant_schedule", "linear_warmup", "rsqrt_decay", "truncated_rsqrt", "cosine_decay_with_warmup",
           "product_schedule"]


def _check_step(step, who):
    if not isinstance(step, Tensor) or step.shape.ndims != 0:
        raise ValueError(f"{who}: step must be a scalar mtf Tensor (shape []), got {step!r}.")


def _k_schedule(s, *, fn, **params):
    """Kernel: ``fn(step, **params)`` computed in float32 from the int step ``s``."""
    return fn(s.to(torch.float32), **params).to(torch.float32)


def _constant(s, *, value):
    return torch.full_like(s, value)


def _linear_warmup(s, *, warmup, peak):
    return peak * torch.clamp(s / warmup, max=1.0)


def _rsqrt_decay(s, *, warmup, multiplier):
    return multiplier * torch.rsqrt(torch.clamp(s, min=warmup))


def _cosine_decay_with_warmup(s, *, warmup, total, peak, min_value):
    prog = torch.clamp((s - warmup) / (total - warmup), 0.0, 1.0)
    cos = min_value + (peak - min_value) * 0.5 * (1.0 + torch.cos(math.pi * prog))
    return torch.where(s < warmup, peak * s / max(warmup, 1.0), cos)


def _scalar_fn(step: Tensor, name: str, fn, **params) -> Tensor:
    """The scalar schedule ``fn(step, **params)``: one slicewise op (``fn`` module-level, params plain data)."""
    return ew.slicewise(functools.partial(_k_schedule, fn=fn, **params), [step], output_dtype=torch.float32,
                        name=name)


def constant_schedule(step: Tensor, value: float) -> Tensor:
    """``value`` at every step (Mesh TF ``learning_rate_schedules.constant``)."""
    _check_step(step, "constant_schedule")
    return _scalar_fn(step, "constant_schedule", _constant, value=float(value))


def linear_warmup(step: Tensor, warmup_steps: float, peak: float = 1.0) -> Tensor:
    """``peak * min(1, step / warmup_steps)`` (Mesh TF ``learning_rate_schedules.linear_warmup``).

    Raises:
        ValueError: if ``warmup_steps <= 0``.
    """
    _check_step(step, "linear_warmup")
    if warmup_steps <= 0:
        raise ValueError(f"linear_warmup: warmup_steps must be > 0, got {warmup_steps}.")
    return _scalar_fn(step, "linear_warmup", _linear_warmup, warmup=float(warmup_steps), peak=float(peak))


def rsqrt_decay(step: Tensor, warmup_steps: float = 10000, multiplier: float = 1.0) -> Tensor:
    """``multiplier / sqrt(max(step, warmup_steps))``: constant during warmup, then inverse-sqrt decay.

    Mesh TF ``learning_rate_schedules.truncated_rsqrt`` / T5's ``rsqrt_decay`` (Noam's schedule
    without the linear part; the Transformer paper's warmup is ``linear_warmup`` times this).

    Raises:
        ValueError: if ``warmup_steps <= 0``.
    """
    _check_step(step, "rsqrt_decay")
    if warmup_steps <= 0:
        raise ValueError(f"rsqrt_decay: warmup_steps must be > 0, got {warmup_steps}.")
    return _scalar_fn(step, "rsqrt_decay", _rsqrt_decay, warmup=float(warmup_steps), multiplier=float(multiplier))


truncated_rsqrt = rsqrt_decay  # Mesh TF's name


def cosine_decay_with_warmup(step: Tensor, peak: float, warmup_steps: float, total_steps: float,
                             min_value: float = 0.0) -> Tensor:
    """Linear warmup to ``peak`` over ``warmup_steps``, then half-cosine to ``min_value`` at ``total_steps``.

    ``step < warmup``: ``peak * step / warmup``; afterwards, with
    ``p = min(1, (step - warmup) / (total - warmup))``:
    ``min_value + (peak - min_value) * (1 + cos(pi p)) / 2`` (Loshchilov & Hutter 2017, SGDR,
    single cycle; ``torch.optim.lr_scheduler.CosineAnnealingLR`` after the warmup).

    Raises:
        ValueError: if ``warmup_steps < 0`` or ``total_steps <= warmup_steps``.
    """
    _check_step(step, "cosine_decay_with_warmup")
    if warmup_steps < 0 or total_steps <= warmup_steps:
        raise ValueError(f"cosine_decay_with_warmup: need 0 <= warmup_steps < total_steps, got warmup_steps="
                         f"{warmup_steps}, total_steps={total_steps}.")
    return _scalar_fn(step, "cosine_decay_with_warmup", _cosine_decay_with_warmup, warmup=float(warmup_steps),
                      total=float(total_steps), peak=float(peak), min_value=float(min_value))


def product_schedule(step: Tensor, *factors) -> Tensor:
    """Product of numbers and schedules ``fn(step)`` (Mesh TF ``product_learning_rate``).

    E.g. ``product_schedule(step, 0.01, lambda s: linear_warmup(s, 1000), lambda s: rsqrt_decay(s, 1000))``.
    """
    _check_step(step, "product_schedule")
    out = None
    for f in factors:
        term = f(step) if callable(f) else float(f)
        out = term if out is None else out * term
    if out is None:
        out = 1.0
    if not isinstance(out, Tensor):
        return constant_schedule(step, out)
    return out

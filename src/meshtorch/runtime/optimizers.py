"""``meshtorch train``'s ``--optimizer`` and ``--schedule`` as :mod:`meshtorch.optim` objects (also what
``meshtorch plan --optimizer`` plans)."""

from __future__ import annotations

import math

from meshtorch.optim import (
    AdafactorOptimizer,
    AdamOptimizer,
    AdamWOptimizer,
    MomentumOptimizer,
    SgdOptimizer,
    cosine_decay_with_warmup,
    linear_warmup,
    rsqrt_decay,
)

__all__ = ["learning_rate", "make_optimizer"]


def make_optimizer(args):
    """The optimizer named by ``--optimizer`` with the ``--schedule`` learning rate."""
    lr = learning_rate(args)
    if args.optimizer == "adamw":
        return AdamWOptimizer(lr, weight_decay=args.weight_decay)
    if args.optimizer == "adam":
        return AdamOptimizer(lr, weight_decay=args.weight_decay)
    if args.optimizer == "adafactor":
        return AdafactorOptimizer(learning_rate=None if args.lr <= 0 else lr)
    if args.optimizer == "momentum":
        return MomentumOptimizer(lr, 0.9)
    return SgdOptimizer(lr)


def learning_rate(args):
    """The ``--schedule`` learning rate: a float or a function of the step."""
    total = max(args.steps, 2)
    peak, warm = args.lr, min(max(args.warmup_steps, 1), total - 1)
    if args.schedule == "constant":
        lr = peak
    elif args.schedule == "linear-warmup":
        lr = lambda step: linear_warmup(step, warm, peak)  # noqa: E731
    elif args.schedule == "rsqrt":
        lr = lambda step: rsqrt_decay(step, warm, peak * math.sqrt(warm))  # noqa: E731
    else:
        lr = lambda step: cosine_decay_with_warmup(step, peak, warm, total)  # noqa: E731
    return lr

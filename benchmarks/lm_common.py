"""Shared pieces of the LM benchmarks: a meshtorch LM and its plain-PyTorch twin from the same weights."""

from __future__ import annotations

import math

import torch

import meshtorch as mtf
from meshtorch.models.transformer import build_lm
from meshtorch.testing.torch_lm import TorchLM


def cosine_lr(step: int, peak: float, warmup: int, total: int) -> float:
    """The same schedule as mtf.optim.cosine_decay_with_warmup, in Python (for torch.optim)."""
    if step < warmup:
        return peak * step / max(warmup, 1)
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * 0.5 * (1 + math.cos(math.pi * frac))


def meshtorch_lm(cfg, seed, lr, warmup, total, clip, mesh_shape="", layout="", optimizer="adamw"):
    """``optimizer``: "adamw" (cosine schedule, no weight decay) or "adafactor" (Mesh TF defaults)."""
    if optimizer == "adafactor":
        opt = mtf.optim.AdafactorOptimizer()
    else:
        opt = mtf.optim.AdamWOptimizer(lambda s: mtf.optim.cosine_decay_with_warmup(s, lr, warmup, total),
                                       weight_decay=0.0)
    lm = build_lm(cfg, seed=seed, optimizer=opt, clip_norm=clip)
    return lm, lm.lowering(mesh_shape, layout)


def torch_twin(cfg, lowering, lr, warmup, total, optimizer="adamw"):
    """``optimizer``: "adamw" (torch.optim.AdamW) or "adafactor" (torch.optim.Adafactor)."""
    model = TorchLM(cfg)
    model.load_state_dict({n.replace("/", "."): lowering.variable_value(n) for n in lowering.variable_names
                           if n != "global_step" and "/adam_" not in n and "_slot_" not in n})
    if optimizer == "adafactor":
        opt = torch.optim.Adafactor(model.parameters(), lr=lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_lr(s, lr, warmup, total) / lr)
    return model, opt, sched

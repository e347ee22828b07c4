"""Worker of tests/test_accumulate.py's gloo check (run by meshtorch.testing.spmd.run_spmd in each rank)."""

from __future__ import annotations

import torch

import meshtorch as mtf
from meshtorch.data.sharding import batch_slice
from meshtorch.models.transformer import build_lm, preset
from meshtorch.optim import SgdOptimizer
from meshtorch.optim.accumulate import accumulated_updates


def accumulate_job(batch: int, n: int) -> dict:
    """3 SGD steps of ``n`` microbatches of ``batch / n`` rows on ``data:2`` with FSDP storage; losses and weights."""
    micro = batch // n
    cfg = preset("tiny", num_layers=1, d_model=32, num_heads=2, d_kv=16, d_ff=64, length=16, batch_size=micro,
                 vocab_size=64)
    lm = build_lm(cfg, seed=0, optimizer=SgdOptimizer(0.5) if n == 1 else None, clip_norm=0.5 if n == 1 else None)
    acc = None if n == 1 else accumulated_updates(lm.graph, lm.loss, SgdOptimizer(0.5), n, clip_norm=0.5)
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.SpmdMeshImpl("data:2", "batch:data", storage="d_model:data")})
    data = torch.randint(0, 64, (3, batch, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for rows in data:
        total = 0.0
        for k in range(n):
            mb = rows[k * micro:(k + 1) * micro]
            feeds = {lm.inputs: batch_slice(mb[:, :-1], lw, lm.inputs),
                     lm.targets: batch_slice(mb[:, 1:], lw, lm.targets)}
            fetches = [lm.loss] + (lm.updates if acc is None else acc.fetches(k))
            total += float(lw.run(fetches, feeds=feeds, feed_slices=True)[0]) / n
        losses.append(total)
    names = [v.name for v in lm.graph.trainable_variables]
    return {"losses": losses, "weights": {name: lw.variable_value(name) for name in names}}


def accumulate_pair(batch: int, n: int) -> tuple[dict, dict]:
    """:func:`accumulate_job` of the whole batch in one step, then of ``n`` microbatches (one process group)."""
    return accumulate_job(batch, 1), accumulate_job(batch, n)

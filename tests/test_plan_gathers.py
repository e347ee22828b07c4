"""``--memory-limit`` drops the kept forward gather and the prefetch of FSDP's weight gathers when the plan does
not fit (issue 33): ``MeshSpec(reshard_after_forward="always", prefetch=0)`` (:data:`LEAN_GATHERS`) plans less
memory, a limit between the two plans' totals makes :func:`fit_memory_limit` choose it, and the run with it gives
the default run's losses while gathering the output projection twice per step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import meshtorch as mtf
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.models.transformer import LMConfig, build_lm
from meshtorch.planning.budget import LEAN_GATHERS, fit_memory_limit, plan_memory
from meshtorch.testing import rel_error

CFG = LMConfig(vocab_size=128, d_model=32, num_heads=2, d_kv=16, d_ff=64, num_layers=2, length=16, batch_size=4)
MESH, LAYOUT, STORAGE = "data:2", "batch:data", "d_model:data"
STEPS = 3


def build(remat: str):
    lm = build_lm(dataclasses.replace(CFG, remat=remat), seed=3, optimizer=mtf.optim.AdamWOptimizer(1e-2))
    return lm.graph, lm.mesh, [lm.loss] + lm.updates


def _run(**spec):
    """(losses, all-gathers of ``logits/kernel`` per step) of STEPS AdamW steps on the placement mesh."""
    lm = build_lm(CFG, seed=3, optimizer=mtf.optim.AdamWOptimizer(1e-2))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(MESH, LAYOUT, storage=STORAGE, **spec)})
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, CFG.vocab_size, (CFG.batch_size, CFG.length + 1), generator=g)
        losses.append(lw.run([lm.loss] + lm.updates, {lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})[0].item())
    gathers = sum(n for c, n in lw.counters.records.items()
                  if c.kind == "allgather" and "logits/kernel" in str(c.tensor))
    return losses, gathers / STEPS


def test_limit_between_the_plans_drops_kept_gather_and_prefetch_and_losses_are_unchanged():
    graph, mesh, fetches = build("none")
    default = plan_memory(graph, mesh, fetches, MESH, LAYOUT, STORAGE)
    lean = plan_memory(graph, mesh, fetches, MESH, LAYOUT, STORAGE, lean_gathers=True)
    assert lean.lean_gathers and not default.lean_gathers
    assert lean.total_bytes < default.total_bytes, (lean.total_bytes, default.total_bytes)
    # the default fits its own total: nothing dropped
    assert not fit_memory_limit(build, ["none"], MESH, LAYOUT, STORAGE, default.total_bytes)[2].lean_gathers
    limit = (lean.total_bytes + default.total_bytes) // 2
    remat, storage, rep = fit_memory_limit(build, ["none"], MESH, LAYOUT, STORAGE, limit)
    assert (remat, storage, rep.lean_gathers) == ("none", STORAGE, True)
    assert rep.total_bytes == lean.total_bytes <= limit
    base, kept = _run()
    dropped, regathered = _run(**LEAN_GATHERS)
    assert rel_error(torch.tensor(dropped), torch.tensor(base)) <= 1e-6, (dropped, base)
    assert base[-1] < base[0]  # it trains
    assert (kept, regathered) == (1, 2)  # the output projection: gathered once per step, then again for backward


def test_reshard_after_forward_values():
    assert MeshSpec(MESH, LAYOUT, storage=STORAGE, reshard_after_forward="always").reshard_after_forward == "always"
    assert MeshSpec(MESH, reshard_after_forward=0).reshard_after_forward is False
    with pytest.raises(ValueError, match="reshard_after_forward must be True, False or 'always'"):
        MeshSpec(MESH, reshard_after_forward="never")

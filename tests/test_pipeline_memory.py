"""The planner's per-rank memory of the stage executor (:func:`meshtorch.runtime.pipeline_exec.rank_memory`,
issue 32) against what the stage programs hold when run: the variables' tensors, the weights' gradient sums, and
the laid-out activations one forward run stashes; and 1F1B's total per rank below GPipe's (fewer microbatches in
flight)."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mtf
from meshtorch.core.schedules import build_schedule
from meshtorch.models.lm_stages import stage_programs
from meshtorch.models.transformer import preset
from meshtorch.runtime.pipeline_exec import rank_memory

S, M = 2, 4


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(v) for v in (x.values() if isinstance(x, dict) else x))


@pytest.fixture(scope="module")
def programs():
    cfg = preset("tiny", d_model=16, num_heads=2, d_kv=8, d_ff=32, length=8, vocab_size=30, num_layers=S,
                 batch_size=8)
    return stage_programs(cfg, S, M, 1, optimizer=lambda: mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0))


def test_planned_parts_are_what_the_programs_hold(programs):
    planned = rank_memory(build_schedule("1f1b", S, M), programs)
    ids = torch.randint(0, 30, (8 // M, 8))
    x = None
    for r, p in enumerate(programs):  # one virtual stage per rank
        lw = p.lowering
        assert planned[r]["variables"] == sum(_nbytes(lw.variable_value(n)) for n in lw.variable_names)
        assert planned[r]["gradients"] == sum(_nbytes(lw.variable_value(n)) for n in p.weights)
        feeds = {p.inputs: ids if r == 0 else x}
        if p.targets is not None:
            feeds[p.targets] = ids
        (x,), stash = lw.run_stashed([p.output], feeds, stash=p.saved)
        assert planned[r]["stash"] == _nbytes(feeds[p.inputs]) + _nbytes(stash)


def test_1f1b_plans_less_than_gpipe_per_rank(programs):
    gpipe = rank_memory(build_schedule("gpipe", S, M), programs)
    f1b = rank_memory(build_schedule("1f1b", S, M), programs)
    assert [g["in_flight"] for g in gpipe] == [M] * S and [f["in_flight"] for f in f1b] == [S - r for r in range(S)]
    for g, f in zip(gpipe, f1b, strict=True):
        assert f["total"] < g["total"]
        assert g["total"] - f["total"] == (g["in_flight"] - f["in_flight"]) * g["stash"]

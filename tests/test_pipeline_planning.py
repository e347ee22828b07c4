"""Planning a pipelined LM (issue 24): the plan's bubble fraction, collective-permutes and weights per processor,
the cost model's price of the bubble, the layout search's pipelined candidates, ``meshtorch plan --schedule`` and
the schedule table of ``docs/pipeline.md``.

Every expected number is independent arithmetic: the bubble ``(S-1)/(M*R+S-1)`` and the schedule from ``S``,
``M``, ``R``; bytes from the model's dims; weights and FLOPs from *unpipelined* LMs (whose layers the pipeline
stacks), never from the pipelined plan itself.
"""

from __future__ import annotations

import os
import re

import pytest

import meshtorch as mtf
from meshtorch.cli import main
from meshtorch.core.pipeline import PipelineSchedule
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import CostModel, estimate_time, plan_memory
from meshtorch.planning.pipeline import schedule_table
from meshtorch.runtime.plan_lm import plan_lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = dict(d_model=32, num_heads=2, d_kv=16, d_ff=64, length=16, vocab_size=64)


def _lm(**kw):
    return build_lm(preset("tiny", **{**BASE, **kw}), optimizer=mtf.optim.AdamWOptimizer(1e-3))


def _plan(lm, mesh, layout):
    return plan_memory(lm.graph, lm.mesh, [lm.loss] + lm.updates, mesh, layout, cost=CostModel())


def _layer_and_other_params(layers, batch):
    """Parameter counts (layers' share, the rest) of the unpipelined LM: a layer is what L+1 layers add."""
    one = sum(v.shape.size for v in _lm(num_layers=layers, batch_size=batch).graph.trainable_variables)
    more = sum(v.shape.size for v in _lm(num_layers=layers + 1, batch_size=batch).graph.trainable_variables)
    per_layer = more - one
    return per_layer * layers, one - per_layer * layers


@pytest.mark.parametrize("S,M,R,mesh,layout,data", [
    (2, 4, 1, "pipe:2", "stage:pipe", 1),
    (4, 8, 1, "pipe:4", "stage:pipe", 1),
    (2, 4, 2, "pipe:2", "stage:pipe", 1),
    (2, 4, 1, "pipe:2,data:2", "stage:pipe;batch:data", 2),
])
def test_plan_reports_bubble_permutes_and_weights_per_processor(S, M, R, mesh, layout, data):
    batch = 16
    lm = _lm(num_layers=S * R, batch_size=batch, pipeline_stages=S, microbatches=M, pipeline_repeats=R)
    rep = _plan(lm, mesh, layout)
    p = rep.pipeline
    assert p is not None and (p.stages, p.microbatches, p.repeats) == (S, M, R)
    assert p.iterations == M * R + S - 1
    assert p.bubble_fraction == pytest.approx((S - 1) / (M * R + S - 1), abs=1e-12)
    assert p.stage_axis == "pipe" and p.stage_split == S
    # the shift: one collective-permute per iteration after the first, forward and backward; each moves the
    # state slice [micro_batch, length, d_model] of one processor (float32)
    n, b = p.stage_collectives["collective_permute"]
    assert n == 2 * (M * R + S - 2)
    assert b == n * (batch // M // data) * BASE["length"] * BASE["d_model"] * 4
    # weights: 1/S of the stack (every layer's weights) plus the embeddings, final norm and logits, whole
    layer_params, other_params = _layer_and_other_params(S * R, batch)
    assert p.stacked_bytes_full == 4 * layer_params
    assert p.stacked_bytes == 4 * layer_params // S
    assert p.other_bytes == 4 * other_params
    assert rep.trainable_bytes == p.stacked_bytes + p.other_bytes
    text = rep.summary()
    assert f"bubble fraction (S-1)/(M*R+S-1) = {(S - 1) / (M * R + S - 1):.3f}" in text
    assert "weights per processor" in text and "collective_permute over pipe" in text


def test_unpipelined_plan_has_no_pipeline_section():
    rep = _plan(_lm(num_layers=2, batch_size=8), "data:2", "batch:data")
    assert rep.pipeline is None and "pipeline:" not in rep.summary()


@pytest.mark.parametrize("S,M,R", [(2, 4, 1), (4, 8, 1), (2, 4, 2)])
def test_cost_model_prices_every_iteration_of_the_bubble(S, M, R):
    """One step costs (M*R+S-1) iterations of one stage, not M*R: per processor, the pipelined einsum FLOPs are
    the unpipelined LM's outside the stack (A) plus (M*R+S-1)/(M*R*S) of its stack's (F), both measured on
    unpipelined LMs of L and 2L layers with the same per-block recompute; R > 1 adds the einsum that selects each
    stage's repeat ([stage, repeat, w] x one-hot [stage, repeat], forward, recompute and weight gradient:
    3 x 2 x R x w multiply-add FLOPs per processor and iteration, w = one layer's parameters)."""
    batch, L = 16, S * R
    f1 = _plan(_lm(num_layers=L, batch_size=batch, remat="block"), "", "").flops_per_processor
    f2 = _plan(_lm(num_layers=2 * L, batch_size=batch, remat="block"), "", "").flops_per_processor
    F, A = f2 - f1, 2 * f1 - f2
    it = M * R + S - 1
    w = _layer_and_other_params(1, batch)[0]
    select = 3 * 2 * R * w * it if R > 1 else 0
    lm = _lm(num_layers=L, batch_size=batch, pipeline_stages=S, microbatches=M, pipeline_repeats=R)
    rep = _plan(lm, f"pipe:{S}", "stage:pipe")
    assert rep.flops_per_processor == pytest.approx(A + it / (M * R * S) * F + select, rel=1e-9)
    cost = CostModel()
    assert estimate_time(rep, cost)["compute_s"] == pytest.approx(rep.flops_per_processor / cost.flop_rate)


def test_search_proposes_pipeline_layouts_on_a_pipe_mesh():
    cfg = preset("tiny", **BASE, num_layers=2, batch_size=16)
    lines: list[str] = []
    ranked = plan_lm(cfg, "pipe:2", search=True, print_fn=lines.append, cost=CostModel.cpu())
    piped = [(lay, r) for lay, r in ranked if r.pipeline is not None]
    assert piped, [lay for lay, _ in ranked]
    lay, r = piped[0]
    assert "stage:pipe" in lay
    M = 8  # the search's default: the largest divisor of the batch (16) up to 4 x 2 stages
    assert (r.pipeline.stages, r.pipeline.microbatches, r.pipeline.repeats) == (2, M, 1)
    assert r.pipeline.bubble_fraction == pytest.approx(1 / (M + 1))
    assert any("S=2 M=8 R=1" in line for line in lines)
    # ranked with the others by estimated time
    times = [rep.estimated_time["total_s"] for _, rep in ranked]
    assert times == sorted(times)
    # the search's microbatches, and none without pipelines
    ranked4 = plan_lm(cfg, "pipe:2", search=True, print_fn=lambda *a: None, microbatches=4)
    assert {r.pipeline.microbatches for _, r in ranked4 if r.pipeline} == {4}
    assert not any(r.pipeline for _, r in plan_lm(cfg, "pipe:2", search=True, print_fn=lambda *a: None,
                                                  pipelines=False))


def test_search_chooses_the_pipeline_when_only_it_fits_the_memory_limit():
    """Stacking the layers on ``stage`` halves the weights and the optimizer state on ``pipe:2`` and keeps one
    state per iteration (recompute): under a limit just above its total, no other layout fits, even with the
    FSDP storage rules the search tries, and the search picks ``stage:pipe``."""
    cfg = preset("tiny", **BASE, num_layers=2, batch_size=16)
    quiet = dict(print_fn=lambda *a: None, cost=CostModel.cpu())
    piped = _plan(_lm(num_layers=2, batch_size=16, pipeline_stages=2, microbatches=8), "pipe:2", "stage:pipe")
    limit = int(piped.total_bytes * 1.05)  # M = 8: the search's default for 16 sequences on 2 stages
    with pytest.raises(SystemExit, match="no legal layout"):
        plan_lm(cfg, "pipe:2", search=True, memory_limit=limit, pipelines=False, **quiet)
    ranked = plan_lm(cfg, "pipe:2", search=True, memory_limit=limit, **quiet)
    assert ranked[0][0] == "stage:pipe" and ranked[0][1].pipeline is not None
    assert all(r.total_bytes <= limit for _, r in ranked)


def test_search_skips_axes_that_cannot_pipeline_the_model():
    cfg = preset("tiny", **BASE, num_layers=3, batch_size=16)  # 3 layers: no 2-stage pipeline
    ranked = plan_lm(cfg, "pipe:2", search=True, print_fn=lambda *a: None)
    assert not any(r.pipeline for _, r in ranked)


def _expected_table(S, M, R):
    """Stage s works at iteration t on work item t - s (microbatch (t - s) mod M) while 0 <= t - s < M*R."""
    return [[(t - s) % M if 0 <= t - s < M * R else None for s in range(S)] for t in range(M * R + S - 1)]


def _parse_table(text):
    rows = [line for line in text.splitlines() if re.match(r"^\| \d+ \|", line)]
    return [[None if c.strip() == "-" else int(c) for c in row.strip("|").split("|")[1:]] for row in rows]


@pytest.mark.parametrize("S,M,R", [(4, 8, 1), (2, 3, 2)])
def test_schedule_table_is_gpipe_and_circular(S, M, R):
    assert _parse_table(schedule_table(PipelineSchedule(S, M, R))) == _expected_table(S, M, R)


def test_plan_cli_prints_the_schedule_and_refuses_microbatches_without_a_stage_rule(capsys):
    argv = ["plan", "--preset", "tiny", "--layers", "2", "--d-model", "32", "--d-ff", "64", "--length", "16",
            "--mesh", "pipe:2", "--hardware", "cpu"]
    assert main(argv + ["--layout", "stage:pipe", "--microbatches", "4", "--schedule"]) == 0
    out = capsys.readouterr().out
    assert _parse_table(out) == _expected_table(2, 4, 1)
    assert "bubble fraction (S-1)/(M*R+S-1) = 0.200" in out
    assert main(argv + ["--layout", "batch:pipe", "--microbatches", "4"]) != 0
    assert "stage:<mesh axis>" in capsys.readouterr().err


def test_docs_pipeline_table_is_what_the_code_prints():
    """docs/pipeline.md's schedule table is ``schedule_table(PipelineSchedule(4, 8, 1))`` (what ``meshtorch plan
    --mesh pipe:4 --layout stage:pipe --layers 4 --microbatches 8 --schedule`` prints)."""
    text = open(os.path.join(ROOT, "docs", "pipeline.md"), encoding="utf-8").read()
    m = re.search(r"<!-- schedule S=4 M=8 R=1 -->\n(.*?)\n<!-- /schedule -->", text, re.S)
    assert m, "docs/pipeline.md lost its schedule table markers"
    assert m.group(1).strip() == schedule_table(PipelineSchedule(4, 8, 1))
    assert _parse_table(m.group(1)) == _expected_table(4, 8, 1)


def test_pipeline_layout_candidates_cover_the_other_axes():
    from meshtorch.planning.search import pipeline_layouts

    lm = _lm(num_layers=2, batch_size=16, pipeline_stages=2, microbatches=4)
    lays = pipeline_layouts(lm.graph, "pipe:2,data:2", "pipe")
    assert lays[0] == "stage:pipe" or "stage:pipe" in lays
    assert all(lay.startswith("stage:pipe") for lay in lays)
    assert "stage:pipe;batch:data" in lays
    with pytest.raises(ValueError, match="no dimension 'stage'"):
        pipeline_layouts(_lm(num_layers=2, batch_size=16).graph, "pipe:2", "pipe")



@pytest.mark.parametrize("name,S,M,R", [("1f1b", 2, 4, 1), ("interleaved-1f1b", 2, 4, 2)])
def test_stage_executor_flops_are_the_useful_work(name, S, M, R):
    """The stage executor's planned FLOPs per rank (``meshtorch train --pipeline-schedule``): idle steps cost
    nothing and a ``B`` is given its ``F``'s stashed activations (recomputes no forward einsum), so all ranks
    together do M times one microbatch's forward-and-backward pass, measured on the *unpipelined* LM of one
    microbatch; rank r's share is its virtual stages'."""
    from meshtorch.autodiff import gradients
    from meshtorch.core.schedules import build_schedule
    from meshtorch.models.lm_stages import stage_programs
    from meshtorch.runtime.pipeline_exec import rank_flops

    cfg = preset("tiny", **BASE, num_layers=S * R, batch_size=16)
    lm = build_lm(preset("tiny", **BASE, num_layers=S * R, batch_size=16 // M))
    fetches = [lm.loss] + gradients([lm.loss], lm.graph.trainable_variables)
    lw = lm.lowering("data:2", "batch:data")
    step = lw.plan_counters(fetches).einsum_flops
    per_rank = rank_flops(build_schedule(name, S, M, R), stage_programs(cfg, S, M, R, "data:2", "batch:data"))
    assert sum(per_rank) == M * step
    assert per_rank[0] != per_rank[-1] and min(per_rank) > 0


def test_plan_cli_prints_the_stage_executors_flops(capsys):
    argv = ["plan", "--preset", "tiny", "--layers", "2", "--d-model", "32", "--d-ff", "64", "--length", "16",
            "--mesh", "pipe:2", "--hardware", "cpu", "--layout", "stage:pipe", "--microbatches", "4",
            "--pipeline-schedule", "zero-bubble"]
    assert main(argv) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "stage executor (zero-bubble" in x]
    assert len(line) == 1 and "idle steps priced at zero" in line[0], line
    # the bubble with actions timed by their FLOPs: the table's own weighting of the same costs
    from meshtorch.core.schedules import build_schedule
    from meshtorch.models.lm_stages import stage_programs
    from meshtorch.runtime.pipeline_exec import action_flops

    cfg = preset("tiny", d_model=32, d_ff=64, length=16, num_layers=2)  # the argv above
    bubble = build_schedule("zero-bubble", 2, 4).weighted(action_flops(stage_programs(cfg, 2, 4)))[1]
    assert f"bubble fraction with actions timed by their FLOPs {bubble:.3f}" in line[0]

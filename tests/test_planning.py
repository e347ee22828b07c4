"""meshtorch.planning: the memory/FLOPs/communication report vs what the lowering actually holds and
executes, the dry-run lowering, the layout search, and ``meshtorch plan``."""

import collections
import math

import pytest
import torch

import meshtorch as mtf
from meshtorch.lowering.executor import bind, run_steps
from meshtorch.planning import (
    CostModel,
    candidate_layouts,
    estimate_time,
    memory_report,
    search_layouts,
)

LAYOUTS = [("", ""), ("all:4", "batch:all"), ("all:4", "hidden:all"), ("all:4", "io:all"),
           ("rows:2;cols:2", "batch:rows;hidden:cols"), ("rows:2;cols:2", "hidden:rows;io:cols")]


def _mlp(batch=8, hidden=16, io=4, optimizer="adamw", seed=0):
    """x [batch, io] -> relu(x w1) w2 -> mean squared error vs t; (graph, mesh, fetches, (x, t))."""
    g = mtf.Graph(seed=seed)
    mesh = mtf.Mesh(g, "m")
    b, i, h = mtf.Dimension("batch", batch), mtf.Dimension("io", io), mtf.Dimension("hidden", hidden)
    x = mtf.placeholder(mesh, "x", [b, i])
    t = mtf.placeholder(mesh, "t", [b, i])
    w1 = mtf.get_variable(mesh, "w1", [i, h])
    w2 = mtf.get_variable(mesh, "w2", [h, i])
    y = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[b, h])), w2], output_shape=[b, i])
    loss = mtf.reduce_mean(mtf.square(y - t))
    fetches = [loss]
    if optimizer == "adamw":
        fetches += mtf.optim.AdamWOptimizer(1e-3).apply_grads(mtf.gradients([loss], [w1, w2]), [w1, w2])
    elif optimizer == "sgd":
        fetches += mtf.optim.SgdOptimizer(0.1).apply_grads(mtf.gradients([loss], [w1, w2]), [w1, w2])
    return g, mesh, fetches, (x, t)


def _feeds(phs, batch=8, io=4):
    gen = torch.Generator().manual_seed(1)
    return {p: torch.randn(batch, io, generator=gen) for p in phs}


def _held_bytes(lw, var) -> float:
    """Per-processor bytes the PlacementMeshImpl actually holds for ``var``."""
    slices = lw.variables[var]
    return sum(s.numel() * s.element_size() for s in slices) / len(slices)


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_variable_bytes_equal_the_slices_held(mesh_shape, layout):
    g, mesh, fetches, _ = _mlp()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    rep = memory_report(lw, fetches)
    assert set(rep.variables) == {v.name for v in lw.variables}
    for var in lw.variables:
        assert rep.variables[var.name] == _held_bytes(lw, var), var.name
    trainable = sum(_held_bytes(lw, v) for v in lw.variables if v.trainable)
    assert rep.trainable_bytes == trainable
    assert rep.non_trainable_bytes == sum(_held_bytes(lw, v) for v in lw.variables) - trainable
    assert rep.non_trainable_bytes > 2 * trainable - 1  # AdamW: m and v per parameter (+ the step counter)


def test_split_weights_take_a_quarter_of_the_replicated_bytes():
    g, mesh, fetches, _ = _mlp(optimizer=None)
    one = memory_report(mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}), fetches)
    four = memory_report(mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "hidden:all")}), fetches)
    assert one.variable_bytes == 2 * 4 * 16 * 4  # two float32 [4, 16] weights, whole
    assert four.variable_bytes * 4 == one.variable_bytes
    data = memory_report(mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")}), fetches)
    assert data.variable_bytes == one.variable_bytes  # data parallel replicates the weights


def _measured_peak(lw, fetches, feeds) -> int:
    """Run the planned steps one by one, tracking the bytes of live non-variable, non-constant slots."""
    prog = lw.plan(fetches)
    skip = set(lw.program.constants) | {s for _, s in prog.var_reads}
    env = dict(lw.session.constant_values)
    by_name = {t.name: t for t in feeds}
    for name, s in prog.placeholders:
        t = by_name[name]
        env[s] = lw.mesh_impl(t).import_full(feeds[t], lw.tensor_layout(t))
    for name, s in prog.var_reads:
        env[s] = lw.store.values[name]
    for s, (kind, _mesh, _) in lw.program.constants.items():
        if kind == "run_counter":
            env[s] = lw.mesh_impl(lw.graph.operations[0].mesh).laid_out_constant(lambda p: 0)

    held = {x.data_ptr() for _, s in prog.var_reads for x in env[s]}  # in-place updates write these

    def live():
        total = 0.0
        for s, v in env.items():
            if s in skip or v is None:
                continue
            total += sum(x.numel() * x.element_size() for x in v if x.data_ptr() not in held) / len(v)
        return total

    peak = live()
    bound = bind(prog.steps, [() for _ in prog.steps], lw.session.impls, lw.counters)
    for step, frees in zip(bound, prog.frees, strict=True):
        run_steps([step], env)
        peak = max(peak, live())
        for f in frees:
            env[f] = None
    return peak


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_peak_activations_match_a_measured_run(mesh_shape, layout):
    g, mesh, fetches, phs = _mlp()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    rep = memory_report(lw, fetches)
    measured = _measured_peak(lw, fetches, _feeds(phs))
    assert rep.estimated_slots == 0 and rep.peak_activation_bytes == measured
    prog = lw.plan(fetches)
    sizes = [lw.slot_bytes[o] for st in prog.steps for o in st.outputs]
    sizes += [lw.slot_bytes[s] for _, s in prog.placeholders]
    assert rep.largest_slot_bytes == max(sizes)
    assert rep.largest_slot_bytes <= rep.peak_activation_bytes <= sum(sizes)


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_planned_communication_and_flops_equal_the_executed(mesh_shape, layout):
    g, mesh, fetches, phs = _mlp()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    rep = memory_report(lw, fetches)
    lw.run(fetches, feeds=_feeds(phs))
    assert dict(rep.counters.records) == dict(lw.counters.records)
    assert rep.einsum_flops == lw.counters.einsum_flops
    # every einsum of the step: 2 * (product of its dims); forward 2, backward 3 (no gradient for x)
    b, h, i = 8, 16, 4
    assert rep.einsum_flops == 5 * 2 * b * h * i
    n = lw.mesh_to_impl[mesh].size
    assert rep.einsum_flops / n <= rep.flops_per_processor <= rep.einsum_flops


def test_flops_per_processor_by_layout():
    g, mesh, fetches, _ = _mlp(optimizer="sgd")
    full = 5 * 2 * 8 * 16 * 4
    for mesh_shape, layout, want in [("", "", full), ("all:4", "batch:all", full // 4),
                                     ("rows:2;cols:2", "batch:rows", full // 2),
                                     ("rows:2;cols:2", "batch:rows;hidden:cols", full // 4)]:
        rep = memory_report(mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}), fetches)
        assert rep.flops_per_processor == want, layout


def test_dry_run_allocates_nothing_and_plans_the_same():
    g, mesh, fetches, _ = _mlp()
    impl = mtf.PlacementMeshImpl("rows:2;cols:2", "batch:rows;hidden:cols")
    real = mtf.Lowering(g, {mesh: impl})
    dry = mtf.Lowering(g, {mesh: impl}, materialize=False)
    assert dry.variables and all(v is None for v in dry.variables.values())
    assert all(v is not None for v in real.variables.values())
    assert dry.program_str() == real.program_str()
    a, b = memory_report(real, fetches), memory_report(dry, fetches)
    assert dict(a.counters.records) == dict(b.counters.records)
    for f in ("variables", "trainable_bytes", "non_trainable_bytes", "constant_bytes", "peak_activation_bytes",
              "einsum_flops", "flops_per_processor"):
        assert getattr(a, f) == getattr(b, f), f
    with pytest.raises(RuntimeError, match="materialize"):
        dry.run(fetches)


@pytest.mark.parametrize("layout", ["batch:data;heads:model;d_ff:model;vocab:model", "d_model:model"])
def test_report_on_the_lm_matches_the_lowering_and_a_measured_run(layout):
    from meshtorch.models.transformer import build_lm, preset
    cfg = preset("tiny", num_layers=1, length=16, batch_size=4, vocab_size=64)
    lm = build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("data:2,model:2", layout)})
    fetches = [lm.loss] + lm.updates
    rep = memory_report(lw, fetches)
    assert rep.trainable_bytes == sum(_held_bytes(lw, v) for v in lw.variables if v.trainable)
    assert rep.variable_bytes == sum(_held_bytes(lw, v) for v in lw.variables)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    feeds = {lm.inputs: ids, lm.targets: ids}
    measured = _measured_peak(lw, fetches, feeds)
    assert measured <= rep.peak_activation_bytes <= 1.25 * measured  # a few slot sizes are estimated
    lw.run(fetches, feeds=feeds)
    assert dict(rep.counters.records) == dict(lw.counters.records)
    assert "allreduce" in rep.summary() and "peak activations" in rep.summary()


@pytest.mark.parametrize("mesh_shape,layout,split", [("", "", 1), ("all:4", "big:all", 4)])
def test_peak_includes_a_loop_body(mesh_shape, layout, split):
    """A loop whose body builds a [b:4, big:1024] float32 value (16 KiB whole) from [b:4, h:8] ones."""
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "m")
    x = mtf.get_variable(mesh, "x", "b:4,h:8")
    w = mtf.get_variable(mesh, "w", "h:8,big:1024")
    v = mtf.get_variable(mesh, "v", "big:1024,h:8")

    def body(i, y):
        wide = mtf.tanh(mtf.einsum([y, w], output_shape="b:4,big:1024"))
        return [i + mtf.constant(mesh, 1, dtype=torch.int64), mtf.einsum([wide, v], output_shape="b:4,h:8")]

    _, y = mtf.while_loop(lambda i, y: mtf.less(i, mtf.constant(mesh, 3, dtype=torch.int64)), body,
                          [mtf.constant(mesh, 0, dtype=torch.int64), x * 1.0])
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}, materialize=False)
    rep = memory_report(lw, y)
    wide = 4 * 1024 * 4 // split
    assert rep.largest_slot_bytes == wide
    assert wide <= rep.peak_activation_bytes <= 3 * wide  # the einsum and the tanh outputs, plus small ones


def test_cost_model_formulas():
    c = mtf.Collective("allreduce", ("all",), "op", "t", 1000, 4, "SUM")
    cm = CostModel(flop_rate=1e9, bandwidth=1e6, latency=1e-3)
    assert cm.collective_time(c, 4) == pytest.approx(1e-3 + 2 * 3 / 4 * 1000 / 1e6)
    gather = mtf.Collective("allgather", ("all",), "op", "t", 1000, 4)
    assert cm.collective_time(gather, 4) == pytest.approx(1e-3 + 3 * 1000 / 1e6)
    assert cm.collective_time(c, 1) == 0.0
    g, mesh, fetches, _ = _mlp(optimizer="sgd")
    rep = memory_report(mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")}), fetches)
    t = estimate_time(rep, cm)
    assert t["compute_s"] == pytest.approx(rep.flops_per_processor / 1e9)
    want = sum(n * (1e-3 + 1.5 * c.bytes_per_processor / 1e6) for c, n in rep.counters.records.items())
    assert t["comm_s"] == pytest.approx(want) and t["total_s"] == pytest.approx(t["comm_s"] + t["compute_s"])


def test_candidates_are_one_dim_per_axis_without_symmetric_duplicates():
    cands = candidate_layouts(["batch", "hidden"], ["a", "b"], {"batch": {4}, "hidden": {6}}, {"a": 2, "b": 2})
    assert "" in cands and "batch:a" in cands and "batch:a;hidden:b" in cands
    assert "hidden:a;batch:b" not in cands and "batch:b" not in cands  # same cost as kept ones (axes equal)
    assert len(cands) == len(set(cands)) == 4
    assert candidate_layouts(["batch", "hidden"], ["a"], {"batch": {4}, "hidden": {3}}, {"a": 2}) == ["batch:a", ""]


def test_search_prefers_data_parallel_for_a_big_batch_and_small_weights():
    ranked = search_layouts(lambda: _mlp(batch=65536, hidden=256, io=64, optimizer="sgd")[:3], "all:4")
    layouts = [lay for lay, _ in ranked]
    assert layouts[0] == "batch:all"
    assert set(layouts) == {"", "batch:all", "hidden:all", "io:all"}
    times = [r.estimated_time["total_s"] for _, r in ranked]
    assert times == sorted(times)


def test_search_prefers_splitting_hidden_when_the_weights_dominate():
    ranked = search_layouts(lambda: _mlp(batch=64, hidden=16384, io=1024, optimizer="sgd")[:3], "all:4")
    assert ranked[0][0] == "hidden:all"
    data = dict(ranked)["batch:all"]
    assert data.estimated_time["comm_s"] > 10 * ranked[0][1].estimated_time["comm_s"]


def test_memory_limit_excludes_replicated_weights():
    build = lambda: _mlp(batch=64, hidden=16384, io=1024, optimizer="sgd")[:3]  # noqa: E731
    everything = dict(search_layouts(build, "all:4"))
    replicated_weights = everything[""].variable_bytes
    limit = replicated_weights - 1
    kept = dict(search_layouts(build, "all:4", memory_limit_bytes=limit))
    assert "" not in kept and "batch:all" not in kept  # both hold every weight whole
    assert "hidden:all" in kept and all(r.total_bytes <= limit for r in kept.values())
    with pytest.raises(ValueError, match="memory limit"):
        search_layouts(build, "all:4", memory_limit_bytes=1000)


def test_search_drops_illegal_layouts():
    # batch 6 does not divide by 4, and no candidate may split it
    ranked = search_layouts(lambda: _mlp(batch=6, hidden=16, io=4, optimizer=None)[:3], "all:4",
                            candidate_rules=["batch:all", "hidden:all", ""])
    assert [lay for lay, _ in ranked if lay == "batch:all"] == []
    assert {lay for lay, _ in ranked} == {"hidden:all", ""}


def test_greedy_refinement_finds_several_dims_on_one_axis():
    from meshtorch.models.transformer import build_lm, preset
    cfg = preset("tiny", num_layers=1, d_model=1024, num_heads=16, d_kv=64, d_ff=4096, length=256, batch_size=32,
                 vocab_size=32000)
    lm = build_lm(cfg, optimizer=mtf.optim.SgdOptimizer(0.1))  # big, but a dry run allocates nothing
    refined = search_layouts(lambda: lm, "data:2,model:2")
    plain = search_layouts(lambda: lm, "data:2,model:2", refine=0)
    assert all(max(collections.Counter(a for _, a in _pairs(lay)).values(), default=0) <= 1 for lay, _ in plain)
    best, rep = refined[0]
    assert max(collections.Counter(a for _, a in _pairs(best)).values()) >= 2  # e.g. heads:model;d_ff:model
    assert rep.estimated_time["total_s"] < plain[0][1].estimated_time["total_s"]
    again = memory_report(mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("data:2,model:2", best)},
                                       materialize=False), [lm.loss] + lm.updates)
    assert estimate_time(again)["total_s"] == pytest.approx(rep.estimated_time["total_s"])


def _pairs(rules):
    return [tuple(p.split(":")) for p in rules.split(";") if p]


def test_plan_cli_reports_and_searches(capsys):
    from meshtorch.cli import main
    args = ["plan", "--preset", "tiny", "--layers", "1", "--length", "16", "--batch-size", "4", "--vocab", "64"]
    main(args)
    out = capsys.readouterr().out
    for word in ("parameters", "optimizer state", "peak activations", "FLOPs", "allreduce"):
        assert word in out
    main(args + ["--search", "--top", "3"])
    out = capsys.readouterr().out
    assert "legal layouts" in out and out.count("\n") >= 5
    lines = out.splitlines()
    rows = lines[next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["rank", "layout"]) + 1:][:3]
    assert len(rows) == 3 and math.isfinite(float(rows[-1].split()[2]))
    assert "why: " in out and "rank " in out.splitlines()[-1]  # the winner explained, --layout placed
    assert main(args + ["--layout", "batch:data;length:model"]) == 2  # attention needs length whole
    assert "length" in capsys.readouterr().err


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_update_peak_is_the_gradients_plus_one_variable_and_a_measured_run_agrees(mesh_shape, layout):
    """Big weights, tiny batch: the peak is at the AdamW update. Updated in place (one processor, or replicas
    sharing one call), it holds the gradients and no second copy of w, m, v (a copying update: + 3 x the
    parameters); the planned peak equals the bytes a run holds, step by step."""
    g, mesh, fetches, phs = _mlp(batch=4, hidden=256, io=32)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    rep = memory_report(lw, fetches)
    assert rep.peak_activation_bytes == _measured_peak(lw, fetches, _feeds(phs, batch=4, io=32))
    largest = max(rep.variables.values())
    assert rep.peak_activation_bytes <= rep.gradient_bytes + 2 * largest, rep.summary()

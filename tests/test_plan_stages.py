"""A program's stages as values (issue 34): ``plan`` -> Program -> ``bind`` -> Session.

``plan`` builds no backend, variable store or Lowering (constructions counted during ``meshtorch plan
--search`` and ``--memory-limit``); its memory report equals the one read through a Lowering on a real placement
backend (the constants' bytes checked against the tensors that backend evaluates); a bound program runs to the
same values as the Lowering facade.
"""

import dataclasses

import pytest
import torch

import meshtorch as mtf
from meshtorch.cli import main
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering import Lowering, PlanOptions, VariableStore, bind, plan
from meshtorch.lowering.session import Session
from meshtorch.mesh.base import MeshImpl
from meshtorch.mesh.factory import placement_mesh_impl
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import memory_report

TINY = dict(num_layers=2, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=8, batch_size=4, vocab_size=32)


@pytest.fixture
def constructions(monkeypatch):
    """Counts of ``__init__`` calls of the executing classes while the test runs."""
    counts = {}
    for cls in (Lowering, VariableStore, Session, MeshImpl):
        orig = cls.__init__

        def counted(self, *a, _orig=orig, _name=cls.__name__, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(cls, "__init__", counted)
    return counts


def test_plan_search_and_memory_limit_build_no_executor(constructions, capsys):
    main(["plan", "--preset", "base", "--layers", "1", "--length", "32", "--mesh", "data:2,model:2", "--search",
          "--top", "3", "--hardware", "cpu"])
    out = capsys.readouterr().out
    assert "legal layouts" in out and "(yours, or train's default): rank" in out
    main(["plan", "--preset", "base", "--layers", "1", "--length", "32", "--mesh", "data:2,model:2", "--layout",
          "batch:data", "--memory-limit", "15MiB", "--hardware", "cpu"])
    assert "memory limit" in capsys.readouterr().out
    assert constructions == {}, constructions
    placement_mesh_impl("data:2")  # the counter sees a construction when there is one
    assert constructions == {"MeshImpl": 1}


def _lm(**kw):
    return build_lm(preset("tiny", **{**TINY, **kw}), optimizer=mtf.optim.AdamWOptimizer(1e-3))


@pytest.mark.parametrize("mesh_shape,layout,storage", [
    ("data:2,model:2", "batch:data;heads:model;d_ff:model", ""),
    ("data:2,model:2", "batch:data;vocab:model", "d_model:data"),
    ("all:4", "batch:all", ""),
    ("", "", ""),
])
def test_program_report_equals_lowering_report(mesh_shape, layout, storage):
    lm = _lm()
    fetches = [lm.loss] + lm.updates
    spec = MeshSpec(mesh_shape, layout, storage=storage or None)
    lw = Lowering(lm.graph, {lm.mesh: placement_mesh_impl(spec)}, materialize=False)
    want = memory_report(lw, fetches)  # the session's schedule on a real placement backend
    got = memory_report(plan(lm.graph, fetches, spec))
    for f in dataclasses.fields(want):
        if f.name != "counters":
            assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert got.counters.records == want.counters.records and got.counters.einsum_flops == want.counters.einsum_flops
    # constants: the bytes of the tensors the backend evaluates, per processor
    real = lw.session.constant_values.values()
    per_proc = sum(sum(t.numel() * t.element_size() for t in v if isinstance(t, torch.Tensor)) / len(v)
                   for v in real if isinstance(v, list) and v)
    assert got.constant_bytes == int(per_proc)


def test_program_report_refuses_fetches_and_plan_refuses_foreign_fetch():
    lm = _lm()
    program = plan(lm.graph, [lm.loss], MeshSpec("data:2", "batch:data"))
    with pytest.raises(ValueError, match="plan these fetches"):
        memory_report(program, [lm.loss])
    other = _lm()
    with pytest.raises(ValueError, match="not part of this lowering"):
        plan(lm.graph, [other.loss], MeshSpec("data:2", "batch:data"))
    with pytest.raises(ValueError, match="local must be None"):
        PlanOptions(local=2)


def test_bound_program_runs_as_the_lowering():
    torch.manual_seed(0)
    lm = _lm()
    spec = MeshSpec("data:2,model:2", "batch:data;heads:model")
    feeds = {lm.inputs: torch.randint(0, 32, (4, 8)), lm.targets: torch.randint(0, 32, (4, 8))}
    lw = Lowering(lm.graph, {lm.mesh: spec})
    want = [lw.run([lm.loss] + lm.updates, feeds)[0] for _ in range(2)]
    program = plan(lm.graph, [lm.loss] + lm.updates, spec)
    session = bind(program, {lm.mesh.name: placement_mesh_impl(spec)})
    named = {t.name: v for t, v in feeds.items()}
    got = [session.run(program.fetches, named)[0] for _ in range(2)]
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # same initial values, same two steps
    assert got[1] < got[0]
    with pytest.raises(ValueError, match="planned as"):
        bind(program, {lm.mesh.name: placement_mesh_impl(MeshSpec("data:4", "batch:data"))})


def test_search_plans_one_of_each_axis_swap_and_ranks_as_planning_all():
    """Layouts equal up to swapping mesh axes of one size are planned once; every candidate planned on its own
    (the reference) gives the same memory and time for both twins and the same ranking."""
    from meshtorch.planning import CostModel, estimate_time, search_layouts
    from meshtorch.planning.search import layout_key

    lm = _lm()
    fetches = [lm.loss] + lm.updates
    mesh_shape = "a:2,b:2"
    cands = ["batch:a;heads:b", "batch:b;heads:a", "batch:a", "batch:b", "heads:a;d_ff:a", "heads:b;d_ff:b",
             "batch:a;d_ff:b", "d_ff:a;batch:b", "vocab:a;batch:b"]
    cost = CostModel.cpu()
    planned = []
    real_plan = plan

    def counting_plan(graph, f, spec, options=None):
        planned.append(str(next(iter(spec.values())).layout_rules))
        return real_plan(graph, f, spec, options)
    import meshtorch.planning.search as search_mod
    orig, search_mod.plan = search_mod.plan, counting_plan
    try:
        got = search_layouts(lambda: lm, mesh_shape, candidate_rules=cands, cost=cost)
    finally:
        search_mod.plan = orig
    assert len(planned) == 5  # one per class of twins
    reps = {}
    for rules in cands:
        r = memory_report(plan(lm.graph, fetches, MeshSpec(mesh_shape, rules)))
        r.estimated_time = estimate_time(r, cost)
        reps[rules] = r
    sizes = {"a": 2, "b": 2}
    for x in cands:
        for y in cands:
            if layout_key(x, "", sizes) == layout_key(y, "", sizes):
                assert reps[x].estimated_time == reps[y].estimated_time and reps[x].total_bytes == reps[y].total_bytes
    want, seen = [], set()
    for rules in sorted(cands, key=lambda c: (reps[c].estimated_time["total_s"], reps[c].total_bytes)):
        if layout_key(rules, "", sizes) not in seen:
            seen.add(layout_key(rules, "", sizes))
            want.append(rules)
    assert [lay for lay, _ in got] == want
    for lay, r in got:
        assert r.estimated_time == reps[lay].estimated_time and r.summary() == reps[lay].summary()

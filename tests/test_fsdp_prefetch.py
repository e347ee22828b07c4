"""FSDP prefetch (issue 12): weight all-gathers issued one gather ahead of their use.

The plan order is checked against its definition (each weight gather k+1 is issued before the first
use of weight gather k, nothing is used before it is produced), results against the unprefetched
plan (the same kernels in another order: bitwise equal), and the planner's memory walk against the
extra gathered weight prefetching keeps alive. The asynchronous SPMD runs are in test_fsdp.py
(``async`` keys of the gloo job).
"""

from __future__ import annotations

import pytest
import torch

import meshtorch as mtf
from _fsdp import BUCKET_BYTES, LAYOUTS, build, data, train
from meshtorch.lowering.program import Step
from meshtorch.lowering.schedule import prefetch_gathers
from meshtorch.planning.memory import _walk, memory_report


def _weight_gathers(steps):
    """Indices of all-gathers whose inputs depend on no computed activation (the definition)."""
    made = {o: i for i, st in enumerate(steps) for o in st.outputs}
    static = []
    for st in steps:
        static.append(st.kind in ("slicewise", "allgather") and all(s not in made or static[made[s]]
                                                                   for s in st.inputs))
    return [i for i, st in enumerate(steps) if static[i] and st.kind == "allgather"]


def _plan(name, prefetch):
    mesh_shape, layout, storage = LAYOUTS[name]
    lm, _, _, updates = build("adamw_clip")
    impl = mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage, prefetch=prefetch)
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl})
    return lm, updates, lw


@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp"])
def test_prefetched_plan_issues_each_gather_before_the_previous_one_is_used(name):
    lm, updates, lw = _plan(name, 1)
    steps = lw.plan([lm.loss] + updates).steps
    made = {}
    for i, st in enumerate(steps):  # a valid order: every input produced earlier (or read from the run's start)
        for s in st.inputs:
            assert made.get(s, -1) < i, (i, st.op)
        made.update((o, i) for o in st.outputs)
    gathers = _weight_gathers(steps)
    assert len(gathers) > 10
    for g, nxt in zip(gathers, gathers[1:], strict=False):
        first_use = min(i for i, st in enumerate(steps) if set(st.inputs) & set(steps[g].outputs))
        assert nxt < first_use, (steps[g].op, steps[nxt].op)


@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp"])
def test_prefetch_changes_order_and_memory_not_results(name):
    runs = {}
    for prefetch in (0, 1):
        lm, updates, lw = _plan(name, prefetch)
        fetches = [lm.loss] + updates
        peak = memory_report(lw, fetches).peak_activation_bytes
        losses = [lw.run(fetches, feeds=dict(zip((lm.inputs, lm.targets), data(s), strict=True)))[0].item()
                  for s in range(3)]
        runs[prefetch] = (peak, losses, {n: lw.variable_value(n) for n in lw.variable_names},
                          [st.op for st in lw.plan(fetches).steps])
    assert runs[1][3] != runs[0][3] and sorted(runs[1][3]) == sorted(runs[0][3])  # same steps, other order
    assert runs[1][1] == runs[0][1]
    for n, v in runs[0][2].items():
        assert torch.equal(runs[1][2][n], v), n
    # prefetching holds one more gathered weight at the peak, at most the largest gathered weight more
    assert runs[0][0] <= runs[1][0]


def test_prefetch_gathers_on_a_hand_made_program():
    """Slots 0, 1, 2 are read at the start; gathers g0 (of 0) and g1 (of a cast of 1) feed compute steps."""
    def step(kind, op, ins, outs):
        return Step(kind, op, tuple(ins), tuple(outs), "m")
    steps = [step("allgather", "g0", [0], [10]),
             step("slicewise", "use0", [10, 2], [11]),
             step("slicewise", "act", [11], [12]),
             step("slicewise", "cast1", [1], [13]),
             step("allgather", "g1", [13], [14]),
             step("slicewise", "use1", [14, 12], [15]),
             step("allgather", "g_act", [15], [16])]  # gathers an activation: never moved
    order = [st.op for st in prefetch_gathers(steps, 1)]
    assert order == ["g0", "cast1", "g1", "use0", "act", "use1", "g_act"]
    assert prefetch_gathers(steps, 0) is steps


def test_negative_prefetch_is_refused():
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        mtf.PlacementMeshImpl("data:2", "batch:data", storage="d_model:data", prefetch=-1)


@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp"])
def test_buckets_merge_weight_gathers_and_gradient_reduce_scatters(name):
    """FSDP's flat-parameter buckets: fewer collective calls, the same collectives counted, the same numbers
    (the placement mesh runs each bucket member's collective in turn: bitwise equal)."""
    mesh_shape, layout, storage = LAYOUTS[name]
    plain = train(mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage), "adamw_clip", steps=3)
    bucketed = train(mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage), "adamw_clip", steps=3,
                     bucket_bytes=BUCKET_BYTES)
    assert bucketed[0] == plain[0]
    assert all(torch.equal(bucketed[1][n], v) for n, v in plain[1].items())
    assert bucketed[2] == plain[2]  # counters: every member's collective, bytes unchanged
    lm, _, _, updates = build("adamw_clip")
    kinds = {}
    for cap in (0, BUCKET_BYTES):
        lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)},
                          bucket_bytes=cap)
        steps = lw.plan([lm.loss] + updates).steps
        kinds[cap] = [st.kind for st in steps]
        if cap:
            for st in steps:
                if st.kind == "reduce_scatter_bucket":  # at most cap bytes of unsharded gradients
                    assert 2 <= len(st.inputs)
                    assert sum(c.bytes_per_processor for c in _members(st, lw)) <= cap
                if st.kind == "allgather_bucket":  # at most cap bytes of gathered weights (FSDP2's unit)
                    assert 2 <= len(st.inputs)
                    assert sum(lw.program.slot_bytes[o] for o in st.outputs) <= cap
    calls = {cap: sum(k in ("allgather", "allgather_bucket") for k in ks) for cap, ks in kinds.items()}
    assert "allgather_bucket" in kinds[BUCKET_BYTES] and "reduce_scatter_bucket" in kinds[BUCKET_BYTES]
    assert calls[BUCKET_BYTES] < calls[0] / 2


def _members(bucket_step, lw):
    """The collective records of a bucket's members (the unbucketed plan's steps with the same outputs)."""
    plain = {o: st for st in lw.program.steps for o in st.outputs}
    return [plain[o].collective for o in bucket_step.outputs]


def test_memory_walk_counts_the_buffers_collectives_pack():
    """While a bucketed all-gather unpacks its members it holds its packed local slices and the gathered flat
    buffer beside the members' outputs (SpmdMeshImpl.allconcat_many); a single gather on axis 0 holds nothing
    more, one on another axis its flat buffer; a reduce-scatter off axis 0 its moved input."""
    sizes = {1: 10, 2: 20, 3: 40, 4: 80}

    def peak(st):
        return _walk([st], [()], sizes.get, {}, live=30)[0]
    bucket = Step("allgather_bucket", "b", (1, 2), (3, 4), "m", params={"mesh_axis": 0, "concat_axes": (0, 1)})
    assert peak(bucket) == 30 + 120 + (30 + 120)
    assert peak(Step("allgather", "g", (1,), (3,), "m", params={"mesh_axis": 0, "concat_axis": 0})) == 30 + 40
    assert peak(Step("allgather", "g", (1,), (3,), "m", params={"mesh_axis": 0, "concat_axis": 1})) == 30 + 80
    rs = Step("reduce_scatter", "r", (4,), (1,), "m", params={"mesh_axis": 0, "scatter_axis": 1})
    assert peak(rs) == 30 + 10 + 80

"""The stage executor (:mod:`meshtorch.runtime.pipeline_exec` over :mod:`meshtorch.models.lm_stages`, issue 32):
the LM cut into one program per virtual stage, run in each schedule table's order on a placement mesh, against
the *unpipelined* LM's loss and gradients (one graph, :func:`meshtorch.autodiff.gradients`, the same mesh and
layout), with data parallelism and FSDP storage inside each stage; the transfers the flight recorder counts
against the table's."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from meshtorch.autodiff import gradients
from meshtorch.core.schedules import build_schedule
from meshtorch.mesh.recorder import flight_recorder
from meshtorch.models.lm_stages import stage_programs
from meshtorch.models.transformer import build_lm, preset
from meshtorch.runtime import pipeline_exec
from meshtorch.runtime.pipeline_exec import SEND, run_schedule
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

MESH, LAYOUT, STORAGE = "data:2", "batch:data", "d_model:data"  # inside each stage: data parallel + FSDP
BATCH = 16


def _cfg(layers):
    return preset("tiny", d_model=16, num_heads=2, d_kv=8, d_ff=32, length=8, vocab_size=30, num_layers=layers,
                  batch_size=BATCH)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 30, (BATCH, 8), generator=g), torch.randint(0, 30, (BATCH, 8), generator=g)


@functools.cache
def _reference(layers):
    """The unpipelined LM's loss and gradients by variable name (the same initial values: drawn by name)."""
    lm = build_lm(_cfg(layers))
    ws = lm.graph.trainable_variables
    ids, tg = _batch()
    fetches = [lm.loss] + gradients([lm.loss], ws)  # before the lowering, which takes the graph as it is
    out = lm.lowering(MESH, LAYOUT).run(fetches, feeds={lm.inputs: ids, lm.targets: tg})
    return float(out[0]), {w.name: g for w, g in zip(ws, out[1:], strict=True)}


@functools.cache
def _programs(S, M, R, per=1):
    return stage_programs(_cfg(S * R * per), S, M, R, MESH, LAYOUT, STORAGE)


@pytest.mark.parametrize("name,S,M,R,per", [
    ("gpipe", 2, 4, 1, 1), ("1f1b", 2, 4, 1, 1), ("gpipe", 2, 4, 2, 1), ("interleaved-1f1b", 2, 4, 2, 1),
    ("zero-bubble", 2, 4, 1, 1), ("zero-bubble", 2, 4, 2, 1),
    ("gpipe", 4, 8, 1, 1), ("1f1b", 4, 8, 1, 1), ("1f1b", 4, 4, 1, 1), ("interleaved-1f1b", 4, 8, 2, 1),
    ("zero-bubble", 4, 8, 1, 1), ("zero-bubble", 2, 8, 2, 1), ("1f1b", 2, 4, 1, 2),
])
def test_schedule_order_gives_the_unpipelined_loss_and_gradients(name, S, M, R, per):
    """``per``: layers per virtual stage."""
    table = build_schedule(name, S, M, R)
    ids, tg = _batch()
    flight_recorder().sink = records = []
    try:
        run = run_schedule(table, _programs(S, M, R, per), ids, tg)
    finally:
        flight_recorder().sink = None
    loss, grads = _reference(S * R * per)
    assert abs(run.loss - loss) <= 1e-6
    assert set(run.grads) == set(grads)
    for n, g in grads.items():
        assert (run.grads[n] - g).abs().max().item() <= 1e-6, n
    # each rank ran its actions in the table's order, held the table's stashes, and sent what the table sends
    assert run.actions == [list(o) for o in table.order]
    assert [[n for n, c, *_ in evs if c == "action"] for evs in run.events] == [[str(a) for a in o]
                                                                                 for o in table.order]
    assert run.peak_stash == table.in_flight()
    sends = [rec for rec in records if rec.kind == SEND]
    assert len(sends) == len(table.sends()) == 2 * M * (S * R - 1)
    # each the hidden state of one microbatch, [batch/M, length, d_model] float32, over the stage axis
    assert {(rec.mesh_axes, rec.parts) for rec in sends} == {(("pipe",), (BATCH // M * 8 * 16 * 4,))}


def test_a_skipped_send_fails(monkeypatch):
    """An executor that drops one transfer fails at the action that needs it, naming it (the recorder's count
    above would also miss it)."""
    real, dropped = pipeline_exec._Executor.send, []

    def send(self, store, key, value, src, dst, tag):
        if src != dst and not dropped:
            dropped.append(key)
            return
        real(self, store, key, value, src, dst, tag)

    monkeypatch.setattr(pipeline_exec._Executor, "send", send)
    with pytest.raises(RuntimeError, match=r"virtual stage 1 on rank 1 needs microbatch 0's activation from rank 0"):
        run_schedule(build_schedule("1f1b", 2, 4), _programs(2, 4, 1), *_batch())
    assert dropped == [(1, 0)]


def test_gradient_actions_recompute_no_forward():
    """The forward run stashes what the gradient programs read from it, so (planned, per virtual stage) no
    ``B``/``I``/``W`` program runs an einsum of the forward program, ``F`` + ``B`` einsum FLOPs equal those of one
    program fetching the output and every gradient (which computes the forward once), and a ``B`` given the
    stash (or an ``I`` and a ``W`` given its activation gradients) gives bitwise the gradients of one that
    recomputes; executed, one 1F1B or zero-bubble step's einsum FLOPs (the
    sessions' counters) are M times that forward-plus-backward."""
    S, M = 2, 4
    programs = stage_programs(_cfg(S), S, M, 1, MESH, LAYOUT, STORAGE)
    ids, tg = _batch()
    joint = []
    for p in programs:
        lw = p.lowering
        fw = lw.plan([p.output])
        fw_einsums = {st.op for st in fw.steps if st.flops}
        assert fw_einsums and p.saved
        for kind in ("B", "I", "W"):
            fetches = pipeline_exec.action_fetches(p, kind)
            if fetches:
                assert not {st.op for st in lw.plan(fetches, p.saved).steps if st.flops} & fw_einsums, kind
        grads = pipeline_exec.action_fetches(p, "B")
        if p.input_grad is not None:  # zero-bubble: W is given I's activation gradients, I + W = B
            i_plan = lw.plan([p.input_grad], p.saved)
            w_plan = lw.plan(pipeline_exec.action_fetches(p, "W"), p.saved + p.saved_grads)
            assert p.saved_grads and not {st.op for st in w_plan.steps if st.flops} & {
                st.op for st in i_plan.steps if st.flops}
            assert (i_plan.counters.einsum_flops + w_plan.counters.einsum_flops
                    == lw.plan_counters(grads, given=p.saved).einsum_flops)
        joint.append(lw.plan_counters([p.output] + grads).einsum_flops)
        assert fw.counters.einsum_flops + lw.plan_counters(grads, given=p.saved).einsum_flops == joint[-1]
        feeds = {p.inputs: ids[:BATCH // M] if p.stage == 0 else torch.randn(BATCH // M, 8, 16)}
        if p.targets is not None:
            feeds[p.targets] = tg[:BATCH // M]
        if p.output_grad is not None:
            feeds[p.output_grad] = torch.randn(BATCH // M, 8, 16)
        _, saved = lw.run_stashed([p.output], feeds, stash=p.saved)
        given, _ = lw.run_stashed(grads, feeds, given=saved)
        if p.input_grad is not None:
            _, more = lw.run_stashed([p.input_grad], feeds, given=saved, stash=p.saved_grads)
            w, _ = lw.run_stashed(grads[1:], feeds, given={**saved, **more})
            given = given[:1] + w
        for a, b in zip(given, lw.run(grads, feeds), strict=True):
            assert torch.equal(a, b)
    for name in ("1f1b", "zero-bubble"):
        before = [p.lowering.counters.einsum_flops for p in programs]
        run_schedule(build_schedule(name, S, M), programs, ids, tg)
        assert [p.lowering.counters.einsum_flops - b for p, b in zip(programs, before, strict=True)] == [
            M * j for j in joint], name


def test_refuses_what_it_cannot_cut():
    with pytest.raises(ValueError, match="num_layers"):
        stage_programs(_cfg(3), 2, 4)
    with pytest.raises(ValueError, match="MoE layers are not supported"):
        stage_programs(preset("tiny", num_layers=2, num_experts=2), 2, 4)
    with pytest.raises(ValueError, match="dropout"):
        stage_programs(preset("tiny", num_layers=2, dropout=0.1), 2, 4)
    with pytest.raises(ValueError, match="virtual stages"):
        run_schedule(build_schedule("1f1b", 2, 4), _programs(2, 4, 2), *_batch())


@pytest.mark.parametrize("S,cases,train", [
    (2, [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("interleaved-1f1b", 2, 4, 2), ("zero-bubble", 2, 4, 2)], True),
    pytest.param(4, [("zero-bubble", 4, 4, 1)], False, marks=pytest.mark.slow),
])
def test_gloo_ranks_run_their_rows_and_give_the_unpipelined_gradients(S, cases, train, tmp_path):
    """One process per pipeline rank (gloo): each walks its own row of the table, exchanging activations and
    gradients point to point; the ranks' gradients together, and the last rank's loss, are the unpipelined LM's
    (computed here, in the parent), their sends (flight recorder) together the table's. With ``train``, the same
    ranks then run ``meshtorch train --pipeline-schedule 1f1b --mesh pipe:2`` (one process per pipeline rank):
    every rank's losses and its stages' variables are the one-process unpipelined run's
    (``tests/test_pipeline_train.py``'s model and flags), and so after resuming by zero-bubble
    (:func:`_check_gloo_training`)."""
    import test_pipeline_train as T

    extra = (str(tmp_path), T.FLAGS) if train else None
    res = run_spmd("_spmd_pipeline:schedule_worker", args=(cases, extra), nprocs=S, timeout_s=300,
                   extra_path=[TESTS_DIR]).check().results
    if train:
        _check_gloo_training(T, tmp_path, [r["train"] for r in res])
        res = [r["cases"] for r in res]
    for i, (name, S_, M, R) in enumerate(cases):
        table = build_schedule(name, S_, M, R)
        loss, grads = _reference(S_ * R)
        per_rank = [res[r][i] for r in range(S)]
        assert [x[0] is None for x in per_rank] == [r != S - 1 for r in range(S)]
        assert abs(per_rank[S - 1][0] - loss) <= 1e-6
        got = {}
        for x in per_rank:
            assert not set(got) & set(x[1])  # each variable on one rank
            got.update(x[1])
        assert set(got) == set(grads)
        for n, g in grads.items():
            assert (got[n] - g).abs().max().item() <= 1e-6, (name, n)
        assert sum(x[2] for x in per_rank) == len(table.sends())
        assert [x[3] for x in per_rank] == table.in_flight()
        assert [x[4] for x in per_rank] == [[str(a) for a in o] for o in table.order]
        _check_timeline(table, [x[5] for x in per_rank])


def _check_timeline(table, ranks):
    """The gloo ranks' timelines of one step (nanoseconds since a barrier): one action event per table action in
    the rank's order (``action_costs`` checks), rank 1's first action blocked in a receive from rank 0 inside
    it; per rank the measured bubble in [blocked share, 1); a valid Chrome trace of it."""
    from meshtorch.runtime.pipeline_trace import action_costs, chrome_trace, step_bubbles

    assert set(action_costs(table, [ranks])) == {(a.stage, a.kind) for o in table.order for a in o}
    first = next(e for e in ranks[1] if e[1] == "action")
    recv = ranks[1][0]
    assert recv[:2] == ("recv from rank 0", "recv") and first[2] <= recv[2] <= recv[3] <= first[3]
    for b in step_bubbles(ranks):
        assert b["blocked"] <= b["bubble"] + 1e-9 and 0 <= b["bubble"] < 1
    ev = json.loads(json.dumps(chrome_trace([ranks])))["traceEvents"]
    for r, row in enumerate(table.order):
        assert [e["name"] for e in ev if e.get("cat") == "action" and e["pid"] == r] == [str(a) for a in row]


def _check_gloo_training(T, tmp_path, per_rank):
    """The 2 gloo ranks' ``meshtorch train`` runs (2 steps 1F1B, then resumed by zero-bubble to step 3): each
    rank's losses and validation losses are the one-process unpipelined run's, the ranks' variables together
    (each on one rank; ``global_step`` on rank 0) are its variables; the checkpoint of step 2 holds one file per
    rank, each with that rank's stage's variables only (written by the rank that holds them)."""
    from safetensors import safe_open

    for k, steps in enumerate((2, 3)):
        ref = T.train(tmp_path / "ref", f"ref-one-{steps}", 2, steps=steps, mesh="", layout="")
        got = {}
        for r in per_rank:
            assert not set(got) & set(r[k][1])  # each variable on one rank
            got.update(r[k][1])
            T._same((r[k][0], ref[1], r[k][2]), ref)
        T._same((ref[0], got, ref[2]), ref)
    # --pipeline-trace of the 1F1B run (2 steps): rank 0 wrote both ranks' timelines, one step slice each
    table = build_schedule("1f1b", 2, 4)
    ev = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for r, row in enumerate(table.order):
        mine = sorted((e for e in ev if e["ph"] == "X" and e["pid"] == r), key=lambda e: e["ts"])
        assert [e["name"] for e in mine if e["cat"] == "step"] == ["step 0", "step 1"]
        assert [e["name"] for e in mine if e["cat"] == "action"] == [str(a) for a in row] * 2
        assert all(0 <= e["args"]["blocked"] <= e["args"]["bubble"] < 1 for e in mine if e["cat"] == "step")
    ckpt = tmp_path / "gloo" / "ckpt" / "ckpt-2"
    files = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    assert len(files) == 2, files
    for f, r in zip(files, per_rank, strict=True):
        with safe_open(str(ckpt / f), "pt") as h:
            assert set(h.keys()) == set(r[0][1]), f

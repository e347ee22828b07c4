"""``meshtorch train --pipeline-schedule 1f1b|interleaved-1f1b|zero-bubble`` (issue 32): training steps run by the
stage executor in the schedule's order, against the *unpipelined* run of the same model (``meshtorch train`` on
the mesh inside a stage, one graph, autodiff's gradients, the same AdamW and clipping): every step's loss and
every final variable (weights, AdamW moments, step) within 1e-6; the GPipe pipeline layout's losses too; a run
resumed from another schedule's checkpoint. The run on 2 gloo ranks (one process per pipeline rank) shares the
ranks of ``tests/test_pipeline_executor.py``'s gloo test."""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch

from meshtorch.cli import main as cli_main
from meshtorch.core.schedules import build_schedule
from meshtorch.runtime.train import main_train
from meshtorch.runtime.train_config import TrainConfig

#: tiny LM, 2 steps; constant learning rate (a run resumed to step 3 sees the 3-step run's rates); clipping on
FLAGS = dict(preset="tiny", d_model=16, heads=2, d_kv=8, d_ff=32, length=8, batch_size=8, eval_every=100,
             eval_batches=1, sample=0, plot="", lr=1e-3, schedule="constant", clip_norm=0.5,
             peak_tflops=1.0)
PIPE = dict(mesh="pipe:2,data:2", layout="stage:pipe;batch:data", storage="d_model:data", microbatches=4)


def train(root, name, layers, steps=2, **kw):
    """Losses, ``{variable: value}`` (the unpipelined LM's variables; pipelined: the stages') and validation
    losses of a ``meshtorch train`` run."""
    res = main_train(TrainConfig(**FLAGS, layers=layers, steps=steps, runs_dir=str(root), run_name=name, **kw))
    lw = res["lowering"]
    return res["history"]["loss"], {n: lw.variable_value(n) for n in lw.variable_names}, res["history"]["val_loss"]


@functools.cache
def _reference(root, layers, steps=2):
    """The unpipelined run: data parallel with FSDP storage, the mesh inside each pipeline stage."""
    return train(root, f"ref{layers}-{steps}", layers, steps, mesh="data:2", layout="batch:data",
                 storage="d_model:data")


def _same(got, ref):
    """Training losses, the last validation loss (a resumed run's history holds the earlier run's too) and every
    variable within 1e-6."""
    assert len(got[0]) == len(ref[0])
    for a, b in zip(got[0], ref[0], strict=True):
        assert abs(a - b) <= 1e-6, (got[0], ref[0])
    assert abs(got[2][-1] - ref[2][-1]) <= 1e-6, (got[2], ref[2])
    assert set(got[1]) == set(ref[1])
    for n, v in ref[1].items():
        assert (got[1][n].double() - v.double()).abs().max().item() <= 1e-6, n


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pipetrain")


@pytest.mark.parametrize("name,layers,repeats", [("interleaved-1f1b", 4, 2), ("zero-bubble", 2, 1)])
def test_schedule_trains_as_the_unpipelined_model(root, name, layers, repeats):
    """And ``--pipeline-trace`` in one process: per rank a ``step`` slice per step holding the rank's row of the
    table (``meshtorch.runtime.pipeline_trace``)."""
    trace = root / f"{name}-trace.json"
    got = train(root, name, layers, pipeline_schedule=name, pipeline_repeats=repeats, pipeline_trace=str(trace),
                **PIPE)
    _same(got, _reference(root, layers))
    ev = json.loads(trace.read_text())["traceEvents"]
    for r, row in enumerate(build_schedule(name, 2, PIPE["microbatches"], repeats).order):
        mine = sorted((e for e in ev if e["ph"] == "X" and e["pid"] == r), key=lambda e: e["ts"])
        assert [e["name"] for e in mine if e["cat"] == "step"] == ["step 0", "step 1"]
        assert [e["name"] for e in mine if e["cat"] == "action"] == [str(a) for a in row] * 2


def test_gpipe_layout_gives_the_same_losses(root):
    losses, _, _ = train(root, "gpipe", 2, pipeline_schedule="gpipe", **PIPE)
    ref = _reference(root, 2)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= 1e-6


def test_1f1b_and_resume_from_another_schedules_checkpoint(root):
    """1F1B trains as the unpipelined model; its checkpoint (the unpipelined LM's variables) resumed by zero-bubble
    for a third step gives the 3-step unpipelined run's losses and variables."""
    _same(train(root, "resume", 2, steps=2, pipeline_schedule="1f1b", **PIPE), _reference(root, 2))
    got = train(root, "resume", 2, steps=3, pipeline_schedule="zero-bubble", resume=True, **PIPE)
    _same(got, _reference(root, 2, 3))


def _restored(ckpt, mesh, layout):
    """``{variable: value}`` of the LM ``meshtorch sample`` restores from checkpoint ``ckpt`` on ``mesh`` /
    ``layout`` (weights only, no optimizer slots)."""
    from meshtorch.runtime.sample import load_lm

    _, lw = load_lm(str(ckpt), mesh, layout)
    return {n: lw.variable_value(n) for n in lw.variable_names}


def test_checkpoints_cross_between_pipelined_and_unpipelined_runs(root):
    """A 1F1B checkpoint (written from the stages' variables) restores bitwise into the unpipelined LM that
    ``meshtorch sample`` builds on another mesh, and the unpipelined run resumed from it trains its third step as the
    3-step unpipelined run; an unpipelined checkpoint resumed by 1F1B likewise."""
    got = train(root, "cross", 2, steps=2, pipeline_schedule="1f1b", **PIPE)
    _same(got, _reference(root, 2))
    ckpt = os.path.join(root, "cross", "ckpt", "ckpt-2")
    back = _restored(ckpt, "model:2", "d_ff:model;heads:model")
    assert back and set(back) <= set(got[1])
    for n, v in back.items():
        assert torch.equal(v, got[1][n]), n
    _same(train(root, "cross", 2, steps=3, resume=True, mesh="data:2", layout="batch:data", storage="d_model:data"),
          _reference(root, 2, 3))
    train(root, "cross-back", 2, steps=2, mesh="data:2", layout="batch:data", storage="d_model:data")
    _same(train(root, "cross-back", 2, steps=3, resume=True, pipeline_schedule="1f1b", **PIPE),
          _reference(root, 2, 3))


@pytest.mark.parametrize("extra,match", [
    (["--mesh", "pipe:2", "--layout", "stage:pipe;d_ff:pipe"], "rule d_ff:pipe splits 'd_ff' over the stage axis"),
    (["--mesh", "pipe:2", "--layout", "stage:pipe", "--dropout", "0.1"], "cannot be combined with --dropout"),
    (["--mesh", "pipe:2", "--layout", "stage:pipe", "--precision", "bf16"], "cannot be combined with --precision"),
    (["--mesh", "pipe:2", "--layout", "stage:pipe", "--precision", "fp16"], "cannot be combined with --precision fp16"),
])
def test_refuses_what_the_stage_executor_cannot_run(capsys, tmp_path, monkeypatch, extra, match):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--preset", "tiny", "--layers", "2", "--microbatches", "4", "--steps", "1",
            "--pipeline-schedule", "1f1b"] + extra
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(match, err[0]), err
    assert not os.listdir(tmp_path)  # refused before anything was written

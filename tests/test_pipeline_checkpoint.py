"""Checkpoints cross between the pipeline layout (stacked ``stack/{kind}`` ``[stage, (repeat,) ...]``) and the
per-layer naming (``layer_{i}/{kind}``: unpipelined runs, the stage executor) (issues 30 and 32).

References: the unpipelined LM's loss on the same batch with the same values, and each stacked row ``[s, r]``
against layer ``r S + s``'s variable (weights and AdamW slots) built here from the saved values; and whole runs:
an unpipelined (or 1F1B) run resumed under the GPipe layout, and the reverse, against the uninterrupted unpipelined
run's losses (1e-6)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import meshtorch as mtf
from meshtorch.checkpoint import restore, save
from meshtorch.core.errors import CheckpointError
from meshtorch.models.transformer import build_lm, preset
from meshtorch.runtime.train import main_train
from meshtorch.runtime.train_config import TrainConfig
from meshtorch.testing.spmd import run_spmd

CFG = preset("tiny", vocab_size=16, d_model=16, num_heads=2, d_kv=8, d_ff=32, length=8, batch_size=8, num_layers=4)
S, R = 2, 2  # 4 layers: stage s runs layers s and 2 + s


def _lm(pipelined: bool):
    c = dataclasses.replace(CFG, pipeline_stages=S, microbatches=2, pipeline_repeats=R) if pipelined else CFG
    return build_lm(c, optimizer=mtf.optim.AdamWOptimizer(1e-3))


def _randomize(lw, seed):
    """Distinct random values in every variable (slots too), so any row mix-up shows."""
    g = torch.Generator().manual_seed(seed)
    for n in lw.variable_names:
        v = lw.variable_value(n)
        if v.is_floating_point():
            lw.set_variable_value(n, (torch.rand(v.shape, generator=g) * 0.2 + 0.9) * torch.sign(
                torch.randn(v.shape, generator=g)))


def _loss(lm, lw):
    ids = torch.randint(0, 16, (8, 9), generator=torch.Generator().manual_seed(7))
    return lw.run([lm.loss], feeds={lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})[0].item()


def _row(values, name):
    """Stacked ``name``'s value built from the per-layer ``values`` (row [s, r] = layer r * S + s)."""
    kind = name[len("stack/"):]
    return torch.stack([torch.stack([values[f"layer_{r * S + s}/{kind}"] for r in range(R)]) for s in range(S)])


def _check(flat_vals, piped_vals):
    stacked = [n for n in piped_vals if n.startswith("stack/")]
    assert stacked and any(n.endswith("adam_m") for n in stacked)
    for n, v in piped_vals.items():
        expect = _row(flat_vals, n) if n.startswith("stack/") else flat_vals[n]
        assert torch.equal(v, expect), n


def _cross(tmp_path, write_pipelined, write_impl, read_impl):
    """Random values saved from one LM on ``write_impl``, restored into the other on ``read_impl``: the
    checkpoint's every variable used, every variable as expected, the same loss."""
    flat, piped = _lm(False), _lm(True)
    src, dst = (piped, flat) if write_pipelined else (flat, piped)
    slw = src.lowering(mesh_impl=write_impl)
    _randomize(slw, 1 + write_pipelined)
    save(slw, str(tmp_path), 3)
    dlw = dst.lowering(mesh_impl=read_impl)
    assert restore(dlw, str(tmp_path))["unused"] == []
    flw, plw = (dlw, slw) if write_pipelined else (slw, dlw)
    values = [{n: lw.variable_value(n) for n in lw.variable_names} for lw in (flw, plw)]
    _check(*values)
    assert abs(_loss(piped, plw) - _loss(flat, flw)) <= 1e-6


def test_per_layer_checkpoint_restores_into_the_pipeline_layout(tmp_path):
    _cross(tmp_path, False, mtf.MeshSpec("model:2", "heads:model;d_ff:model"),
           mtf.MeshSpec("pipe:2,data:2", "stage:pipe;d_ff:data", storage="heads:data"))


def test_pipeline_layout_checkpoint_restores_per_layer(tmp_path):
    _cross(tmp_path, True, mtf.MeshSpec("pipe:2,data:2", "stage:pipe;batch:data", storage="d_kv:data"),
           mtf.MeshSpec("model:2", "heads:model"))


def test_missing_layer_is_named(tmp_path):
    flat = build_lm(dataclasses.replace(CFG, num_layers=2), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    save(flat.lowering(), str(tmp_path), 1)
    with pytest.raises(CheckpointError, match=r"stack/attention/q.* are not in checkpoint"):
        restore(_lm(True).lowering("pipe:2", "stage:pipe"), str(tmp_path))


FLAGS = dict(preset="tiny", d_model=16, heads=2, d_kv=8, d_ff=32, length=8, batch_size=8, eval_every=100,
             eval_batches=1, sample=0, plot="", lr=1e-3, schedule="constant", clip_norm=0.5, peak_tflops=1.0,
             layers=2)
GPIPE = dict(mesh="pipe:2", layout="stage:pipe", microbatches=2)
FLAT = dict(mesh="data:2", layout="batch:data")
EXEC = dict(mesh="pipe:2", layout="stage:pipe", microbatches=2, pipeline_schedule="1f1b")


def _train(root, name, steps, **kw):
    return main_train(TrainConfig(**FLAGS, steps=steps, runs_dir=str(root), run_name=name, **kw))["history"]["loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted unpipelined 3-step run's losses."""
    return _train(tmp_path_factory.mktemp("ref"), "ref", 3, **FLAT)


@pytest.mark.parametrize("first,then", [(FLAT, GPIPE), (EXEC, GPIPE), (GPIPE, FLAT)],
                         ids=["unpipelined-to-gpipe", "1f1b-to-gpipe", "gpipe-to-unpipelined"])
def test_resume_across_the_pipeline_layout(tmp_path, reference, first, then):
    _train(tmp_path, "run", 2, **first)
    losses = _train(tmp_path, "run", 3, resume=True, **then)
    assert len(losses) == 3
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) <= 1e-6, (losses, reference)


def test_executor_checkpoint_resumes_under_the_gpipe_layout_on_2_gloo_ranks(tmp_path, reference):
    """Under torchrun: the stage executor's checkpoint (each rank its stage's per-layer slices) resumed by the GPipe
    layout on the same 2 ranks (each rank reads its stage's rows)."""
    res = run_spmd("_spmd_pipeline:gpipe_resume_worker", args=(str(tmp_path), FLAGS), nprocs=2, timeout_s=300,
                   extra_path=[os.path.dirname(os.path.abspath(__file__))]).check().results
    for losses in res:
        assert len(losses) == 3
        assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) <= 1e-6, (losses, reference)

"""Gradient accumulation (``meshtorch train --accumulate N``, :mod:`meshtorch.optim.accumulate`): N microbatches
of B / N rows per optimizer step give the losses and weights of one step on B rows (float32 rounding), on one
processor and under a 2x2 FSDP layout, with the activation peak of one microbatch; bad values exit 2 naming the
flag."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from meshtorch.checkpoint import latest_checkpoint, load_manifest
from meshtorch.cli import main
from meshtorch.cli.plan import add_plan_subcommand
from meshtorch.cli.train import add_train_subcommand
from meshtorch.lowering import Lowering
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.models.transformer import build_lm

TINY = ["--preset", "tiny", "--layers", "2", "--d-model", "32", "--heads", "2", "--d-kv", "16", "--d-ff", "64",
        "--length", "16", "--eval-batches", "2", "--eval-every", "3", "--sample", "0", "--plot", "",
        "--checkpoint-dir", "", "--lr", "1e-2", "--warmup-steps", "1", "--steps", "3", "--clip-norm", "0.5"]
FSDP = ["--mesh", "data:2,model:2", "--layout", "batch:data;heads:model;d_ff:model;vocab:model",
        "--storage", "d_model:data"]


def _train(*argv):
    p = argparse.ArgumentParser()
    add_train_subcommand(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["train", *argv])
    return args.func(args)


def _weights(out) -> dict:
    lw = out["lowering"]
    return {n: lw.variable_value(n) for n in lw.variable_names if "accumulated_gradient" not in n}


@pytest.mark.parametrize("layout, flags", [
    ([], ["--optimizer", "sgd", "--lr", "0.5", "--clip-norm", "0"]),  # SGD: the update scales with the gradient
    (FSDP, ["--optimizer", "adamw"]),  # AdamW after clipping to 0.5
], ids=["one-processor-sgd", "fsdp-2x2-adamw"])
def test_accumulate_4_of_batch_4_trains_as_batch_16(layout, flags):
    """The reference is the same run with batch 16 in one step (no accumulation), under the same layout."""
    mesh = [] if layout else ["--mesh", "", "--layout", ""]
    ref = _train(*TINY, *mesh, *layout, *flags, "--batch-size", "16")
    acc = _train(*TINY, *mesh, *layout, *flags, "--batch-size", "16", "--accumulate", "4")
    assert acc["lm"].config.batch_size == 4 and ref["lm"].config.batch_size == 16
    torch.testing.assert_close(torch.tensor(acc["history"]["loss"]), torch.tensor(ref["history"]["loss"]),
                               rtol=2e-6, atol=0)
    torch.testing.assert_close(torch.tensor(acc["history"]["val_loss"]), torch.tensor(ref["history"]["val_loss"]),
                               rtol=2e-6, atol=0)
    wa, wr = _weights(acc), _weights(ref)
    assert wa.keys() == wr.keys()
    for name in wr:  # 3 AdamW steps at lr 1e-2 after clipping: float32 rounding, not a different update
        torch.testing.assert_close(wa[name], wr[name], rtol=1e-5, atol=2e-6, msg=name)
    moved = max(float((wr[n] - w0).abs().max()) for n, w0 in _initial(ref).items())
    assert moved > 1e-3  # the steps changed the weights (the comparison above is not of initial values)


def _initial(out) -> dict:
    lm = build_lm(out["lm"].config, seed=0)
    lw = Lowering(lm.graph, {lm.mesh: make_mesh_impl("", "")})
    return {n: lw.variable_value(n) for n in lw.variable_names}


def _plan(*argv):
    """``meshtorch plan`` through its parser: ``[(layout, MemoryReport)]``."""
    p = argparse.ArgumentParser()
    add_plan_subcommand(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["plan", "--preset", "tiny", "--mesh", "", "--layout", "", "--hardware", "cpu", *argv])
    return args.func(args)


PLAN_SHAPE = ["--layers", "2", "--d-model", "128", "--heads", "4", "--d-kv", "32", "--d-ff", "512", "--length", "128",
              "--vocab", "256"]


def test_plan_prices_one_microbatch_plus_the_accumulator(capsys):
    """``meshtorch plan --accumulate 4 --batch-size 16``: the activation peak of ``--batch-size 4``, not 16; the
    variables grow by exactly one float32 accumulator per trainable parameter."""
    rep = {(b, n): _plan(*PLAN_SHAPE, "--batch-size", str(b), "--accumulate", str(n))[0][1]
           for b, n in ((16, 1), (4, 1), (16, 4))}
    assert "batch 16 (4 microbatches of 4)" in capsys.readouterr().out
    params = rep[4, 1].trainable_bytes // 4
    act = {k: r.peak_activation_bytes for k, r in rep.items()}
    assert act[16, 1] > 3 * act[4, 1]  # the batch's activations dominate at this shape
    assert act[4, 1] <= act[16, 4] <= 1.02 * act[4, 1], act
    assert rep[16, 4].variable_bytes - rep[4, 1].variable_bytes == 4 * params
    assert rep[16, 4].trainable_bytes == rep[16, 1].trainable_bytes


_MEASURE = r"""
import sys, torch
sys.path.insert(0, {bench!r})
from rss import peak_rss_bytes, reset_peak
from meshtorch.lowering import Lowering
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.models.transformer import build_lm, preset
from meshtorch.optim import AdamWOptimizer
from meshtorch.optim.accumulate import accumulated_updates
data = torch.randint(0, 256, (16, 129))
for batch, n in ((4, 4), (4, 1), (16, 1)):
    cfg = preset("tiny", num_layers=2, d_model=128, num_heads=4, d_kv=32, d_ff=512, length=128, batch_size=batch,
                 vocab_size=256)
    lm = build_lm(cfg, optimizer=AdamWOptimizer(1e-3) if n == 1 else None)
    acc = None if n == 1 else accumulated_updates(lm.graph, lm.loss, AdamWOptimizer(1e-3), n)
    lw = Lowering(lm.graph, {{lm.mesh: make_mesh_impl("", "")}})
    def step():
        for k in range(n):
            rows = data[k * batch:(k + 1) * batch]
            fetches = [lm.loss] + (lm.updates if acc is None else acc.fetches(k))
            lw.run(fetches, feeds={{lm.inputs: rows[:, :-1], lm.targets: rows[:, 1:]}})
    step()  # plans built, optimizer state allocated
    base = reset_peak()
    step()
    print(batch, n, peak_rss_bytes() - base, sum(v.shape.size for v in lm.graph.trainable_variables))
    del lw, lm, acc
"""


def _measured_growth() -> tuple[dict, int]:
    """``{(batch, microbatches): peak RSS growth in bytes}`` (and the model's parameters) of one training step
    (after a first one), in a fresh process; glibc's mmap threshold pinned at 64 KiB so freed tensors go back
    to the OS (the high-water mark is the step's own peak)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")])}
    code = _MEASURE.format(bench=os.path.join(root, "benchmarks"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [[int(x) for x in line.split()] for line in out.stdout.splitlines()]
    return {(b, n): g for b, n, g, _ in rows}, rows[0][3]


def test_measured_activation_peak_is_one_microbatch():
    """Measured (RSS high-water mark of a step, beyond the weights and AdamW state): 4 x batch 4 grows about as
    much as batch 4 (plus the accumulator), well under batch 16."""
    grow, params = _measured_growth()
    print("measured peak RSS growth per step:", grow, "parameters:", params)
    assert grow[16, 1] > 2.5 * grow[4, 1], grow
    assert grow[4, 4] <= 1.25 * grow[4, 1] + 4 * params, grow


@pytest.mark.parametrize("argv, words", [
    (["--accumulate", "0"], ["--accumulate"]),
    (["--accumulate", "3", "--batch-size", "8"], ["--accumulate 3", "--batch-size 8"]),
    (["--accumulate", "4", "--batch-size", "4", *FSDP], ["--accumulate 4", "multiple of 8"]),
    (["--accumulate", "2", "--batch-size", "8", "--layers", "2", "--mesh", "pipe:2", "--layout", "stage:pipe"],
     ["--accumulate 2", "pipelined"]),
    (["--accumulate", "2", "--batch-size", "8", "--layout", "auto"], ["--accumulate 2", "--layout auto"]),
])
def test_bad_accumulate_exits_2_naming_the_flag(tmp_path, capsys, argv, words):
    rc = main(["train", *TINY[:-2], "--runs-dir", str(tmp_path), *argv])
    cap = capsys.readouterr()
    last = (cap.out + cap.err).strip().splitlines()[-1]
    assert rc == 2 and all(w in last for w in words) and "Traceback" not in cap.err, cap.out + cap.err


def test_accumulate_with_an_imported_gpt2_trains_as_the_whole_batch(tmp_path):
    """``--init-from`` a GPT-2 directory: 2 x batch 4 gives batch 8's losses and weights (the same training loop)."""
    pytest.importorskip("transformers")
    import _hf_fixtures as F
    data = tmp_path / "data.txt"
    data.write_text(F.text())
    gpt2 = F.save(F.make_model("gpt2", vocab=257), str(tmp_path / "gpt2"))
    base = ["--init-from", gpt2, "--tokenizer", "byte", "--data", str(data), "--steps", "2", "--length", "16",
            "--eval-every", "2", "--eval-batches", "1", "--plot", "", "--sample", "0", "--lr", "1e-3",
            "--warmup-steps", "1", "--checkpoint-dir", "", "--batch-size", "8", "--mesh", "", "--layout", ""]
    ref = _train(*base)
    acc = _train(*base, "--accumulate", "2")
    assert acc["lm"].config.batch_size == 4
    torch.testing.assert_close(torch.tensor(acc["history"]["loss"]), torch.tensor(ref["history"]["loss"]),
                               rtol=2e-6, atol=0)
    wa, wr = _weights(acc), _weights(ref)
    for name in wr:
        torch.testing.assert_close(wa[name], wr[name], rtol=1e-5, atol=2e-6, msg=name)


def test_resume_continues_an_accumulated_run_exactly_and_accumulators_are_not_required(tmp_path):
    """4 steps of 2 x batch 4 in one go == 2 steps, then --resume for 2 more (bitwise); a checkpoint written without
    --accumulate resumes with it (the accumulators are scratch, overwritten by each step's first microbatch)."""
    base = [*TINY[:-4], "--mesh", "", "--layout", "", "--batch-size", "8", "--eval-every", "2"]
    ref = _train(*base, "--steps", "4", "--accumulate", "2")["history"]["loss"]
    _train(*base, "--steps", "2", "--accumulate", "2", "--checkpoint-dir", str(tmp_path / "a"))
    saved = load_manifest(latest_checkpoint(str(tmp_path / "a")))["variables"]
    assert "embedding" in saved and not [n for n in saved if "accumulated_gradient" in n]  # scratch is not saved
    out = _train(*base, "--steps", "4", "--accumulate", "2", "--checkpoint-dir", str(tmp_path / "a"), "--resume")
    assert out["history"]["loss"] == ref
    _train(*base, "--steps", "2", "--checkpoint-dir", str(tmp_path / "b"))
    plain = _train(*base, "--steps", "4", "--checkpoint-dir", str(tmp_path / "c"))["history"]["loss"]
    mixed = _train(*base, "--steps", "4", "--accumulate", "2", "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    torch.testing.assert_close(torch.tensor(mixed["history"]["loss"]), torch.tensor(plain), rtol=2e-6, atol=0)


@pytest.mark.parametrize("argv, words", [
    (["--accumulate", "3", "--batch-size", "8"], ["--accumulate 3", "--batch-size 8"]),
    (["--accumulate", "0"], ["--accumulate"]),
    (["--accumulate", "2", "--search"], ["--accumulate 2", "--search"]),
])
def test_plan_refuses_bad_accumulate_naming_the_flag(capsys, argv, words):
    rc = main(["plan", "--preset", "tiny", *argv])
    cap = capsys.readouterr()
    last = (cap.out + cap.err).strip().splitlines()[-1]
    assert rc == 2 and all(w in last for w in words) and "Traceback" not in cap.err, cap.out + cap.err


def test_accumulate_on_two_gloo_ranks_with_fsdp_storage():
    """2 gloo ranks (``data:2``, storage ``d_model:data``): 2 x batch 4 == batch 8 (SGD after clipping)."""
    from meshtorch.testing.spmd import run_spmd
    tests = os.path.dirname(os.path.abspath(__file__))
    results = run_spmd("_accumulate_jobs:accumulate_pair", args=(8, 2), nprocs=2, timeout_s=300,
                       extra_path=[tests]).check().results
    for ref, acc in results:
        torch.testing.assert_close(torch.tensor(acc["losses"]), torch.tensor(ref["losses"]), rtol=2e-6, atol=0)
        for name, w in ref["weights"].items():
            torch.testing.assert_close(acc["weights"][name], w, rtol=1e-5, atol=2e-6, msg=name)

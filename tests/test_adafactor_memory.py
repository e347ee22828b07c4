"""Adafactor as the memory-lean optimizer of the native LM (``meshtorch train/plan --optimizer adafactor``):
factored second moments (a row and a column vector per matrix, Shazeer & Stern 2018), no first moment; its
state, as planned and as held after training, equals a count made here from the variables' shapes."""

from __future__ import annotations

import argparse
import math

import torch

from meshtorch.cli.plan import add_plan_subcommand
from meshtorch.cli.train import add_train_subcommand

SHAPE = {"layers": "1", "d-model": "256", "heads": "2", "d-kv": "128", "d-ff": "512", "length": "16",
         "batch-size": "4"}


def _flags(**extra):
    return [x for k, v in {**SHAPE, **extra}.items() for x in (f"--{k}", v)]


def _run(cmd, add, *argv):
    p = argparse.ArgumentParser()
    add(p.add_subparsers(dest="cmd"))
    args = p.parse_args([cmd, *argv])
    return args.func(args)


def _reference_state_bytes(shapes) -> int:
    """Mesh TF's Adafactor slots for these variable shapes (lists of dim sizes), float32, without beta1: a matrix
    whose two largest dims d0 >= d1 are both >= 128 keeps size/d0 + size/d1 numbers, anything else its size;
    plus the int64 global step."""
    total = 0
    for sizes in shapes:
        n = math.prod(sizes)
        top = sorted(sizes, reverse=True)
        total += n // top[0] + n // top[1] if len(top) >= 2 and top[1] >= 128 else n
    return 4 * total + 8


def test_adafactor_trains_the_native_lm_with_factored_state_as_planned(capsys):
    out = _run("train", add_train_subcommand, "--preset", "tiny", *_flags(), "--mesh", "", "--layout",
               "", "--optimizer", "adafactor", "--lr", "0", "--steps", "8", "--eval-every", "8", "--eval-batches", "1",
               "--sample", "0", "--plot", "", "--checkpoint-dir", "", "--clip-norm", "0")
    lw, lm = out["lowering"], out["lm"]
    loss = out["history"]["loss"]
    assert all(math.isfinite(x) for x in loss) and sum(loss[-3:]) / 3 < loss[0] - 0.3, loss  # it learns
    variables = {v.name: v for v in lw.variables}
    shapes = [[d.size for d in v.shape] for v in lm.graph.trainable_variables]
    params = sum(math.prod(s) for s in shapes)
    held = sum(lw.variable_value(n).numel() * lw.variable_value(n).element_size()
               for n, v in variables.items() if not v.trainable)
    assert not any(n.endswith("_slot_m") for n in variables)  # no first moment (beta1 = 0)
    assert held == _reference_state_bytes(shapes)
    assert held < 0.1 * 4 * params  # factored: a small fraction of AdamW's 8 bytes per parameter

    reports = {opt: _run("plan", add_plan_subcommand, "--preset", "tiny", *_flags(vocab="256"), "--mesh", "",
                         "--layout", "", "--hardware", "cpu", "--optimizer", opt)[0][1]
               for opt in ("adafactor", "adamw")}
    assert "Adafactor training step" in capsys.readouterr().out
    assert reports["adafactor"].trainable_bytes == 4 * params
    assert reports["adafactor"].optimizer_state_bytes == held
    assert reports["adamw"].optimizer_state_bytes == 8 * params + 8  # m and v in float32, and the step
    torch.testing.assert_close(torch.tensor(loss[0]), torch.tensor(math.log(256)), atol=0.5, rtol=0)

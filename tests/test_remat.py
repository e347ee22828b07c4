"""Activation checkpointing as a policy of the LM (issue 21): ``LMConfig.remat`` none | block | selective.

Losses and trained weights equal the run without remat (to 1e-6) on one processor and under a 2-D
layout; the planner's activation memory drops (block keeps only the block inputs); selective
recomputes no matmul (the same einsum FLOPs as none) while block recomputes them.
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import memory_report

# activations (attention scores, batch x heads x length^2) dominate this model's memory, as at scale
CFG = dict(vocab_size=16, d_model=32, num_heads=4, d_kv=8, d_ff=64, num_layers=4, length=64, batch_size=8)


def _train(remat, mesh_shape="", layout="", steps=3):
    lm = build_lm(preset("tiny", **CFG, remat=remat), seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-2))
    lw = lm.lowering(mesh_shape, layout)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 16, (8, 65), generator=gen)
        losses.append(lw.run([lm.loss] + lm.updates, feeds={lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})[0].item())
    rep = memory_report(lw, [lm.loss] + lm.updates)
    return losses, lw.variable_value("layer_0/ffn/wi/kernel"), rep


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("rows:2;cols:2", "batch:rows;heads:cols;d_ff:cols")])
def test_remat_losses_equal_no_remat_and_activation_memory_drops(mesh_shape, layout):
    base_losses, base_w, base = _train("none", mesh_shape, layout)
    for remat in ("block", "selective"):
        losses, w, rep = _train(remat, mesh_shape, layout)
        torch.testing.assert_close(losses, base_losses, rtol=0, atol=1e-6)
        torch.testing.assert_close(w, base_w, rtol=0, atol=1e-6)
        assert rep.peak_activation_bytes < base.peak_activation_bytes, remat
    block, sel = _train("block", mesh_shape, layout)[2], _train("selective", mesh_shape, layout)[2]
    assert block.peak_activation_bytes < 0.5 * base.peak_activation_bytes  # only the block inputs are kept
    assert block.peak_activation_bytes < sel.peak_activation_bytes  # selective keeps the matmul outputs too
    assert block.einsum_flops > base.einsum_flops  # block recomputes the matmuls...
    assert sel.einsum_flops == base.einsum_flops  # ...selective keeps them


def test_remat_policy_is_checked():
    with pytest.raises(ValueError, match="remat must be one of"):
        build_lm(preset("tiny", **CFG, remat="all"))


def test_train_cli_remat_flag_keeps_the_losses():
    """``meshtorch train --remat block|selective`` (dropout on: recomputed masks are the same) vs ``--remat none``."""
    import argparse

    from meshtorch.cli.train import add_train_subcommand

    def run(*extra):
        p = argparse.ArgumentParser()
        add_train_subcommand(p.add_subparsers(dest="cmd"))
        args = p.parse_args(["train", "--preset", "tiny", "--layers", "2", "--d-model", "32", "--heads", "4",
                             "--d-kv", "8", "--d-ff", "64", "--length", "16", "--batch-size", "8", "--eval-batches",
                             "1", "--sample", "0", "--plot", "", "--checkpoint-dir", "", "--dropout", "0.1",
                             "--steps", "3", "--eval-every", "3", *extra])
        out = args.func(args)
        return out["history"]["loss"], out["lm"].config.remat

    ref, policy = run()
    assert policy == "none"
    for remat in ("block", "selective"):
        losses, policy = run("--remat", remat)
        assert policy == remat
        torch.testing.assert_close(losses, ref, rtol=0, atol=1e-6)

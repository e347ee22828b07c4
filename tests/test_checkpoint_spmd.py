"""Checkpoints across process counts: a 4-rank gloo run on ``rows:2;cols:2`` saves (each rank writes only
the slices it owns); a 2-rank run on ``all:2`` and a one-process placement run restore it; every
variable (parameters, momentum slots, step counter) equals what the 4-rank run held, and the next
training step's loss equals that of an uninterrupted placement run."""

from __future__ import annotations

import os

import torch

import _checkpoint_mlp as M
import meshtorch as mtf
from meshtorch.testing import rel_error
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def test_save_4_ranks_restore_2_ranks_and_placement(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_spmd("_spmd_jobs:ckpt_save_worker", args=(root,), nprocs=4, timeout_s=60,
                     extra_path=[TESTS_DIR]).check().results
    losses, values, final = saved[0]
    assert os.path.isdir(final) and mtf.latest_checkpoint(root) is not None
    for r in saved[1:]:  # every rank gathered the same full values
        assert r[0] == losses and set(r[1]) == set(values)
        assert all(torch.equal(r[1][n], values[n]) for n in values)

    # the independent reference: the same 3 steps in one process, no checkpoint in between
    ref = M.build(*M.LAYOUT_C)
    ref_losses = [float(v) for v in M.train(ref, 0, 3)]
    ref2 = M.build(*M.LAYOUT_C)
    M.train(ref2, 0, 2)
    ref_values_2 = M.values(ref2[0])
    assert set(values) == set(ref_values_2) and len(values) >= 7  # w1 b1 w2 + 3 momentum slots + global_step
    for n, v in values.items():
        if v.dtype.is_floating_point:
            assert rel_error(v, ref_values_2[n]) <= 1e-5, n
        else:
            assert torch.equal(v, ref_values_2[n]), n
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses[:2], strict=True)) <= 1e-5

    restored = run_spmd("_spmd_jobs:ckpt_restore_worker", args=(root,), nprocs=2, timeout_s=60,
                        extra_path=[TESTS_DIR]).check().results
    for got, next_loss, step in restored:
        assert step == 2 and set(got) == set(values)
        for n in values:
            assert got[n].dtype == values[n].dtype and torch.equal(got[n], values[n]), n
        assert abs(next_loss - ref_losses[2]) <= 1e-5 * abs(ref_losses[2])

    for mesh_shape, layout in (M.LAYOUT_C, M.LAYOUT_D):
        lw = M.build(mesh_shape, layout)[0]
        assert mtf.restore(lw, root)["step"] == 2
        for n in values:
            assert torch.equal(lw.variable_value(n), values[n]), (mesh_shape, layout, n)

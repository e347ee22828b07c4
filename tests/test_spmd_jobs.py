"""The MNIST job and ``meshtorch train`` as 4 gloo processes (SpmdMeshImpl, per-rank feeds) vs one
process on the simulated mesh (PlacementMeshImpl): same step losses, same accuracy, main-only output."""

from __future__ import annotations

import os

import pytest
import torch

import _spmd_jobs as J
from meshtorch.runtime.mnist import train_mnist
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
MESH, LAYOUT = "rows:2;cols:2", "batch:rows;hidden:cols"


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max())


def test_mnist_spmd_losses_equal_placement():
    run = run_spmd("_spmd_jobs:mnist_worker", args=(MESH, LAYOUT), nprocs=4, timeout_s=120,
                   extra_path=[TESTS_DIR]).check()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_mnist(MESH, LAYOUT, data=J.synthetic_mnist(), **J.MNIST_KW)
    finally:
        torch.set_num_threads(n)
    assert len(ref.step_losses) == 20
    for rank, (losses, acc, lines) in enumerate(run.results):
        assert len(losses) == 20, rank
        assert _rel(losses, ref.step_losses) <= 1e-5, (rank, losses, ref.step_losses)
        assert acc == ref.epochs[0].test_accuracy, (rank, acc)
        # only the main process logs
        assert (len(lines) == 2) == (rank == 0), (rank, lines)
    assert "processes 4" in run.results[0][2][0]


def test_mnist_conv_spmd_equals_placement():
    """Spatial partitioning as 4 gloo processes: the halo rows travel between ranks; same losses as placement."""
    mesh, layout = "b1:2;b2:2", "row_blocks:b1;col_blocks:b2"
    run = run_spmd("_spmd_jobs:mnist_conv_worker", args=(mesh, layout, "gelu"), nprocs=4, timeout_s=120,
                   extra_path=[TESTS_DIR]).check()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_mnist("", "", data=J.synthetic_mnist(400, 40), activation="gelu", **J.CONV_KW)
    finally:
        torch.set_num_threads(n)
    assert len(ref.step_losses) == 6
    for rank, (losses, acc) in enumerate(run.results):
        assert _rel(losses, ref.step_losses) <= 1e-5, (rank, losses, ref.step_losses)
        assert acc == ref.epochs[0].test_accuracy, (rank, acc)


@pytest.mark.slow
def test_train_compile_spmd_equals_placement(capsys):
    """``meshtorch train --compile`` on 4 gloo ranks (data:2,model:2, collectives inside the compiled step,
    asynchronous, bucketed) gives the placement run's losses (generated function, not compiled) to 1e-5."""
    run = run_spmd("_spmd_jobs:train_compile_worker", nprocs=4, timeout_s=400, extra_path=[TESTS_DIR]).check()
    args = J.train_args(["--dropout", "0", "--sample", "0"])
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        h = args.func(args)["history"]
    finally:
        torch.set_num_threads(n)
    capsys.readouterr()
    for rank, (losses, val, compile_seconds, breaks) in enumerate(run.results):
        assert compile_seconds and all(compile_seconds), (rank, compile_seconds)  # every plan was compiled
        assert breaks == {}, (rank, breaks)
        assert _rel(losses, h["loss"]) <= 1e-5, (rank, losses, h["loss"])
        assert _rel(val, h["val_loss"]) <= 1e-5, (rank, val, h["val_loss"])


def _one_thread(args) -> dict:
    """``meshtorch train`` with parsed ``args`` in this process on one thread (as each gloo rank runs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return args.func(args)
    finally:
        torch.set_num_threads(n)


def test_train_spmd_equals_placement(tmp_path, capsys):
    run = run_spmd("_spmd_jobs:train_worker", args=(str(tmp_path / "spmd"),), nprocs=4, timeout_s=150,
                   extra_path=[TESTS_DIR]).check()
    ref = _one_thread(J.train_args(["--checkpoint-dir", str(tmp_path / "placement")]))
    ref_out = capsys.readouterr().out
    h = ref["history"]
    assert len(h["loss"]) == 5 and len(h["val_loss"]) == 1
    for rank, (losses, val, ids, out) in enumerate(run.results):
        assert _rel(losses, h["loss"]) <= 1e-5, (rank, losses, h["loss"])
        assert _rel(val, h["val_loss"]) <= 1e-5, (rank, val, h["val_loss"])
        assert ids == ref["sample_ids"] and len(ids) == 6, rank
        assert (out != "") == (rank == 0), (rank, out)  # only the main process prints
    assert "validation:" in run.results[0][3] and "sample:" in run.results[0][3] and "sample:" in ref_out

    # the checkpoint the 4 ranks saved restores on one process with the placement run's values
    import meshtorch as mtf
    lw, lm = ref["lowering"], ref["lm"]
    twin = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("", "")})
    assert mtf.restore(twin, str(tmp_path / "spmd"))["step"] == 5
    for name in lw.variable_names:
        a, b = twin.variable_value(name), lw.variable_value(name)
        if a.dtype.is_floating_point:
            assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1e-6), name
        else:
            assert torch.equal(a, b), name


def test_train_default_mesh_under_torchrun_is_data_parallel(capsys):
    """``meshtorch train`` without --mesh/--layout on 2 gloo ranks runs data parallel (mesh data:2, layout
    batch:data, buckets on by default): the losses, validation loss and sample of the same model trained with
    ``--mesh data:2 --layout batch:data`` on the simulated mesh in one process."""
    run = run_spmd("_spmd_jobs:train_default_mesh_worker", nprocs=2, timeout_s=150, extra_path=[TESTS_DIR]).check()
    ref = _one_thread(J.train_args(["--mesh", "data:2", "--layout", "batch:data"], argv=J.TRAIN_ARGV))
    capsys.readouterr()
    h = ref["history"]
    assert len(h["loss"]) == 5 and len(h["val_loss"]) == 1
    for rank, (losses, val, ids, (shape, batch_axis, heads_axis), out) in enumerate(run.results):
        assert (shape, batch_axis, heads_axis) == ("[data:2]", 0, None), rank  # batch split on data, heads whole
        assert _rel(losses, h["loss"]) <= 1e-5, (rank, losses, h["loss"])
        assert _rel(val, h["val_loss"]) <= 1e-5, (rank, val, h["val_loss"])
        assert ids == ref["sample_ids"] and len(ids) == 6, rank
        assert ("--mesh data:2 --layout batch:data" in out) == (rank == 0), (rank, out)

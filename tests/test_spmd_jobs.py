"""The MNIST job and ``meshtorch train`` as 4 gloo processes (SpmdMeshImpl, per-rank feeds) vs one
process on the simulated mesh (PlacementMeshImpl): same step losses, same accuracy, main-only output. The
4-rank runs are the tasks of one job (``ranks``): one start of 4 processes instead of four."""

from __future__ import annotations

import os

import pytest
import torch

import _spmd_jobs as J
from meshtorch.runtime.mnist import train_mnist
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
MESH, LAYOUT = "rows:2;cols:2", "batch:rows;hidden:cols"
CONV_MESH = ("b1:2;b2:2", "row_blocks:b1;col_blocks:b2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, once_per_run):
    """The one 4-rank job of this module (one process start for four checks, once per test run): (the directory
    the ``train`` task checkpointed to, {task: per-rank results})."""
    def run():
        ckpt = str(tmp_path_factory.mktemp("train") / "spmd")
        tasks = {"mnist": ("_spmd_jobs:mnist_worker", (MESH, LAYOUT)),
                 "mnist_conv": ("_spmd_jobs:mnist_conv_worker", (*CONV_MESH, "gelu")),
                 "train": ("_spmd_jobs:train_worker", (ckpt,)),
                 "train_compile": ("_spmd_jobs:train_compile_worker", ())}
        results = run_spmd("meshtorch.testing.spmd:run_tasks", args=(list(tasks.values()),), nprocs=4,
                           timeout_s=700, extra_path=[TESTS_DIR]).check().results
        return ckpt, {name: [per_rank[i] for per_rank in results] for i, name in enumerate(tasks)}

    return once_per_run("test_spmd_jobs_ranks", run)


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max())


def test_mnist_spmd_losses_equal_placement(ranks):
    results = ranks[1]["mnist"]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_mnist(MESH, LAYOUT, data=J.synthetic_mnist(), **J.MNIST_KW)
    finally:
        torch.set_num_threads(n)
    assert len(ref.step_losses) == 20
    for rank, (losses, acc, lines) in enumerate(results):
        assert len(losses) == 20, rank
        assert _rel(losses, ref.step_losses) <= 1e-5, (rank, losses, ref.step_losses)
        assert acc == ref.epochs[0].test_accuracy, (rank, acc)
        # only the main process logs
        assert (len(lines) == 2) == (rank == 0), (rank, lines)
    assert "processes 4" in results[0][2][0]


def test_mnist_conv_spmd_equals_placement(ranks):
    """Spatial partitioning as 4 gloo processes: the halo rows travel between ranks; same losses as placement."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_mnist("", "", data=J.synthetic_mnist(400, 40), activation="gelu", **J.CONV_KW)
    finally:
        torch.set_num_threads(n)
    assert len(ref.step_losses) == 6
    for rank, (losses, acc) in enumerate(ranks[1]["mnist_conv"]):
        assert _rel(losses, ref.step_losses) <= 1e-5, (rank, losses, ref.step_losses)
        assert acc == ref.epochs[0].test_accuracy, (rank, acc)


@pytest.mark.slow
def test_train_compile_spmd_equals_placement(ranks, capsys):
    """``meshtorch train --compile`` on 4 gloo ranks (data:2,model:2, collectives inside the compiled step,
    asynchronous, bucketed) gives the placement run's losses (generated function, not compiled) to 1e-5."""
    args = J.train_args(["--dropout", "0", "--sample", "0"])
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        h = args.func(args)["history"]
    finally:
        torch.set_num_threads(n)
    capsys.readouterr()
    for rank, (losses, val, compile_seconds, breaks) in enumerate(ranks[1]["train_compile"]):
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


def test_train_spmd_equals_placement(ranks, tmp_path, capsys):
    spmd_dir, results = ranks[0], ranks[1]["train"]
    ref = _one_thread(J.train_args(["--checkpoint-dir", str(tmp_path / "placement")]))
    ref_out = capsys.readouterr().out
    h = ref["history"]
    assert len(h["loss"]) == 5 and len(h["val_loss"]) == 1
    for rank, (losses, val, ids, out) in enumerate(results):
        assert _rel(losses, h["loss"]) <= 1e-5, (rank, losses, h["loss"])
        assert _rel(val, h["val_loss"]) <= 1e-5, (rank, val, h["val_loss"])
        assert ids == ref["sample_ids"] and len(ids) == 6, rank
        assert (out != "") == (rank == 0), (rank, out)  # only the main process prints
    assert "validation:" in results[0][3] and "sample:" in results[0][3] and "sample:" in ref_out

    # the checkpoint the 4 ranks saved restores on one process with the placement run's values
    import meshtorch as mtf
    lw, lm = ref["lowering"], ref["lm"]
    twin = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("", "")})
    assert mtf.restore(twin, spmd_dir)["step"] == 5
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

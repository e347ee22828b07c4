"""Functions run inside the gloo processes of tests/test_spmd_jobs.py and tests/test_checkpoint_spmd.py
(via meshtorch.testing.spmd.run_spmd). Each returns plain values that the parent process compares with
a PlacementMeshImpl run of the same job (the parent never trusts the workers' own comparisons)."""

from __future__ import annotations

import torch

MNIST_KW = dict(batch_size=100, hidden=64, lr=0.1, seed=0, epochs=1, steps_per_epoch=20)


def synthetic_mnist(n_train: int = 2000, n_test: int = 200):
    """A fixed random (Fashion-)MNIST stand-in: uint8 images [N, 28, 28], int64 labels [N]."""
    gen = torch.Generator().manual_seed(7)
    tx = torch.randint(0, 256, (n_train, 28, 28), dtype=torch.uint8, generator=gen)
    ty = torch.randint(0, 10, (n_train,), generator=gen)
    ex = torch.randint(0, 256, (n_test, 28, 28), dtype=torch.uint8, generator=gen)
    ey = torch.randint(0, 10, (n_test,), generator=gen)
    return (tx, ty), (ex, ey)


def mnist_worker(mesh_shape: str, layout: str):
    """train_mnist for 20 steps on synthetic data: (step losses, test accuracy, lines logged here)."""
    from meshtorch.runtime.mnist import train_mnist

    lines = []
    run = train_mnist(mesh_shape, layout, data=synthetic_mnist(), log=lines.append, start_log=lines.append,
                      **MNIST_KW)
    return run.step_losses, run.epochs[0].test_accuracy, lines


CONV_KW = dict(batch_size=8, hidden=16, lr=0.05, seed=0, epochs=1, steps_per_epoch=6, model_kind="conv")


def mnist_conv_worker(mesh_shape: str, layout: str, activation: str):
    """The conv model (halo exchange between ranks) for 6 steps on synthetic data: (losses, accuracy)."""
    from meshtorch.runtime.mnist import train_mnist

    run = train_mnist(mesh_shape, layout, data=synthetic_mnist(400, 40), activation=activation, **CONV_KW)
    return run.step_losses, run.epochs[0].test_accuracy


# ---------------------------------------------------------------------- checkpoints across process counts
CKPT_SAVE = ("rows:2;cols:2", "batch:rows;hidden:cols")
CKPT_RESTORE_2 = ("all:2", "hidden:all")


def ckpt_save_worker(path: str):
    """4 ranks: train the momentum MLP 2 steps on CKPT_SAVE, ``mtf.save`` (every rank writes its slices);
    return (losses, full variable values gathered with ``variable_value``, checkpoint directory)."""
    import _checkpoint_mlp as M
    import meshtorch as mtf
    from meshtorch.mesh import make_mesh_impl

    model = M.build(*CKPT_SAVE, make_impl=make_mesh_impl)
    losses = [float(v) for v in M.train(model, 0, 2)]
    final = mtf.save(model[0], path, step=2)
    return losses, M.values(model[0]), final


def ckpt_restore_worker(path: str):
    """2 ranks: restore onto CKPT_RESTORE_2; return (full values, the loss of the next training step)."""
    import _checkpoint_mlp as M
    import meshtorch as mtf
    from meshtorch.mesh import make_mesh_impl

    model = M.build(*CKPT_RESTORE_2, make_impl=make_mesh_impl)
    meta = mtf.restore(model[0], path)
    values = M.values(model[0])
    return values, float(M.train(model, 2, 1)[0]), meta["step"]


# ---------------------------------------------------------------------- meshtorch train
TRAIN_ARGV = ["train", "--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "2", "--d-kv", "16",
              "--d-ff", "64", "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--plot", "",
              "--checkpoint-dir", "", "--dropout", "0.1", "--lr", "3e-3", "--warmup-steps", "2", "--steps", "5",
              "--eval-every", "5", "--sample", "6", "--temperature", "0"]
TRAIN_ARGV_2X2 = [*TRAIN_ARGV, "--mesh", "data:2,model:2", "--layout", "batch:data;heads:model;d_ff:model;vocab:model"]


def train_args(extra=(), argv=TRAIN_ARGV_2X2):
    import argparse

    from meshtorch.cli.train import add_train_subcommand

    p = argparse.ArgumentParser()
    add_train_subcommand(p.add_subparsers(dest="cmd"))
    return p.parse_args([*argv, *extra])


def train_compile_worker():
    """``meshtorch train --compile`` (no dropout, asynchronous collectives, 1 MiB buckets) on a gloo rank:
    (train losses, validation losses, compile seconds per plan, dynamo's graph breaks)."""
    import contextlib
    import io

    from torch._dynamo.utils import counters

    counters.clear()
    args = train_args(["--dropout", "0", "--sample", "0", "--compile", "--async-collectives", "--bucket-mb", "1"])
    with contextlib.redirect_stdout(io.StringIO()):
        out = args.func(args)
    h = out["history"]
    return h["loss"], h["val_loss"], list(out["lowering"].session.compile_seconds.values()), \
        dict(counters["graph_break"])


def train_worker(checkpoint_dir: str):
    """``meshtorch train`` for 5 steps with a checkpoint: (train losses, validation losses, sample ids, stdout)."""
    import contextlib
    import io

    buf = io.StringIO()
    # asynchronous collectives and gradient buckets on the ranks: the same numbers as the placement run
    args = train_args(["--checkpoint-dir", checkpoint_dir, "--async-collectives", "--bucket-mb", "1"])
    with contextlib.redirect_stdout(buf):
        out = args.func(args)
    assert out["lowering"].mesh_impl(out["lm"].loss).async_collectives
    h = out["history"]
    return h["loss"], h["val_loss"], out["sample_ids"], buf.getvalue()


def train_default_mesh_worker():
    """``meshtorch train`` with neither --mesh nor --layout on a gloo rank (data parallel by default): (train
    losses, validation losses, sample ids, the mesh and layout the run used, stdout)."""
    import contextlib
    import io

    buf = io.StringIO()
    args = train_args(argv=TRAIN_ARGV)
    with contextlib.redirect_stdout(buf):
        out = args.func(args)
    impl = out["lowering"].mesh_impl(out["lm"].loss)
    h = out["history"]
    return h["loss"], h["val_loss"], out["sample_ids"], (str(impl.shape), impl.tensor_dimension_to_mesh_axis("batch"),
                                                           impl.tensor_dimension_to_mesh_axis("heads")), buf.getvalue()

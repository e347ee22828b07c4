"""Functions run inside the gloo processes of tests/test_spmd_jobs.py and tests/test_checkpoint_spmd.py
(via meshtorch.testing_spmd.run_spmd). Each returns plain values that the parent process compares with
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
    from meshtorch.mnist_job import train_mnist

    lines = []
    run = train_mnist(mesh_shape, layout, data=synthetic_mnist(), log=lines.append, start_log=lines.append,
                      **MNIST_KW)
    return run.step_losses, run.epochs[0].test_accuracy, lines

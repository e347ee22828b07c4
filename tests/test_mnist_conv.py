"""The convolutional MNIST model (Mesh TF examples/mnist.py): blocking, layout invariance, real-data training.

The full 2-epoch accuracy check (>= 84% on Fashion-MNIST, one processor vs the 2x2 spatial
partitioning) takes far longer than a test may on 2 CPU cores: it lives in benchmarks/mnist_conv.py.
Here: the first 20 training steps on real Fashion-MNIST data agree to 1e-5 between one processor
and the partitioned layout, the loss goes down, and the blocking is the plain reshape it claims.
"""

import gzip
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtorch.models.mnist_conv import DEFAULT_LAYOUT, DEFAULT_MESH, build_conv_model, to_blocks

DATA = "/usr/share/datasets/fashion-mnist"


def _read(name, header, n):
    with gzip.open(os.path.join(DATA, name), "rb") as f:
        return np.frombuffer(f.read()[header:], dtype=np.uint8)[:n]


def _train_batches(n):
    images = _read("train-images-idx3-ubyte.gz", 16, n * 784).reshape(n, 28, 28)
    labels = _read("train-labels-idx1-ubyte.gz", 8, n).astype(np.int64)
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.copy())


def test_to_blocks_is_the_block_reshape():
    x = torch.arange(2 * 28 * 28, dtype=torch.float32).reshape(2, 28, 28)
    b = to_blocks(x)
    assert b.shape == (2, 4, 4, 7, 7, 1)
    for i, j in [(0, 0), (1, 3), (3, 2)]:
        assert torch.equal(b[:, i, j, :, :, 0], x[:, 7 * i:7 * i + 7, 7 * j:7 * j + 7])
    with pytest.raises(ValueError, match="divide"):
        to_blocks(torch.zeros(1, 27, 28))


def test_forward_matches_plain_pytorch():
    """The blocked model's logits equal an unblocked torch model with the same weights (SAME conv, pad 4)."""
    model = build_conv_model(batch_size=4, seed=3, hidden_size=32)
    lw = model.make_lowering(DEFAULT_MESH, DEFAULT_LAYOUT)
    x, _ = _train_batches(4)
    logits = lw.run(model.logits, feeds=model.feeds(x, torch.zeros(4)))
    v = lw.variable_value
    a = x.to(torch.float32)[:, None] / 255.0
    a = F.relu(F.conv2d(a, v("conv0/kernel").permute(3, 2, 0, 1), padding=4))
    a = F.relu(F.conv2d(a, v("conv1/kernel").permute(3, 2, 0, 1), padding=4)).mean(1)
    a = a.reshape(4, 4, 7, 4, 7).permute(0, 1, 3, 2, 4)  # to [batch, row_blocks, col_blocks, rows, cols]
    a = F.relu(torch.einsum("brcij,rcijh->bh", a, v("hidden1/kernel")) + v("hidden1/bias"))
    a = F.relu(a @ v("hidden2/kernel") + v("hidden2/bias"))
    ref = a @ v("logits/kernel") + v("logits/bias")
    assert torch.allclose(logits, ref, rtol=1e-4, atol=1e-5), (logits - ref).abs().max()


def test_first_20_steps_agree_on_real_data():
    """One processor vs spatial partitioning b1:2;b2:2 (halo exchange across processors): same losses."""
    batch, steps = 10, 20
    xs, ys = _train_batches(batch * steps)
    runs = []
    for mesh_shape, layout in (("", ""), (DEFAULT_MESH, DEFAULT_LAYOUT)):
        model = build_conv_model(batch_size=batch, seed=0, learning_rate=0.02, warmup_steps=0)
        lw = model.make_lowering(mesh_shape, layout)
        losses = []
        for i in range(steps):
            sl = slice(i * batch, (i + 1) * batch)
            losses.append(float(lw.run(model.train_fetches(), feeds=model.feeds(xs[sl], ys[sl]))[0]))
        runs.append((losses, lw))
    (one, lw1), (part, lw4) = runs
    kinds = {c.kind for c in lw4.counters.records}
    assert "receive" in kinds  # the halo really crossed processors
    assert not any(c.kind == "receive" for c in lw1.counters.records)
    rel = max(abs(a - b) / abs(b) for a, b in zip(part, one, strict=True))
    assert rel <= 1e-5, (rel, one, part)
    assert np.mean(one[-5:]) < np.mean(one[:5]) - 0.05, one  # it learns


def test_float64_training_is_layout_invariant():
    """In float64 the layouts agree to rounding over training steps (float32 runs drift apart by chaos only)."""
    batch, steps = 4, 12
    xs, ys = _train_batches(batch * steps)
    runs = []
    for mesh_shape, layout in (("", ""), (DEFAULT_MESH, DEFAULT_LAYOUT)):
        model = build_conv_model(batch_size=batch, seed=1, hidden_size=64, learning_rate=0.05, warmup_steps=0,
                                 dtype=torch.float64)
        lw = model.make_lowering(mesh_shape, layout)
        runs.append([float(lw.run(model.train_fetches(), feeds=model.feeds(xs[i * batch:(i + 1) * batch],
                                                                            ys[i * batch:(i + 1) * batch]))[0])
                     for i in range(steps)])
    rel = max(abs(a - b) / abs(b) for a, b in zip(*runs, strict=True))
    assert rel <= 1e-10, rel

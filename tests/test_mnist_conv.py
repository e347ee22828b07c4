"""The convolutional MNIST model (Mesh TF examples/mnist.py): blocking, layout invariance, real-data training.

The full 2-epoch accuracy check (>= 84% on Fashion-MNIST, one processor vs the 2x2 spatial
partitioning vs plain PyTorch) takes far longer than a test may on 2 CPU cores: it lives in
benchmarks/mnist_conv.py. Here, on real Fashion-MNIST batches: the first training steps agree to
1e-5 between one processor, the partitioned layout and a plain-PyTorch reference (``F.conv2d`` on
whole images, ``torch.optim.SGD``); with GELU the float32 layouts stay together over 100 steps; in
float64 they agree to rounding; the blocking and standardization are the plain maps they claim.
"""

import gzip
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtorch.models.mnist_conv import (
    DEFAULT_LAYOUT,
    DEFAULT_MESH,
    build_conv_model,
    pixel_stats,
    to_blocks,
    torch_reference,
)

LAYOUTS = (("", ""), (DEFAULT_MESH, DEFAULT_LAYOUT))

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


def test_pixel_stats_and_standardized_blocks():
    images, _ = _train_batches(50)
    x = images.numpy().astype(np.float64) / 255.0
    mean, std = pixel_stats(images)
    assert abs(mean - x.mean()) < 1e-12 and abs(std - x.std(ddof=1)) < 1e-12
    assert pixel_stats(torch.from_numpy(x)) == pytest.approx((mean, std), rel=1e-12)
    b = to_blocks(images, mean=mean, std=std)
    want = (torch.from_numpy(x[:, 7:14, 21:28]).float() - mean) / std
    assert torch.allclose(b[:, 1, 3, :, :, 0], want, atol=1e-6)
    with pytest.raises(ValueError, match="two pixels"):
        pixel_stats(torch.zeros(1, 1, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="input_std"):
        build_conv_model(batch_size=2, input_std=0.0)
    with pytest.raises(ValueError, match="activation"):
        build_conv_model(batch_size=2, activation="tanh")


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
    with torch.no_grad():  # the reference module of the benchmark computes the same
        assert torch.allclose(torch_reference(model, lw)(x), ref, rtol=1e-4, atol=1e-5)


def _train(model, lw, xs, ys, batch, steps):
    fetches = model.train_fetches()
    return [float(lw.run(fetches, feeds=model.feeds(xs[i * batch:(i + 1) * batch], ys[i * batch:(i + 1) * batch]))[0])
            for i in range(steps)]


def _train_torch(model, lw, xs, ys, batch, steps, lr, warmup, clip):
    ref = torch_reference(model, lw)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warmup))
    losses, norms = [], []
    for i in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(ref(xs[i * batch:(i + 1) * batch]), ys[i * batch:(i + 1) * batch])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, norms


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_training_matches_plain_pytorch(activation):
    """Standardized inputs, warmup and clipping: 1 proc, 2x2 and torch.optim.SGD give the same 15 losses."""
    batch, steps, lr, warmup, clip = 10, 15, 0.1, 5, 1.0
    xs, ys = _train_batches(batch * steps)
    mean, std = pixel_stats(xs)
    runs = {}
    for mesh_shape, layout in LAYOUTS:
        model = build_conv_model(batch_size=batch, seed=2, hidden_size=64, learning_rate=lr, warmup_steps=warmup,
                                 clip_norm=clip, activation=activation, input_mean=mean, input_std=std)
        lw = model.make_lowering(mesh_shape, layout)
        if not mesh_shape:
            runs["torch"], norms = _train_torch(model, lw, xs, ys, batch, steps, lr, warmup, clip)
            assert min(norms) < clip < max(norms), norms  # clipping acts on some steps, not all
        runs[mesh_shape or "one"] = _train(model, lw, xs, ys, batch, steps)
    assert _max_rel(runs["one"], runs["torch"]) <= 1e-5, runs
    assert _max_rel(runs[DEFAULT_MESH], runs["torch"]) <= 1e-5, runs
    assert np.mean(runs["torch"][-3:]) < np.mean(runs["torch"][:3]) - 0.1, runs["torch"]  # it learns


@pytest.mark.slow
def test_gelu_float32_layouts_stay_together():
    """With GELU (a continuous derivative) float32 rounding differences do not grow: 100 steps within 1e-5.

    (Measured: 2.3e-6 at batch 25 with 16 filters and hidden 128; 3.5e-6 at the size here since 2026-11-28 for the
    suite's time, batch 10, 8 filters, hidden 64; <= 7e-7 at batch 50. With ReLU the same runs part: at this size
    by step 72, 4e-4 by step 100, as any two float32 runs with different summation orders do; see
    build_conv_model's docstring and benchmarks/mnist_conv_results.md.)
    """
    batch, steps = 10, 100
    xs, ys = _train_batches(batch * steps)
    mean, std = pixel_stats(xs)
    runs = []
    for mesh_shape, layout in LAYOUTS:
        model = build_conv_model(batch_size=batch, seed=0, hidden_size=64, filters=8, learning_rate=0.01,
                                 warmup_steps=20, activation="gelu", input_mean=mean, input_std=std)
        runs.append(_train(model, model.make_lowering(mesh_shape, layout), xs, ys, batch, steps))
    assert _max_rel(runs[1], runs[0]) <= 1e-5
    assert np.mean(runs[0][-20:]) < 0.7 * np.mean(runs[0][:20]), runs[0]


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
    assert "collective_permute" in kinds  # the halo really crossed processors
    assert not any(c.kind == "collective_permute" for c in lw1.counters.records)
    rel = max(abs(a - b) / abs(b) for a, b in zip(part, one, strict=True))
    assert rel <= 1e-5, (rel, one, part)
    assert np.mean(one[-5:]) < np.mean(one[:5]) - 0.05, one  # it learns


def test_float64_training_is_layout_invariant():
    """In float64 (ReLU, warmup: a float32 schedule cast to float64) the layouts agree to rounding."""
    batch, steps = 4, 12
    xs, ys = _train_batches(batch * steps)
    runs = []
    for mesh_shape, layout in LAYOUTS:
        model = build_conv_model(batch_size=batch, seed=1, hidden_size=64, learning_rate=0.05, warmup_steps=4,
                                 dtype=torch.float64)
        assert model.feeds(xs[:batch], ys[:batch])[model.images].dtype == torch.float64
        runs.append(_train(model, model.make_lowering(mesh_shape, layout), xs, ys, batch, steps))
    assert _max_rel(runs[1], runs[0]) <= 1e-10

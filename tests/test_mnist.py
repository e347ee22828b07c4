"""The MNIST job: IDX reader, the README model vs plain PyTorch, layout invariance, counters, CLI."""

import gzip
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.cli import main as cli_main
from meshtorch.data.mnist import DEFAULT_DATA_DIR, load_idx, load_mnist
from meshtorch.models.mnist import build_mnist_model
from meshtorch.runtime.mnist import evaluate, train_mnist

LAYOUTS = [("", ""), ("all:4", "batch:all"), ("all:4", "hidden:all"), ("rows:2;cols:2", "batch:rows;hidden:cols")]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread: on a shared, oversubscribed CPU two OpenMP threads per process made these
    tests ~20x slower (spinning threads), while one thread costs little when the machine is idle."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- IDX files
def _idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """IDX encoding written independently of the reader: big-endian magic, sizes, then the bytes."""
    array = np.asarray(array, dtype=np.uint8)
    magic = (0x0800 | array.ndim) if magic is None else magic
    header = int(magic).to_bytes(4, "big") + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    return header + array.tobytes()


def _write(path, data: bytes, compress: bool):
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def _write_split(d, prefix, images, labels, compress):
    sfx = ".gz" if compress else ""
    _write(d / f"{prefix}-images-idx3-ubyte{sfx}", _idx_bytes(images), compress)
    _write(d / f"{prefix}-labels-idx1-ubyte{sfx}", _idx_bytes(labels), compress)


def _synthetic(n, rows=28, cols=28, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, rows, cols), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gzip"])
def test_reader_round_trip(tmp_path, compress):
    images, labels = _synthetic(7, 5, 4)
    test_images, test_labels = _synthetic(3, 5, 4, seed=1)
    _write_split(tmp_path, "train", images, labels, compress)
    _write_split(tmp_path, "t10k", test_images, test_labels, compress)
    for split, (xi, yi) in (("train", (images, labels)), ("test", (test_images, test_labels))):
        x, y = load_mnist(split, str(tmp_path))
        assert x.dtype == torch.uint8 and y.dtype == torch.int64
        assert tuple(x.shape) == xi.shape and tuple(y.shape) == yi.shape
        assert torch.equal(x, torch.from_numpy(xi)) and torch.equal(y, torch.from_numpy(yi.astype(np.int64)))


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gzip"])
def test_reader_truncated_file(tmp_path, compress):
    images, _ = _synthetic(4)
    path = _write(tmp_path / "train-images-idx3-ubyte", _idx_bytes(images)[:-10], compress)
    with pytest.raises(mtf.DataError, match="truncated") as e:
        load_idx(str(path), 2051)
    assert str(path) in str(e.value)
    # a header cut short, and a gzip stream cut short
    short = _write(tmp_path / "short-idx3-ubyte", _idx_bytes(images)[:9], False)
    with pytest.raises(mtf.DataError, match="truncated") as e:
        load_idx(str(short), 2051)
    assert str(short) in str(e.value)
    cut = tmp_path / "cut-idx3-ubyte.gz"
    cut.write_bytes(gzip.compress(_idx_bytes(images))[:-20])
    with pytest.raises(mtf.DataError) as e:
        load_idx(str(cut), 2051)
    assert str(cut) in str(e.value)


def test_reader_wrong_magic(tmp_path):
    images, labels = _synthetic(4)
    _write_split(tmp_path, "train", images, labels, False)
    # labels file where the images file should be: magic 2049 instead of 2051
    _write(tmp_path / "train-images-idx3-ubyte", _idx_bytes(labels), False)
    with pytest.raises(mtf.DataError, match="magic") as e:
        load_mnist("train", str(tmp_path))
    assert "train-images-idx3-ubyte" in str(e.value) and "2051" in str(e.value)
    assert isinstance(e.value, mtf.MeshtorchError)


def test_reader_count_mismatch(tmp_path):
    images, labels = _synthetic(5)
    _write_split(tmp_path, "t10k", images, labels[:4], True)
    with pytest.raises(mtf.DataError, match="mismatch") as e:
        load_mnist("test", str(tmp_path))
    assert "t10k-images-idx3-ubyte.gz" in str(e.value) and "t10k-labels-idx1-ubyte.gz" in str(e.value)
    with pytest.raises(mtf.DataError, match="train-images-idx3-ubyte"):
        load_mnist("train", str(tmp_path))  # missing files are named too


# ----------------------------------------------------------------------------- real data
@pytest.fixture(scope="module")
def fashion():
    return load_mnist("train", DEFAULT_DATA_DIR), load_mnist("test", DEFAULT_DATA_DIR)


def _rel(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).abs() / b.abs()).max().item()


def test_first_steps_agree_across_layouts(fashion):
    runs = [train_mnist(m, lay, epochs=1, steps_per_epoch=20, data=fashion, evaluate_each_epoch=False)
            for m, lay in LAYOUTS]
    ref = runs[0].step_losses
    assert len(ref) == 20 and ref[-1] < ref[0]
    for (m, lay), run in zip(LAYOUTS[1:], runs[1:], strict=True):
        assert _rel(run.step_losses, ref) <= 1e-5, f"mesh {m!r} layout {lay!r}: {run.step_losses} vs {ref}"


def test_matches_plain_pytorch(fashion):
    """Same model in plain PyTorch (autograd + torch.optim.SGD), same initial weights and batches."""
    (train_x, train_y), _ = fashion
    batch, hidden, lr, seed, steps = 100, 1024, 0.1, 0, 20
    # meshtorch's own initial weights have torch.nn.Linear's scale: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    model = build_mnist_model(batch, hidden, lr, seed)
    w1_init = model.make_lowering().variable_value("w1")
    bound = 1 / 28
    assert w1_init.abs().max() <= bound and abs(w1_init.std().item() / (bound / 3 ** 0.5) - 1) < 0.02
    # the reference draws its own weights (nn.Linear) and copies them into meshtorch
    torch.manual_seed(123)
    lin1, lin2 = torch.nn.Linear(784, hidden, bias=False), torch.nn.Linear(hidden, 10, bias=False)
    w1 = lin1.weight.detach().t().contiguous()  # [784, hidden]
    w2 = lin2.weight.detach().t().contiguous()  # [hidden, classes]
    mesh_losses = {}
    for m, lay in (LAYOUTS[0], LAYOUTS[3]):
        model = build_mnist_model(batch, hidden, lr, seed)
        lw = model.make_lowering(m, lay)
        lw.set_variable_value("w1", w1.reshape(28, 28, hidden))
        lw.set_variable_value(model.w2, w2)
        perm = torch.randperm(train_x.shape[0], generator=torch.Generator().manual_seed(seed))
        losses = []
        for s in range(steps):
            idx = perm[s * batch:(s + 1) * batch]
            losses.append(lw.run(model.train_fetches(), feeds=model.feeds(train_x[idx], train_y[idx]))[0].item())
        mesh_losses[lay] = (losses, lw.variable_value("w2"))
    p1, p2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    opt = torch.optim.SGD([p1, p2], lr=lr)
    perm = torch.randperm(train_x.shape[0], generator=torch.Generator().manual_seed(seed))
    ref = []
    for s in range(steps):
        idx = perm[s * batch:(s + 1) * batch]
        x = train_x[idx].to(torch.float32).reshape(batch, -1) / 255.0
        loss = F.cross_entropy(torch.relu(x @ p1) @ p2, train_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    for lay, (losses, w2_final) in mesh_losses.items():
        assert _rel(losses, ref) <= 1e-5, f"layout {lay!r}: {losses} vs plain PyTorch {ref}"
        err = ((w2_final - p2.detach()).abs().max() / p2.detach().abs().max()).item()
        assert err <= 1e-5, f"layout {lay!r}: w2 after {steps} steps differs from PyTorch by {err:.3g}"


@pytest.mark.slow
def test_three_epochs_accuracy_all_layouts(fashion):
    """3 epochs on one processor (hidden 256): test accuracy >= 83% and falling epoch losses; each layout trains
    a 200-step epoch (evaluated on the whole test set), whose loss and accuracy agree with a one-processor run of
    the same 200 steps. The suite's time: 1800 + 4 x 200 steps (3 x 600 before 2026-11-28; the first 20 steps of
    each layout agree to 1e-5 in test_first_steps_agree_across_layouts)."""
    t0 = time.perf_counter()
    ref = train_mnist(*LAYOUTS[0], epochs=3, hidden=256, data=fashion)
    runs = {key: train_mnist(*key, epochs=1, hidden=256, data=fashion, steps_per_epoch=200) for key in LAYOUTS}
    print(f"\n3 epochs + 200 steps x {len(LAYOUTS)} layouts: {time.perf_counter() - t0:.1f}s")
    assert len(ref.epochs) == 3
    assert ref.epochs[-1].test_accuracy >= 0.83, f"test accuracy {ref.epochs[-1].test_accuracy}"
    losses = [e.train_loss for e in ref.epochs]
    assert losses[0] > losses[1] > losses[2]
    one = runs.pop(LAYOUTS[0])
    assert len(one.step_losses) == 200
    for key, run in runs.items():
        print(key, [(round(e.train_loss, 5), e.test_accuracy, round(e.examples_per_sec)) for e in run.epochs])
        assert len(run.epochs) == 1
        assert _rel([run.epochs[0].train_loss], [one.epochs[0].train_loss]) <= 1e-3, key
        assert abs(run.epochs[0].test_accuracy - one.epochs[0].test_accuracy) <= 0.005, key


# ----------------------------------------------------------------------------- communication
def test_hybrid_layout_counters():
    """2x2 "batch:rows;hidden:cols": the weight gradients all-reduce over rows, the logits over cols."""
    batch, hidden = 100, 1024
    model = build_mnist_model(batch, hidden)
    lw = model.make_lowering("rows:2;cols:2", "batch:rows;hidden:cols")
    w1_grad, w2_grad = model.w1_grad, model.w2_grad
    f32 = 4
    expected = {  # (tensor, mesh axes) -> bytes per processor = slice numel * itemsize
        (w1_grad.name, ("rows",)): 28 * 28 * (hidden // 2) * f32,  # w1 [rows, cols, hidden/cols]
        (w2_grad.name, ("rows",)): (hidden // 2) * 10 * f32,  # w2 [hidden/cols, classes]
        (model.logits.name, ("cols",)): (batch // 2) * 10 * f32,  # logits [batch/rows, classes]
    }
    planned = lw.plan_counters(model.train_fetches())
    feeds = model.feeds(torch.zeros(batch, 28, 28, dtype=torch.uint8), torch.zeros(batch, dtype=torch.int64))
    lw.run(model.train_fetches(), feeds=feeds)
    for counters in (planned, lw.counters):
        got = {(c.tensor, c.mesh_axes): (c.kind, c.bytes_per_processor, c.num_processors, n)
               for c, n in counters.records.items()}
        assert len(got) == sum(counters.records.values()) == len(expected) + 1, counters.summary()
        for key, nbytes in expected.items():
            assert got.pop(key, None) == ("allreduce", nbytes, 4, 1), f"{key}\n{counters.summary()}"
        # the one left: the sum inside the mean loss, a scalar partial sum over the split batch
        [((_, axes), rest)] = got.items()
        assert axes == ("rows",) and rest == ("allreduce", f32, 4, 1), counters.summary()
        assert counters.total_bytes() == 4 * (sum(expected.values()) + f32)


# ----------------------------------------------------------------------------- command line
def test_cli_mnist_on_synthetic_data(tmp_path, capsys):
    images, labels = _synthetic(60, seed=2)
    test_images, test_labels = _synthetic(25, seed=3)
    _write_split(tmp_path, "train", images, labels, True)
    _write_split(tmp_path, "t10k", test_images, test_labels, False)
    rc = cli_main(["mnist", "--mesh", "rows:2;cols:2", "--layout", "batch:rows;hidden:cols", "--epochs", "2",
                   "--batch-size", "10", "--hidden", "8", "--data-dir", str(tmp_path), "--no-progress",
                   "--trace-collectives"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "epoch 1/2: train loss" in out and "epoch 2/2: train loss" in out and "examples/s" in out
    assert "allreduce" in out and "communication over" in out
    # --trace-collectives: time per kind and mesh axes; its call counts are the executed counters' (no buckets)
    table = out[out.index("collective time by kind and mesh axes"):out.index("slowest")]
    rows = {tuple(ln.split()[:2]): int(ln.split()[2]) for ln in table.splitlines()[2:] if len(ln.split()) > 2}
    summary = out[out.index("communication over"):out.index("  by layer (or op family)")]
    counted = {tuple(ln.split()[:2]): int(ln.split()[2]) for ln in summary.splitlines()[2:]}
    assert rows == counted and rows[("allreduce", "rows")] > 0, (rows, counted)
    rc = cli_main(["mnist", "--data-dir", str(tmp_path / "nowhere"), "--no-progress"])
    assert rc == 2 and "train-images-idx3-ubyte" in capsys.readouterr().err


def test_evaluate_pads_last_batch(tmp_path):
    """Accuracy on 25 examples with batch 10 (last batch padded) equals argmax of the full-tensor model."""
    test_images, test_labels = _synthetic(25, seed=4)
    model = build_mnist_model(batch_size=10, hidden_size=16, seed=1)
    lw = model.make_lowering("all:2", "batch:all")
    x, y = torch.from_numpy(test_images), torch.from_numpy(test_labels.astype(np.int64))
    w1, w2 = lw.variable_value("w1").reshape(784, 16), lw.variable_value("w2")
    correct = int(((torch.relu(x.reshape(25, -1).float() / 255 @ w1) @ w2).argmax(-1) == y).sum())
    assert evaluate(model, lw, x, y) == correct / 25


@pytest.mark.slow
def test_bfloat16_activations_within_one_point_of_float32(fashion):
    """Issue acceptance: with bfloat16 activations the MLP MNIST model ends within 1 point of float32, on the 2x2
    mesh with the batch and the hidden dim split (the bfloat16 hidden activations' partial sums are reduced over
    ``cols``). The suite's one accuracy check of bfloat16 activations (test_mixed_precision ran a second one, an
    epoch of its own MLP on the same layout, until 2026-11-28; its one-step check against a float32 reference
    stays there)."""
    acc = {}
    for dtype in (torch.float32, torch.bfloat16):
        # hidden 128: bfloat16 matmuls are slow on CPUs without bf16 units (hidden 256 took 3-5x as long); on
        # 2026-11-28 hidden 128 gave float32 79.47%, bfloat16 79.36% (3.5 and 13.5 CPU s)
        run = train_mnist("rows:2;cols:2", "batch:rows;hidden:cols", epochs=1, hidden=128, data=fashion,
                          activation_dtype=dtype)
        acc[dtype] = run.epochs[-1].test_accuracy
    assert acc[torch.float32] >= 0.78
    assert abs(acc[torch.bfloat16] - acc[torch.float32]) <= 0.01, acc


def test_cli_conv_model_on_synthetic_data(tmp_path, capsys):
    images, labels = _synthetic(24, seed=5)
    _write_split(tmp_path, "train", images, labels, False)
    _write_split(tmp_path, "t10k", images[:8], labels[:8], False)
    rc = cli_main(["mnist", "--model", "conv", "--epochs", "1", "--batch-size", "8", "--hidden", "16",
                   "--data-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "epoch 1/1: train loss" in out
    assert "collective_permute" in out  # the halo exchange between processors of the spatially partitioned layout
    assert "meshtorch mnist (conv, relu)" in out


def test_conv_activation_and_standardization(tmp_path):
    """--activation gelu reaches the conv model; pixels are standardized by the training set's statistics."""
    from meshtorch.models.mnist_conv import pixel_stats
    images, labels = _synthetic(24, seed=5)
    data = ((torch.from_numpy(images), torch.from_numpy(labels)),) * 2
    run = train_mnist("", "", epochs=1, batch_size=8, hidden=16, data=data, model_kind="conv", activation="gelu",
                      evaluate_each_epoch=False)
    assert run.model.activation == "gelu" and run.config["activation"] == "gelu"
    assert (run.model.input_mean, run.model.input_std) == pixel_stats(images)
    assert any(op.name.startswith("gelu") for op in run.model.graph.operations)
    with pytest.raises(ValueError, match="conv model only"):
        train_mnist("", "", epochs=1, batch_size=8, hidden=16, data=data, activation="gelu")

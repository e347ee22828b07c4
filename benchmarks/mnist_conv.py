"""Train Mesh TF's convolutional MNIST model on Fashion-MNIST, on one processor and spatially partitioned.

Runs ``meshtorch.models.mnist_conv`` twice from the same seed: on one processor and on the 2x2 mesh
``b1:2;b2:2`` with ``row_blocks:b1;col_blocks:b2`` (halo exchange between processors), then prints
test accuracy after each epoch, per-epoch mean losses, their relative difference between the two
runs, the largest relative difference over the first 20 step losses, and the wall time.

    python benchmarks/mnist_conv.py [--epochs 2] [--batch 200] [--lr 0.02] [--max-steps N] [--threads T]
    # or the two runs as separate processes, then compare:
    python benchmarks/mnist_conv.py --run one --out one.json &
    python benchmarks/mnist_conv.py --run part --out part.json
    python benchmarks/mnist_conv.py --run compare one.json part.json

Data: the gzip IDX files in ``--data`` (default /usr/share/datasets/fashion-mnist).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from meshtorch.models.mnist_conv import DEFAULT_LAYOUT, DEFAULT_MESH, build_conv_model  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(path: str, header: int) -> np.ndarray:
    """Tiny IDX reader: the bytes after the header (images: 16 bytes, labels: 8)."""
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read()[header:], dtype=np.uint8)


def load(data_dir: str, split: str):
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), 16).reshape(-1, 28, 28)
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), 8).astype(np.int64)
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.copy())


def train(mesh_shape, layout, train_set, test_set, epochs=2, batch=200, lr=0.02, seed=0, max_steps=None,
          warmup=100, log=print):
    """Train; returns {"step_losses", "epoch_losses", "test_acc", "seconds"}."""
    model = build_conv_model(batch_size=batch, seed=seed, learning_rate=lr, warmup_steps=warmup)
    lw = model.make_lowering(mesh_shape, layout)
    xs, ys = train_set
    fetches = model.train_fetches()
    step_losses, epoch_losses, accs = [], [], []
    t0 = time.time()
    steps = 0
    for epoch in range(epochs):
        order = torch.from_numpy(np.random.RandomState(seed + epoch).permutation(len(xs)))
        losses = []
        for i in range(len(xs) // batch):
            idx = order[i * batch:(i + 1) * batch]
            loss = lw.run(fetches, feeds=model.feeds(xs[idx], ys[idx]))[0]
            losses.append(float(loss))
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
            if i % 50 == 0:
                log(f"  [{mesh_shape or '1 proc'}] epoch {epoch} step {i} loss {losses[-1]:.4f} "
                    f"({time.time() - t0:.0f}s)")
        step_losses += losses
        epoch_losses.append(float(np.mean(losses)))
        accs.append(accuracy(model, lw, test_set, batch))
        log(f"  [{mesh_shape or '1 proc'}] epoch {epoch}: mean loss {epoch_losses[-1]:.5f}, "
            f"test accuracy {accs[-1]:.4f} ({time.time() - t0:.0f}s)")
        if max_steps is not None and steps >= max_steps:
            break
    return {"step_losses": step_losses, "epoch_losses": epoch_losses, "test_acc": accs, "seconds": time.time() - t0}


def accuracy(model, lw, test_set, batch) -> float:
    xs, ys = test_set
    correct = 0
    n = len(xs) // batch * batch
    for i in range(0, n, batch):
        logits = lw.run(model.logits, feeds=model.feeds(xs[i:i + batch], ys[i:i + batch]))
        correct += int((logits.argmax(-1) == ys[i:i + batch]).sum())
    return correct / n


def rel(a, b) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=100, help="linear learning-rate warmup steps")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", default=DATA)
    p.add_argument("--run", choices=["both", "one", "part", "compare"], default="both",
                   help="train both layouts, only one (write --out JSON), or compare saved JSON results")
    p.add_argument("--out", default=None)
    p.add_argument("results", nargs="*", help="JSON files for --run compare")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    train_set, test_set = load(args.data, "train"), load(args.data, "test")
    kw = dict(epochs=args.epochs, batch=args.batch, lr=args.lr, seed=args.seed, max_steps=args.max_steps,
              warmup=args.warmup)
    if args.run != "compare":
        layouts = {"one": ("", ""), "part": (DEFAULT_MESH, DEFAULT_LAYOUT)}
        names = ["one", "part"] if args.run == "both" else [args.run]
        res = {n: train(*layouts[n], train_set, test_set, **kw) for n in names}
        if args.out:
            with open(args.out, "w") as f:
                json.dump({**res, "config": {"lr": args.lr, "warmup": args.warmup}}, f)
        if args.run != "both":
            return res
    else:
        res = {}
        for path in args.results:
            with open(path) as f:
                res.update(json.load(f))
    one, part = res["one"], res["part"]
    args.lr, args.warmup = res.get("config", {}).get("lr", args.lr), res.get("config", {}).get("warmup", args.warmup)
    print(f"torch {torch.__version__}, batch {args.batch}, lr {args.lr} (warmup {args.warmup} steps), momentum 0.9, "
          f"{args.epochs} epochs")
    for name, r in (("1 processor", one), (f"{DEFAULT_MESH} {DEFAULT_LAYOUT}", part)):
        print(f"{name:45s} test acc per epoch {[round(a, 4) for a in r['test_acc']]}  "
              f"epoch mean losses {[round(x, 6) for x in r['epoch_losses']]}  {r['seconds']:.0f}s")
    ep = [rel(a, b) for a, b in zip(part["epoch_losses"], one["epoch_losses"], strict=True)]
    n20 = min(20, len(one["step_losses"]))
    first = max(rel(a, b) for a, b in zip(part["step_losses"][:n20], one["step_losses"][:n20], strict=True))
    print(f"per-epoch mean loss rel. diff {[f'{e:.2e}' for e in ep]}; first {n20} steps max rel. diff {first:.2e}")
    print(f"time ratio partitioned / one processor: {part['seconds'] / one['seconds']:.2f}")
    return one, part


if __name__ == "__main__":
    main()

"""Train Mesh TF's convolutional MNIST model on Fashion-MNIST: one processor, spatially partitioned, plain PyTorch.

Three runs from the same initial weights, on the same batches in the same order:

* ``one``: meshtorch on one processor;
* ``part``: meshtorch on the 2x2 mesh ``b1:2;b2:2`` with ``row_blocks:b1;col_blocks:b2`` (each
  processor holds a quarter of every image; the convolutions exchange halos);
* ``torch``: the same network in plain PyTorch (``meshtorch.models.mnist_conv.torch_reference``:
  ``F.conv2d`` on whole images, ``torch.optim.SGD`` with momentum and the same warmup).

Each prints test accuracy after each epoch and writes its step losses (``--out`` JSON); ``--run
compare`` then prints, for each pair of runs, the relative difference of the per-epoch mean losses,
the largest relative difference of the first 20 step losses and of all step losses, and the
acceptance checks of issue 3 (accuracy >= 84% in 2 epochs; per-epoch means within 1e-3; first 20
steps within 1e-5). The ``torch`` run is the control: it differs from ``one`` only in summation
order, never in layout, so it shows how far float32 rounding alone moves a training run.

    python benchmarks/mnist_conv.py --run one --out one.json --threads 1 &
    python benchmarks/mnist_conv.py --run part --out part.json --threads 1
    python benchmarks/mnist_conv.py --run torch --out torch.json --threads 1
    python benchmarks/mnist_conv.py --run compare one.json part.json torch.json
    # options (give the same ones to every run): --activation relu|gelu  --dtype float32|float64
    #   --lr 0.01 --warmup 100 --batch 200 --epochs 2 --clip NORM --no-standardize --seed 0

Data: the gzip IDX files in ``--data`` (default /usr/share/datasets/fashion-mnist).
Results: ``benchmarks/mnist_conv_results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from meshtorch.data.mnist import DEFAULT_DATA_DIR, load_mnist  # noqa: E402
from meshtorch.models.mnist_conv import (  # noqa: E402
    DEFAULT_LAYOUT,
    DEFAULT_MESH,
    build_conv_model,
    pixel_stats,
    torch_reference,
)

RUNS = {"one": ("", ""), "part": (DEFAULT_MESH, DEFAULT_LAYOUT), "torch": None}
LABELS = {"one": "meshtorch, 1 processor", "part": f"meshtorch, {DEFAULT_MESH} {DEFAULT_LAYOUT}",
          "torch": "plain PyTorch (F.conv2d, torch.optim.SGD)"}


def batches(n: int, batch: int, epoch: int, seed: int):
    """The example ids of each step of ``epoch`` (a fixed permutation per (seed, epoch))."""
    order = torch.from_numpy(np.random.RandomState(seed + epoch).permutation(n))
    return [order[i * batch:(i + 1) * batch] for i in range(n // batch)]


def train(kind: str, train_set, test_set, epochs=2, batch=200, lr=0.01, warmup=100, seed=0, clip=None,
          activation="relu", dtype="float32", standardize=True, max_steps=None, weights_every=0, log=print) -> dict:
    """Train one run; returns {"step_losses", "epoch_losses", "test_acc", "seconds", "weights"}.

    ``weights``: ``{step: all trainable weights flattened}`` every ``weights_every`` steps (0: none).
    """
    xs, ys = train_set
    mean, std = pixel_stats(xs) if standardize else (0.0, 1.0)
    model = build_conv_model(batch_size=batch, seed=seed, learning_rate=lr, warmup_steps=warmup, clip_norm=clip,
                             activation=activation, input_mean=mean, input_std=std, dtype=getattr(torch, dtype))
    lw = model.make_lowering(*(RUNS[kind] or ("", "")))
    names = [v.name for v in model.graph.trainable_variables]
    if kind == "torch":
        ref = torch_reference(model, lw)
        opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warmup) if warmup else 1.0)

        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(ref(x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
            sched.step()
            return loss.item()

        def logits(x):
            with torch.no_grad():
                return ref(x)

        def weights():
            return torch.cat([ref.params[n.replace("/", "_")].detach().reshape(-1) for n in names])
    else:
        fetches = model.train_fetches()

        def step(x, y):
            return float(lw.run(fetches, feeds=model.feeds(x, y))[0])

        def logits(x):
            return lw.run(model.logits, feeds=model.feeds(x, torch.zeros(len(x), dtype=torch.int64)))

        def weights():
            return torch.cat([lw.variable_value(n).reshape(-1) for n in names])

    step_losses, epoch_losses, accs, snaps = [], [], [], {}
    t0 = time.time()
    for epoch in range(epochs):
        losses = []
        for i, idx in enumerate(batches(len(xs), batch, epoch, seed)):
            losses.append(step(xs[idx], ys[idx]))
            n = len(step_losses) + len(losses)
            if weights_every and n % weights_every == 0:
                snaps[n] = weights()
            if i % 50 == 0:
                log(f"  [{kind}] epoch {epoch} step {i} loss {losses[-1]:.4f} ({time.time() - t0:.0f}s)")
            if max_steps is not None and len(step_losses) + len(losses) >= max_steps:
                break
        step_losses += losses
        epoch_losses.append(float(np.mean(losses)))
        accs.append(accuracy(logits, test_set, batch))
        log(f"  [{kind}] epoch {epoch}: mean loss {epoch_losses[-1]:.6f}, test accuracy {accs[-1]:.4f} "
            f"({time.time() - t0:.0f}s)")
        if max_steps is not None and len(step_losses) >= max_steps:
            break
    return {"step_losses": step_losses, "epoch_losses": epoch_losses, "test_acc": accs, "seconds": time.time() - t0,
            "weights": snaps}


def accuracy(logits_fn, test_set, batch) -> float:
    xs, ys = test_set
    n = len(xs) // batch * batch
    correct = sum(int((logits_fn(xs[i:i + batch]).argmax(-1) == ys[i:i + batch]).sum()) for i in range(0, n, batch))
    return correct / n


def rel(a, b) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def agreement(a: dict, b: dict) -> dict:
    """Relative differences of run ``a`` from run ``b``: per-epoch means, first 20 steps, all steps."""
    n = min(len(a["step_losses"]), len(b["step_losses"]))
    steps = [rel(x, y) for x, y in zip(a["step_losses"][:n], b["step_losses"][:n], strict=True)]
    return {"epochs": [rel(x, y) for x, y in zip(a["epoch_losses"], b["epoch_losses"], strict=False)],
            "first20": max(steps[:20]), "all": max(steps),
            "first_step_over_1e-5": next((i for i, r in enumerate(steps) if r > 1e-5), None)}


def weight_distances(a: dict, b: dict) -> str:
    """``step:|w_a - w_b| / |w_b|`` at up to 12 of the steps both runs saved weights at."""
    steps = sorted(set(a) & set(b))
    pick = steps[::max(1, len(steps) // 12)]
    return " ".join(f"{k}:{float((a[k] - b[k]).norm() / b[k].norm()):.1e}" for k in pick)


def compare(res: dict, cfg: dict, epochs: int, weights: dict | None = None):
    print(f"torch {torch.__version__}; {cfg}")
    for k, r in res.items():
        print(f"{LABELS[k]:60s} test acc per epoch {[round(a, 4) for a in r['test_acc']]}  "
              f"epoch mean losses {[round(x, 6) for x in r['epoch_losses']]}  {r['seconds']:.0f}s")
    pairs = [(a, b) for a, b in (("part", "one"), ("torch", "one"), ("torch", "part")) if a in res and b in res]
    for a, b in pairs:
        g = agreement(res[a], res[b])
        print(f"{a} vs {b}: per-epoch mean loss rel. diff {[f'{e:.2e}' for e in g['epochs']]}; first 20 steps "
              f"max {g['first20']:.2e}; all steps max {g['all']:.2e}; first step > 1e-5: {g['first_step_over_1e-5']}")
        if weights and a in weights and b in weights:
            print(f"  weights' relative distance by step: {weight_distances(weights[a], weights[b])}")
    if "one" in res and "part" in res:
        one, part = res["one"], res["part"]
        g = agreement(part, one)
        acc = min(one["test_acc"][-1], part["test_acc"][-1])
        checks = {f"accuracy >= 84% after {epochs} epochs (both)": acc >= 0.84,
                  "per-epoch mean losses within 1e-3": max(g["epochs"]) <= 1e-3,
                  "first 20 steps within 1e-5": g["first20"] <= 1e-5}
        for what, ok in checks.items():
            print(f"  [{'met' if ok else 'NOT met'}] {what}")
        print(f"time ratio partitioned / one processor: {part['seconds'] / one['seconds']:.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=[*RUNS, "compare"], required=True,
                   help="train one run (write --out JSON), or compare saved JSON results")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=100, help="linear learning-rate warmup steps (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--activation", default="relu", choices=["relu", "gelu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--no-standardize", action="store_true", help="feed pixels in [0, 1] (Mesh TF) instead of "
                   "standardized by the training set's pixel mean and std")
    p.add_argument("--clip", type=float, default=None, help="clip gradients to this global norm")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", default=DEFAULT_DATA_DIR)
    p.add_argument("--out", default=None)
    p.add_argument("--weights-every", type=int, default=0,
                   help="save all weights every N steps next to --out (OUT.weights.pt); compare prints their distances")
    p.add_argument("results", nargs="*", help="JSON files for --run compare")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = {k: getattr(args, k) for k in ("batch", "lr", "warmup", "seed", "activation", "dtype", "clip")}
    cfg["standardize"] = not args.no_standardize
    if args.run == "compare":
        res, weights = {}, {}
        for path in args.results:
            with open(path) as f:
                saved = json.load(f)
            res.update(saved["runs"])
            cfg = saved["config"]
            if os.path.exists(path + ".weights.pt"):
                weights.update(torch.load(path + ".weights.pt"))
        return compare(res, cfg, args.epochs, weights)
    train_set, test_set = load_mnist("train", args.data), load_mnist("test", args.data)
    r = train(args.run, train_set, test_set, args.epochs, args.batch, args.lr, args.warmup, args.seed, args.clip,
              args.activation, args.dtype, not args.no_standardize, args.max_steps, args.weights_every)
    snaps = r.pop("weights")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": {args.run: r}, "config": cfg}, f)
        if snaps:
            torch.save({args.run: snaps}, args.out + ".weights.pt")
    return r


if __name__ == "__main__":
    main()

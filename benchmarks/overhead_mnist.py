"""Per-step overhead of meshtorch on the README MNIST model vs plain PyTorch.

Times one SGD training step (forward, backward, update) of the model of
``meshtorch.models.mnist`` (batch 100, hidden 1024 by default):

* meshtorch on a 1-processor mesh vs the same model in plain PyTorch (autograd +
  ``torch.optim.SGD``) on the same batch: goal ratio <= 1.15;
* meshtorch on a simulated 4-processor mesh with ``batch:all`` vs the 1-processor mesh
  (the cost of simulating 4 processors in one process: 4x the per-slice kernel launches
  plus the gradient all-reduces).

Steps of the variants are interleaved (A, B, A, B, ...) so that load from other processes
hits all of them alike; each figure is the median of ``--steps`` timed steps after warm-up.

Usage: ``PYTHONPATH=src python benchmarks/overhead_mnist.py [--steps 30] [--hidden 1024]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from meshtorch.models.mnist import build_mnist_model


def meshtorch_step(mesh_shape, layout, images, labels, hidden, lr):
    model = build_mnist_model(batch_size=images.shape[0], hidden_size=hidden, learning_rate=lr)
    lw = model.make_lowering(mesh_shape, layout)
    fetches = model.train_fetches()
    feeds = model.feeds(images, labels)
    return lambda: lw.run(fetches, feeds=feeds)[0]


def torch_step(images, labels, hidden, lr):
    b = images.shape[0]
    w1 = (torch.rand(28 * 28, hidden) * 2 - 1).div_(28).requires_grad_()
    w2 = (torch.rand(hidden, 10) * 2 - 1).div_(hidden ** 0.5).requires_grad_()
    opt = torch.optim.SGD([w1, w2], lr=lr)
    x = images.to(torch.float32).reshape(b, -1) / 255.0

    def step():
        loss = F.cross_entropy(torch.relu(x @ w1) @ w2, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def interleaved_medians(fns: dict, steps: int, warmup: int) -> dict:
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in fns}
    for _ in range(steps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave the default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.batch_size, 28, 28), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (args.batch_size,), generator=g)
    fns = {
        "torch": torch_step(images, labels, args.hidden, 0.1),
        "mtf_1proc": meshtorch_step("", "", images, labels, args.hidden, 0.1),
        "mtf_4proc_batch": meshtorch_step("all:4", "batch:all", images, labels, args.hidden, 0.1),
    }
    med = interleaved_medians(fns, args.steps, args.warmup)
    print(f"MNIST README model, batch {args.batch_size}, hidden {args.hidden}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.steps} steps after {args.warmup} warm-up")
    for k, v in med.items():
        print(f"  {k:<16} {1e3 * v:8.3f} ms/step")
    r1 = med["mtf_1proc"] / med["torch"]
    r4 = med["mtf_4proc_batch"] / med["mtf_1proc"]
    print(f"ratio meshtorch 1-proc / plain PyTorch:          {r1:.3f}  (goal <= 1.15)")
    print(f"ratio meshtorch 4-proc batch:all / 1-proc mesh:  {r4:.3f}")
    return med


if __name__ == "__main__":
    main()

"""Elementwise gradient kernels: PyTorch's fused backward ops vs the elementwise compositions they replace.

Times each pair interleaved (A, B, A, B, ...) on the LM's activation shape and prints median and spread
(min-max over repeats) in ms, and the ratio of medians. The "composed" column is what
``meshtorch.ops.elementwise`` used before 2026-11-23; "fused" is the kernel it uses now.

    python benchmarks/elementwise_grads.py --threads 1
    python benchmarks/elementwise_grads.py --threads 2 --shape 16,128,1024
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from meshtorch.ops import elementwise as ew


def _relu_grad_composed(x, dy):
    return torch.where(x > 0, dy, torch.zeros((), dtype=dy.dtype, device=dy.device))


def _gelu_grad_composed(x, dy):
    cdf = 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return dy * (cdf + x * pdf)


def _gelu_tanh_grad_composed(x, dy):
    k = math.sqrt(2.0 / math.pi)
    t = torch.tanh(k * (x + 0.044715 * x * x * x))
    return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x))


def _tanh_grad_composed(y, d):
    return d * (1 - y * y)


def _sigmoid_grad_composed(y, d):
    return d * y * (1 - y)


PAIRS = [("relu", _relu_grad_composed, ew._relu_grad, "x"),
         ("gelu", _gelu_grad_composed, ew._gelu_grad_exact, "x"),
         ("gelu_tanh", _gelu_tanh_grad_composed, ew._gelu_grad_tanh, "x"),
         ("tanh", _tanh_grad_composed, ew._k_tanh_grad, "tanh"),
         ("sigmoid", _sigmoid_grad_composed, ew._k_sigmoid_grad, "sigmoid")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="16,128,1024")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    dy = torch.randn(shape, generator=g)
    print(f"shape {shape}, float32, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'op':<10} {'composed ms (min-max)':>24} {'fused ms (min-max)':>22} {'ratio':>7} {'max |diff|':>11}")
    for name, old, new, arg in PAIRS:
        a = x if arg == "x" else getattr(torch, arg)(x)
        ref, got = old(a, dy), new(a, dy)
        diff = (ref - got).abs().max().item()
        ts = {"old": [], "new": []}
        for _ in range(3):
            old(a, dy), new(a, dy)
        for _ in range(args.repeats):
            for key, fn in (("old", old), ("new", new)):
                t0 = time.perf_counter()
                fn(a, dy)
                ts[key].append(1e3 * (time.perf_counter() - t0))
        mo, mn = statistics.median(ts["old"]), statistics.median(ts["new"])
        print(f"{name:<10} {mo:8.2f} ({min(ts['old']):6.2f}-{max(ts['old']):6.2f}) "
              f"{mn:8.2f} ({min(ts['new']):6.2f}-{max(ts['new']):6.2f}) {mn / mo:7.3f} {diff:11.2e}")


if __name__ == "__main__":
    main()

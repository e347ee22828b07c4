"""Attention slice kernels on the LM's shapes: F.scaled_dot_product_attention + autograd-recompute gradient
(the path for attention with a bias) vs aten's CPU flash forward/backward (the path without bias).

Slices as the LM lays them out: q, k, v [batch 16, length 128, heads 4, d_kv 64], causal. Interleaved,
ms median (min-max); checks that the two paths give the same values and gradients.

    python benchmarks/attention_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from meshtorch.layers import attention as A


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    al = ((0, 2, 1, 3), None)   # [batch, length, heads, d_kv] -> [batch, heads, length, d_kv]
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(16, 128, 4, 64, generator=g) for _ in range(4))
    p = {"align": (al, al, al), "causal": True, "scale": 0.125}
    sdpa_f = functools.partial(A._k_attention, b=None, bias_align=None, out_align=al, **p)
    sdpa_g = functools.partial(A._k_attention_grad, n=3, bias_align=None, out_align=al, **p)
    flash_f = functools.partial(A._k_attention_flash, out_align=al, **p)
    flash_g = functools.partial(A._k_attention_flash_grad, dy_align=al, back=(al, al, al), **p)
    out, lse = flash_f(q, k, v)
    diff = max([(a - b).abs().max().item() for a, b in zip(sdpa_g(q, k, v, dy), flash_g(q, k, v, out, lse, dy),
                                                           strict=True)] + [(sdpa_f(q, k, v) - out).abs().max().item()])
    fns = {"sdpa forward": lambda: sdpa_f(q, k, v), "flash forward (+lse)": lambda: flash_f(q, k, v),
           "autograd-recompute grad": lambda: sdpa_g(q, k, v, dy),
           "flash backward grad": lambda: flash_g(q, k, v, out, lse, dy)}
    ts = {n: [] for n in fns}
    for _ in range(3):
        for f in fns.values():
            f()
    for _ in range(args.repeats):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[n].append(1e3 * (time.perf_counter() - t0))
    print(f"threads {torch.get_num_threads()}, max |diff| between paths {diff:.2e}")
    for n, t in ts.items():
        print(f"{n:<26} {statistics.median(t):7.2f} ms ({min(t):.2f}-{max(t):.2f})")


if __name__ == "__main__":
    main()

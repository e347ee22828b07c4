"""float32 GEMM paths PyTorch offers on this CPU, on the LM's shapes: torch.mm (MKL) vs oneDNN.

For each (M, K, N): ``torch.mm(a[M,K], b[K,N])`` vs ``torch.ops.mkldnn._linear_pointwise(a, w)``
(oneDNN inner product on dense tensors; ``w = b^T`` must be [N, K]) timed two ways: with ``w``
already contiguous (a weight stored transposed) and including the ``b.t().contiguous()`` copy.
Interleaved (mm, oneDNN, oneDNN+copy, mm, ...); median GFLOP/s and min-max spread.

    python benchmarks/gemm_paths.py --threads 1
    python benchmarks/gemm_paths.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from host import describe

# batch 16 x length 128 = 2048 tokens; d_model 256, d_ff 1024, heads*d_kv 256, vocab 256.
SHAPES = [(2048, 256, 1024), (2048, 1024, 256), (2048, 256, 256),   # forward: ff in, ff out, q/k/v/o/logits
          (256, 2048, 1024), (1024, 2048, 256), (256, 2048, 256)]   # weight gradients: x^T dy


def _mm(a, b, w):
    return torch.mm(a, b)


def _onednn(a, b, w):
    return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")


def _onednn_copy(a, b, w):
    return torch.ops.mkldnn._linear_pointwise(a, b.t().contiguous(), None, "none", [], "")


PATHS = [("torch.mm", _mm), ("oneDNN", _onednn), ("oneDNN+copy", _onednn_copy)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; GFLOP/s median (min-max)")
    print(f"{'M x K x N':<18}" + "".join(f"{name:>24}" for name, _ in PATHS))
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        w = b.t().contiguous()
        ref = torch.mm(a, b)
        for _, fn in PATHS:
            assert torch.allclose(fn(a, b, w), ref, rtol=1e-4, atol=1e-3)
        ts = {name: [] for name, _ in PATHS}
        for _ in range(args.repeats):
            for name, fn in PATHS:
                t0 = time.perf_counter()
                fn(a, b, w)
                ts[name].append(time.perf_counter() - t0)
        flop = 2.0 * m * k * n
        cells = [f"{flop / statistics.median(t) / 1e9:7.1f} ({flop / max(t) / 1e9:5.0f}-{flop / min(t) / 1e9:5.0f})"
                 for t in ts.values()]
        print(f"{f'{m}x{k}x{n}':<18}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()

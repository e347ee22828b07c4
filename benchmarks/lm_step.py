"""One LM training step: meshtorch vs an equivalent plain-PyTorch model, and layouts vs 1 processor.

Same parameters and FLOPs (the TorchLM twin), autograd + torch.optim.AdamW vs meshtorch's graph
AdamW, same batch; median of --steps steps after warm-up. Prints the ratio (goal <= 1.2), the
4-processor placement layouts relative to 1 processor, achieved GFLOP/s, and MFU against a
float32 matmul peak measured in the same run.

    python benchmarks/lm_step.py            # d_model 256, d_ff 1024, 4 layers, 8 heads, batch 16, length 128
    # issue 13's LM: 4 heads x d_kv 64, Adafactor, no clipping, interleaved steps, 1 and 2 threads
    python benchmarks/lm_step.py --heads 4 --optimizer adafactor --clip 0 --no-layouts --threads 1
    python benchmarks/lm_step.py --heads 4 --optimizer adafactor --clip 0 --no-layouts --threads 2

meshtorch and PyTorch steps alternate (m, t, m, t, ...) so machine load hits both alike; times are
medians with the min-max spread. The GEMM peak is the best median torch.mm rate over the LM's own
GEMM shapes (2048 tokens x 256/1024), measured in the same run at the same thread count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from host import describe, mm_times
from lm_common import meshtorch_lm, torch_twin

import meshtorch as mtf
from meshtorch.models.transformer import LMConfig, flops_per_token
from meshtorch.runtime.train import measure_peak_flops

LAYOUTS = [("all:4", "batch:all"), ("all:4", "heads:all;d_ff:all;vocab:all"),
           ("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model")]


def _median_time(fn, steps, warmup=3):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _interleaved(fns, steps, warmup=3):
    """Median and (min, max) seconds of each of ``fns``, called in turn ``steps`` times after warm-up."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    ts = [[] for _ in fns]
    for _ in range(steps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), min(t), max(t)) for t in ts]


def _gemm_peak(tokens, d_model, d_ff, repeats=10):
    """Best median float32 torch.mm FLOP/s over the LM's GEMM shapes (forward and weight gradients)."""
    best = 0.0
    for m, k, n in ((tokens, d_model, d_ff), (tokens, d_ff, d_model), (tokens, d_model, d_model),
                    (d_model, tokens, d_ff)):
        best = max(best, 2.0 * m * k * n / statistics.median(mm_times(m, k, n, repeats)))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--executor", choices=("codegen", "interpret", "compile"), default="codegen",
                    help="meshtorch's executor (compile: torch.compile of the generated step; the first step "
                         "compiles, reported separately)")
    ap.add_argument("--optimizer", choices=("adamw", "adafactor"), default="adamw",
                    help="meshtorch AdamW vs torch.optim.AdamW, or meshtorch (Mesh TF) Adafactor vs "
                         "torch.optim.Adafactor")
    ap.add_argument("--clip", type=float, default=1.0, help="global-norm clipping on both sides (0: none)")
    ap.add_argument("--no-layouts", action="store_true", help="skip the 4-processor placement layouts")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = LMConfig(vocab_size=args.vocab, vocab_multiple=4, d_model=args.d_model, num_heads=args.heads,
                   d_kv=args.d_model // args.heads, d_ff=args.d_ff, num_layers=args.layers, length=args.length,
                   batch_size=args.batch_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    peak_512 = measure_peak_flops(1.0)
    peak = _gemm_peak(cfg.batch_size * cfg.length, cfg.d_model, cfg.d_ff)
    flops = flops_per_token(cfg) * cfg.batch_size * cfg.length
    clip = args.clip if args.clip > 0 else None

    lm, lw = meshtorch_lm(cfg, 0, 1e-3, 10, 1000, clip, optimizer=args.optimizer)
    model, opt, _ = torch_twin(cfg, lw, 1e-3, 10, 1000, optimizer=args.optimizer)
    fetches = [lm.loss] + lm.updates
    feeds = {lm.inputs: x, lm.targets: y}
    if args.executor != "codegen":  # the same variables (counter-based initial values), another executor
        lw = mtf.Lowering(lm.graph, {lm.mesh: lw.mesh_impl(lm.loss)}, mode=args.executor)
        t0 = time.perf_counter()
        lw.run(fetches, feeds=feeds)
        print(f"executor {args.executor}: first step {time.perf_counter() - t0:.1f} s "
              f"(compile_seconds {list(lw.session.compile_seconds.values())})")

    def torch_step():
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()

    (t_mtf, mtf_lo, mtf_hi), (t_torch, torch_lo, torch_hi) = _interleaved(
        [lambda: lw.run(fetches, feeds=feeds), torch_step], args.steps)
    print(describe())
    print(f"config: {cfg.num_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.num_heads} heads, "
          f"batch {cfg.batch_size} x length {cfg.length}, vocab {cfg.padded_vocab}; "
          f"{flops / 1e9:.2f} GFLOP per step; torch threads {torch.get_num_threads()}")
    print(f"optimizer {args.optimizer}, clip {clip}; interleaved, {args.steps} steps each")
    print(f"GEMM peak (float32 torch.mm, measured now): {peak / 1e9:.1f} GFLOP/s on the LM's shapes "
          f"({peak_512 / 1e9:.1f} on 512^3)")
    print(f"plain PyTorch       : {1e3 * t_torch:8.1f} ms/step ({1e3 * torch_lo:.1f}-{1e3 * torch_hi:.1f})  "
          f"{flops / t_torch / 1e9:6.1f} GFLOP/s  {100 * flops / t_torch / peak:5.1f}% of peak")
    print(f"meshtorch 1 proc    : {1e3 * t_mtf:8.1f} ms/step ({1e3 * mtf_lo:.1f}-{1e3 * mtf_hi:.1f})  "
          f"{flops / t_mtf / 1e9:6.1f} GFLOP/s  {100 * flops / t_mtf / peak:5.1f}% of peak")
    print(f"ratio meshtorch / torch (medians): {t_mtf / t_torch:.3f}  "
          f"(range {mtf_lo / torch_hi:.2f}-{mtf_hi / torch_lo:.2f}; executor {args.executor}; issue 13 goal "
          "<= 1.05 interpreted, <= 0.9 compiled)")
    if not args.no_layouts:
        for mesh_shape, layout in LAYOUTS:
            lm4, lw4 = meshtorch_lm(cfg, 0, 1e-3, 10, 1000, clip, mesh_shape, layout, args.optimizer)
            if args.executor != "codegen":  # the same executor as the 1-processor run
                lw4 = mtf.Lowering(lm4.graph, {lm4.mesh: lw4.mesh_impl(lm4.loss)}, mode=args.executor)
            f4 = {lm4.inputs: x, lm4.targets: y}
            t4 = _median_time(lambda: lw4.run([lm4.loss] + lm4.updates, feeds=f4), args.steps)  # noqa: B023
            print(f"placement {mesh_shape:<15} {layout:<45}: {1e3 * t4:8.1f} ms/step, "
                  f"ratio to 1 proc {t4 / t_mtf:.2f}")


if __name__ == "__main__":
    main()

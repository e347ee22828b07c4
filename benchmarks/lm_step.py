"""One LM training step: meshtorch vs an equivalent plain-PyTorch model, and layouts vs 1 processor.

Same parameters and FLOPs (the TorchLM twin), autograd + torch.optim.AdamW vs meshtorch's graph
AdamW, same batch; median of --steps steps after warm-up. Prints the ratio (goal <= 1.2), the
4-processor placement layouts relative to 1 processor, achieved GFLOP/s, and MFU against a
float32 matmul peak measured in the same run.

    python benchmarks/lm_step.py            # d_model 256, d_ff 1024, 4 layers, 8 heads, batch 16, length 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from lm_common import meshtorch_lm, torch_twin

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
    peak = measure_peak_flops(1.0)
    flops = flops_per_token(cfg) * cfg.batch_size * cfg.length

    lm, lw = meshtorch_lm(cfg, 0, 1e-3, 10, 1000, 1.0)
    model, opt, _ = torch_twin(cfg, lw, 1e-3, 10, 1000)
    fetches = [lm.loss] + lm.updates
    feeds = {lm.inputs: x, lm.targets: y}

    def torch_step():
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    t_mtf = _median_time(lambda: lw.run(fetches, feeds=feeds), args.steps)
    t_torch = _median_time(torch_step, args.steps)
    print(f"config: {cfg.num_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.num_heads} heads, "
          f"batch {cfg.batch_size} x length {cfg.length}, vocab {cfg.padded_vocab}; "
          f"{flops / 1e9:.2f} GFLOP per step; torch threads {torch.get_num_threads()}")
    print(f"matmul peak (float32, measured now): {peak / 1e9:.1f} GFLOP/s")
    print(f"plain PyTorch       : {1e3 * t_torch:8.1f} ms/step  {flops / t_torch / 1e9:6.1f} GFLOP/s  "
          f"MFU {100 * flops / t_torch / peak:5.1f}%")
    print(f"meshtorch 1 proc    : {1e3 * t_mtf:8.1f} ms/step  {flops / t_mtf / 1e9:6.1f} GFLOP/s  "
          f"MFU {100 * flops / t_mtf / peak:5.1f}%")
    print(f"ratio meshtorch / torch: {t_mtf / t_torch:.3f}  (goal <= 1.2)")
    if not args.no_layouts:
        for mesh_shape, layout in LAYOUTS:
            lm4, lw4 = meshtorch_lm(cfg, 0, 1e-3, 10, 1000, 1.0, mesh_shape, layout)
            f4 = {lm4.inputs: x, lm4.targets: y}
            t4 = _median_time(lambda: lw4.run([lm4.loss] + lm4.updates, feeds=f4), args.steps)  # noqa: B023
            print(f"placement {mesh_shape:<15} {layout:<45}: {1e3 * t4:8.1f} ms/step, "
                  f"ratio to 1 proc {t4 / t_mtf:.2f}")


if __name__ == "__main__":
    main()

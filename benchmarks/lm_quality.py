"""Validation loss of the meshtorch LM vs the same architecture in plain PyTorch.

Both start from identical weights and see the same batches in the same order (AdamW, cosine
schedule with warmup, global-norm clipping 1.0, no dropout). Prints both validation losses and
their relative difference (goal: within 2%).

    python benchmarks/lm_quality.py --preset tiny --steps 300
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from lm_common import meshtorch_lm, torch_twin

from meshtorch.data.text import ByteTokenizer, PackedDataset, load_documents
from meshtorch.models.transformer import PRESETS, preset


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--mesh", default="")
    ap.add_argument("--layout", default="")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = preset(args.preset)
    args.warmup = min(args.warmup, args.steps - 1)
    ds = PackedDataset.from_documents(load_documents(), ByteTokenizer(), cfg.length + 1)
    lm, lw = meshtorch_lm(cfg, args.seed, args.lr, args.warmup, args.steps, 1.0, args.mesh, args.layout)
    model, opt, sched = torch_twin(cfg, lw, args.lr, args.warmup, args.steps)
    t_m = t_t = 0.0
    epoch, it = 0, ds.batches(cfg.batch_size, args.seed, 0)
    for step in range(args.steps):
        b = next(it, None)
        if b is None:
            epoch += 1
            it = ds.batches(cfg.batch_size, args.seed, epoch)
            b = next(it)
        x, y = b[:, :-1], b[:, 1:]
        t0 = time.perf_counter()
        lm_loss = lw.run([lm.loss] + lm.updates, feeds={lm.inputs: x, lm.targets: y})[0].item()
        t1 = time.perf_counter()
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        t2 = time.perf_counter()
        t_m += t1 - t0
        t_t += t2 - t1
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  meshtorch {lm_loss:.4f}  torch {loss.item():.4f}")
    vm = vt = 0.0
    n = 0
    with torch.no_grad():
        for b in ds.batches(cfg.batch_size, 0, split="validation"):
            x, y = b[:, :-1], b[:, 1:]
            vm += lw.run(lm.loss, feeds={lm.inputs: x, lm.targets: y}).item()
            vt += model.loss(x, y).item()
            n += 1
            if n >= args.eval_batches:
                break
    vm, vt = vm / n, vt / n
    rel = abs(vm - vt) / vt
    print(f"\nvalidation loss after {args.steps} steps ({args.preset}, mesh {args.mesh!r} layout {args.layout!r}):")
    print(f"  meshtorch {vm:.4f} nats ({vm / math.log(2):.4f} bits/byte)   torch {vt:.4f} nats "
          f"({vt / math.log(2):.4f} bits/byte)")
    print(f"  relative difference {100 * rel:.3f}%  (goal <= 2%: {'met' if rel <= 0.02 else 'NOT met'})")
    print(f"  training time: meshtorch {t_m:.1f} s, torch {t_t:.1f} s, ratio {t_m / t_t:.2f}")


if __name__ == "__main__":
    main()

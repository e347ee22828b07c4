"""``--remat`` at the GPT-2-small shape: predicted and measured activation memory and step time, one process.

The LM of ``benchmarks/scale_124m.py`` (vocab 50257, d_model 768, 12 heads x 64, d_ff 3072, context 256;
``--layers`` blocks, ``--batch`` sequences), AdamW, one CPU thread, on one processor. Each policy runs in
a process of its own (so each has its own RSS high-water mark), the policies alternating ``--rounds``
times (none block none block ...: interleaved in time). Per run: the planner's predicted peak activations
(``MemoryReport.peak_activation_bytes``: intermediate values incl. gradients, dry run) and, measured,
the RSS high-water mark during the steps minus the RSS before the first step (variables and optimizer
slots are allocated by then: what remains is activations, gradients and transients), the step times
(after one warm-up step) and the losses, which must equal the run without remat.

Run: ``python benchmarks/remat_124m.py [--layers 12] [--batch 4] [--steps 2] [--rounds 1] [--policies none,block]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from rss import peak_rss_bytes, reset_peak  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.models.transformer import build_lm, preset  # noqa: E402
from meshtorch.planning import memory_report  # noqa: E402

MIB = 2 ** 20


def config(layers, batch, remat):
    return preset("tiny", vocab_size=50257, d_model=768, num_heads=12, d_kv=64, d_ff=3072, num_layers=layers,
                  length=256, batch_size=batch, remat=remat)


def worker(layers, batch, remat, steps, predict_only=False):
    torch.set_num_threads(1)
    cfg = config(layers, batch, remat)
    lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-4, weight_decay=0.0))
    fetches = [lm.loss] + lm.updates
    dry = mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec("", "")}, materialize=False)
    rep = memory_report(dry, fetches)
    out = {"predicted_activations": rep.peak_activation_bytes, "predicted_gradients": rep.gradient_bytes,
           "predicted_total": rep.total_bytes, "einsum_flops": rep.einsum_flops}
    if predict_only:
        return out
    del dry
    lw = lm.lowering()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (batch, cfg.length + 1), generator=g) for _ in range(steps + 1)]
    base = reset_peak()
    losses, times = [], []
    for ids in batches:
        t0 = time.perf_counter()
        losses.append(float(lw.run(fetches, feeds={lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})[0]))
        times.append(time.perf_counter() - t0)
    out.update(measured_activations=peak_rss_bytes() - base, losses=losses, times=times[1:])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--policies", default="none,block")
    ap.add_argument("--predict-only", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.layers, args.batch, args.worker, args.steps, args.predict_only)))
        return
    policies = args.policies.split(",")
    print(f"{args.layers} layers, batch {args.batch} x 256, vocab 50257, AdamW, 1 process, 1 thread; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    res = {p: [] for p in policies}
    for _ in range(1 if args.predict_only else args.rounds):
        for p in policies:
            cmd = [sys.executable, __file__, "--worker", p, "--layers", str(args.layers), "--batch", str(args.batch),
                   "--steps", str(args.steps)] + (["--predict-only"] if args.predict_only else [])
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            r = json.loads(done.stdout.splitlines()[-1])
            res[p].append(r)
            print(f"  {p}: {json.dumps(r)}", flush=True)
    base = res[policies[0]]
    for p in policies:
        pa = res[p][0]["predicted_activations"]
        line = (f"{p:<10} predicted activations {pa / MIB:8.0f} MiB ({pa / base[0]['predicted_activations']:.2f} of "
                f"{policies[0]}), gradients {res[p][0]['predicted_gradients'] / MIB:.0f} MiB, einsum FLOPs "
                f"{res[p][0]['einsum_flops'] / base[0]['einsum_flops']:.2f}x")
        if not args.predict_only:
            ma = max(r["measured_activations"] for r in res[p])
            t = [x for r in res[p] for x in r["times"]]
            tb = [x for r in base for x in r["times"]]
            dl = max(abs(a - b) for r, rb in zip(res[p], base, strict=True)
                     for a, b in zip(r["losses"], rb["losses"], strict=True))
            mb = max(r["measured_activations"] for r in base)
            ratio = statistics.median(t) / statistics.median(tb)
            line += (f"; measured {ma / MIB:.0f} MiB ({ma / mb:.2f}); step s median {statistics.median(t):.2f} "
                     f"({min(t):.2f}-{max(t):.2f}), {ratio:.2f}x; max |loss - {policies[0]}| {dl:.2e}")
        print(line)


if __name__ == "__main__":
    main()

"""Peak memory while creating the lowering (drawing the initial values) vs the bytes of the variables.

Issue 21's first acceptance line: creating the lowering of a >= 100M-parameter model must not peak above
1.5x the bytes of the variables (weights and optimizer slots) a process holds. Each job runs in fresh
processes (``meshtorch.testing.spmd.run_spmd``: torchrun's environment, one CPU thread each,
``MALLOC_MMAP_THRESHOLD_=131072`` so freed large blocks leave the RSS as in the other memory benchmarks):

1. replicated: one process, the whole model on a one-processor placement mesh;
2. FSDP: 2 gloo processes, ``SpmdMeshImpl("data:2", "batch:data", storage="d_model:data")``: each holds
   its half of every variable with a ``d_model`` dimension;
3. (with ``--lazy``) the same two with ``Lowering(..., init="lazy")``: nothing is drawn (a checkpoint
   restore would set the values).

Each process builds the graph (:func:`meshtorch.models.transformer.build_lm` with AdamW), then records its
RSS and resets the high-water mark (``/proc/self/clear_refs``), creates the ``Lowering`` and reads its peak
RSS (VmHWM): "growth" = peak - RSS before; "variables" = bytes of the variable slices it holds (measured
from the tensors); the ratio growth / variables is the number the issue bounds at 1.5.

Run: ``python benchmarks/init_memory.py [--layers 12 --d-model 768 ...] [--lazy]`` (the defaults are
GPT-2 small's shape with untied embeddings: 162M parameters, 1.9 GiB of variables with AdamW's slots).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from rss import peak_rss_bytes, reset_peak, rss_bytes  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.models.transformer import build_lm, preset  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402

MIB = 2 ** 20


def worker(cfg_kw: dict, storage: str | None, init: str) -> dict:
    """One process: build the LM graph, then create its lowering; RSS before, peak growth, variable bytes."""
    cfg = preset("tiny", **cfg_kw)
    lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0))
    if storage is None:
        impl = mtf.PlacementMeshImpl("", "")
    else:
        impl = mtf.SpmdMeshImpl(f"data:{torch.distributed.get_world_size()}", "batch:data", storage=storage)
    before = reset_peak()
    t0 = time.perf_counter()
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl}, **({} if init == "random" else {"init": init}))
    seconds = time.perf_counter() - t0
    growth = peak_rss_bytes() - before
    held = sum(s.numel() * s.element_size() for v in lw.store.values.values() if v is not None
               for s in {id(t): t for t in impl.local_slices(v)}.values())
    n_params = sum(v.shape.size for v in lm.graph.trainable_variables)
    return {"before": before, "growth": growth, "held": held, "after": rss_bytes() - before, "seconds": seconds,
            "params": n_params}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--d-ff", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--lazy", action="store_true", help='also measure Lowering(..., init="lazy")')
    ap.add_argument("--skip-fsdp", action="store_true")
    args = ap.parse_args(argv)
    cfg_kw = dict(vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads, d_kv=args.d_model // args.heads,
                  d_ff=args.d_ff, num_layers=args.layers, length=args.length, batch_size=2)
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    jobs = [("replicated, 1 process", 1, None, "random")]
    if not args.skip_fsdp:
        jobs.append(("FSDP d_model:data, 2 gloo ranks", 2, "d_model:data", "random"))
    if args.lazy:
        jobs += [(name.replace(",", ', init="lazy",', 1), n, st, "lazy") for name, n, st, _ in list(jobs)]
    print(f"LM: {args.layers} layers, d_model {args.d_model}, d_ff {args.d_ff}, vocab {args.vocab}, AdamW; "
          f"torch {torch.__version__}, 1 thread per process")
    print(f"{'job':<46}{'rank':>5}{'variables MiB':>15}{'growth MiB':>12}{'growth/vars':>13}{'seconds':>9}")
    for name, n, storage, init in jobs:
        res = run_spmd("init_memory:worker", args=(cfg_kw, storage, init), nprocs=n, timeout_s=1800,
                       extra_path=[HERE], env=env).check().results
        for r, out in enumerate(res):
            ratio = out["growth"] / out["held"] if out["held"] else float("nan")
            print(f"{name:<46}{r:>5}{out['held'] / MIB:>15.1f}{out['growth'] / MIB:>12.1f}{ratio:>13.2f}"
                  f"{out['seconds']:>9.1f}")
        print(f"   ({res[0]['params'] / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()

"""bf16 training under five layouts, on one process and on gloo ranks: loss curves vs float32 and each other.

Issue 31's acceptance: ``--steps`` (default 50) AdamW steps of a small LM (``meshtorch train``'s own path,
:func:`meshtorch.runtime.train.main_train`, ``--precision bf16``, no dropout) under five layouts of
``--ranks`` processors: data parallel, data parallel with FSDP storage (``--ranks 2``) or the 2x2 Megatron
layout with storage ``d_model:data`` (``--ranks 4``), Megatron model parallel, ``all:N`` model parallel and a
2-stage GPipe layout; each on the placement mesh in this process and on ``--ranks`` gloo processes (torchrun's
path, :func:`meshtorch.testing.spmd.run_spmd`), plus the one-processor run in bf16 and in fp32. Printed per
run: the largest per-step relative loss difference and the final-loss relative difference against the
one-processor fp32 run and the one-processor bf16 run (the bound of the issue: 2% per step, 1% final).

Run (from the repository root): ``python benchmarks/bf16_layouts.py [--ranks 2|4] [--steps 50] [--no-gloo]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import torch  # noqa: E402

from meshtorch.core.errors import UsageError  # noqa: E402
from meshtorch.runtime.train import main_train  # noqa: E402
from meshtorch.runtime.train_config import TrainConfig  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402

#: the model and run (tiny: bfloat16 matmuls are slow on CPUs without bf16 units); no dropout, so layouts agree
FLAGS = dict(preset="tiny", layers=2, d_model=32, heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
             vocab_size=64, lr=1e-2, warmup_steps=5, eval_batches=1, sample=0, plot="", dropout=0.0)


def layouts(n: int) -> dict:
    """name -> (mesh, layout, storage, pipeline stages or None) of the five layouts of ``n`` (2 or 4) processors."""
    if n == 2:
        fsdp = ("data:2", "batch:data", "d_model:data", None)
        pipe = ("pipe:2", "stage:pipe", "", 2)
    else:
        fsdp = ("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model", "d_model:data", None)
        pipe = ("pipe:2,data:2", "stage:pipe;batch:data", "", 2)
    return {
        "data parallel": (f"data:{n}", "batch:data", "", None),
        "FSDP storage" if n == 2 else "2x2 Megatron, storage d_model:data": fsdp,
        "Megatron model parallel": (f"model:{n}", "heads:model;d_ff:model;vocab:model", "", None),
        f"all:{n} model parallel": (f"all:{n}", "heads:all;d_ff:all;vocab:all", "", None),
        "2-stage pipeline": pipe,
    }


def train(root: str, name: str, precision: str, steps: int, mesh: str = "", layout: str = "", storage: str = "",
          stages: int | None = None) -> list[float]:
    """The per-step training losses of one ``meshtorch train`` run (in this process, or in each gloo rank)."""
    extra = dict(pipeline_stages=stages, microbatches=2) if stages else {}
    cfg = TrainConfig(**FLAGS, **extra, steps=steps, eval_every=steps, precision=precision, mesh=mesh or None,
                      layout=layout or None, storage=storage, runs_dir=root, run_name=name)
    with contextlib.redirect_stdout(io.StringIO()):  # the run's log and plan: not this report's
        res = main_train(cfg)
    return [float(x) for x in res["history"]["loss"]]


def rank_job(root: str, name: str, steps: int, mesh: str, layout: str, storage: str, stages):
    """:func:`train` in bf16 inside one gloo rank (``run_spmd``'s target)."""
    return train(root, name, "bf16", steps, mesh, layout, storage, stages)


def deviations(losses: list[float], ref: list[float]) -> tuple[float, float]:
    """(largest per-step relative difference, final-step relative difference) of ``losses`` against ``ref``."""
    if len(losses) != len(ref):
        raise ValueError(f"{len(losses)} losses against {len(ref)} reference losses")
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True)]
    return max(rel), rel[-1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, choices=(2, 4), help="processors per layout (default 2)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-gloo", action="store_true", help="only the placement mesh in this process")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per gloo job")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}.")
    torch.set_num_threads(1)
    print(f"bf16 layouts: {args.steps} AdamW steps, {args.ranks} processors per layout, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bf16-layouts-") as root:
        t0 = time.time()
        runs["1 processor, fp32"] = train(root, "fp32-one", "fp32", args.steps)
        runs["1 processor, bf16"] = train(root, "bf16-one", "bf16", args.steps)
        for i, (name, (mesh, layout, storage, stages)) in enumerate(layouts(args.ranks).items()):
            runs[f"{name} (placement mesh)"] = train(root, f"bf16-{i}-placement", "bf16", args.steps, mesh, layout,
                                                     storage, stages)
            if not args.no_gloo:
                res = run_spmd("bf16_layouts:rank_job", args=(root, f"bf16-{i}-gloo", args.steps, mesh, layout,
                                                              storage, stages),
                               nprocs=args.ranks, timeout_s=args.timeout, extra_path=[HERE]).check()
                ranks = res.results
                if any(r != ranks[0] for r in ranks):
                    raise RuntimeError(f"{name}: the gloo ranks report different losses")
                runs[f"{name} ({args.ranks} gloo ranks)"] = ranks[0]
            print(f"  {name}: done ({time.time() - t0:.0f} s)", flush=True)
    fp32, bf16 = runs["1 processor, fp32"], runs["1 processor, bf16"]
    print(f"\nfirst / last loss (1 processor, fp32): {fp32[0]:.4f} / {fp32[-1]:.4f}")
    print("| run | vs fp32: max per step | vs fp32: final | vs 1-processor bf16: max per step | final |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for name, losses in runs.items():
        a, b = deviations(losses, fp32)
        c, d = deviations(losses, bf16)
        if "fp32" not in name:
            worst = max(worst, a)
        print(f"| {name} | {a:.2e} | {b:.2e} | {c:.2e} | {d:.2e} |")
    print(f"\nlargest per-step deviation of a bf16 run from fp32: {worst:.2e} (bound 2e-2); "
          f"bf16 runs against one another: see the last two columns")


if __name__ == "__main__":
    main()

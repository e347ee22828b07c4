"""bf16 training under five layouts, on one process and on gloo ranks: loss curves vs float32 and each other.

Issue 31's acceptance: ``--steps`` (default 50) AdamW steps of a small LM (``meshtorch train``'s own path,
:func:`meshtorch.runtime.train.main_train`, ``--precision bf16``, no dropout) under five layouts of
``--ranks`` processors: data parallel, data parallel with FSDP storage (``--ranks 2``) or the 2x2 Megatron
layout with storage ``d_model:data`` (``--ranks 4``), Megatron model parallel, ``all:N`` model parallel and a
2-stage GPipe layout; each on the placement mesh in this process and on ``--ranks`` gloo processes (torchrun's
path, :func:`meshtorch.testing.spmd.run_spmd`), plus the one-processor run in bf16 and in fp32. The reference
is the same model in plain PyTorch (:class:`meshtorch.testing.torch_lm.TorchLM`) on the run's initial weights
and batches (captured from the one-processor run), trained as the issue states: ``torch.autocast("cpu",
bfloat16)`` with float32 masters, ``clip_grad_norm_``, ``torch.optim.AdamW`` at the run's schedule
(:func:`meshtorch.runtime.train.host_lr`); the same loop in float32 checks the reference itself against
meshtorch's fp32 run. Printed per run: the largest per-step relative loss difference and the final-loss
relative difference against PyTorch autocast bf16, the one-processor fp32 run and the one-processor bf16 run;
the script exits 1 if a bf16 run misses the issue's bound against PyTorch autocast (2% at every step, 1% final)
or the fp32 reference differs from meshtorch's fp32 run by more than 1e-3 at a step.

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
from meshtorch.runtime import train as train_module  # noqa: E402
from meshtorch.runtime.train import host_lr, main_train  # noqa: E402
from meshtorch.runtime.train_config import TrainConfig  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402
from meshtorch.testing.torch_lm import TorchLM  # noqa: E402

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


def config(root: str, name: str, precision: str, steps: int, mesh: str = "", layout: str = "", storage: str = "",
           stages: int | None = None) -> TrainConfig:
    """The :class:`TrainConfig` of one run (``FLAGS``, and what the layout needs)."""
    extra = dict(pipeline_stages=stages, microbatches=2) if stages else {}
    return TrainConfig(**FLAGS, **extra, steps=steps, eval_every=steps, precision=precision, mesh=mesh or None,
                       layout=layout or None, storage=storage, runs_dir=root, run_name=name)


def train(root: str, name: str, precision: str, steps: int, mesh: str = "", layout: str = "", storage: str = "",
          stages: int | None = None, capture: dict | None = None) -> list[float]:
    """The per-step training losses of one ``meshtorch train`` run (in this process, or in each gloo rank).

    ``capture`` (a dict; one-processor runs only): filled with the run's model config (``"lm_config"``), its
    initial variable values before the first step (``"weights"``) and each step's token batch
    (``"batches"``, int64 ``[batch, length + 1]``; the evaluation's batches follow the ``steps`` training
    ones), read where the training loop feeds its lowering."""
    cfg = config(root, name, precision, steps, mesh, layout, storage, stages)
    feeds = train_module.batch_feeds
    if capture is not None:
        def recording(lowering, lm, batch):
            if "weights" not in capture:
                capture["weights"] = {n: lowering.variable_value(n).clone() for n in lowering.variable_names}
                capture["lm_config"] = lm.config
            capture.setdefault("batches", []).append(batch.clone())
            return feeds(lowering, lm, batch)
        train_module.batch_feeds = recording
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            res = main_train(cfg)  # the run's log, plan and progress bar: not this report's
    finally:
        train_module.batch_feeds = feeds
    return [float(x) for x in res["history"]["loss"]]


def torch_reference(capture: dict, cfg: TrainConfig, autocast: bool) -> list[float]:
    """Per-step losses of the same model in plain PyTorch (:class:`TorchLM`) from ``capture``'s initial weights
    on its batches: float32 masters, ``torch.optim.AdamW`` (betas 0.9/0.999, eps 1e-8, ``cfg``'s weight decay)
    at ``host_lr(cfg, step)``, ``clip_grad_norm_(cfg.clip_norm)``; the forward under
    ``torch.autocast("cpu", bfloat16)`` if ``autocast`` (else float32)."""
    model = TorchLM(capture["lm_config"])
    model.load_state_dict({n.replace("/", "."): v for n, v in capture["weights"].items()
                           if "/adam_" not in n and n != "global_step"})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=cfg.weight_decay)
    losses = []
    for step, batch in enumerate(capture["batches"][:cfg.steps]):  # then the evaluation's batches
        for group in opt.param_groups:
            group["lr"] = host_lr(cfg, step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if cfg.clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        opt.step()
        losses.append(loss.item())
    return losses


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
        capture = {}
        runs["1 processor, fp32"] = train(root, "fp32-one", "fp32", args.steps, capture=capture)
        tcfg = config(root, "torch", "fp32", args.steps)
        runs["plain PyTorch, fp32"] = torch_reference(capture, tcfg, autocast=False)
        runs["plain PyTorch, autocast bf16"] = torch_reference(capture, tcfg, autocast=True)
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
    ref = runs["plain PyTorch, autocast bf16"]
    print(f"\nfirst / last loss (1 processor, fp32): {fp32[0]:.4f} / {fp32[-1]:.4f}")
    print("| run | vs PyTorch autocast bf16: max per step | final | vs fp32: max per step | final "
          "| vs 1-processor bf16: max per step | final |")
    print("|---|---|---|---|---|---|---|")
    worst, worst_final = 0.0, 0.0
    for name, losses in runs.items():
        e, f = deviations(losses, ref)
        a, b = deviations(losses, fp32)
        c, d = deviations(losses, bf16)
        if "fp32" not in name and "PyTorch" not in name:
            worst, worst_final = max(worst, e), max(worst_final, f)
        print(f"| {name} | {e:.2e} | {f:.2e} | {a:.2e} | {b:.2e} | {c:.2e} | {d:.2e} |")
    check = deviations(runs["plain PyTorch, fp32"], fp32)[0]
    print(f"\nbf16 runs vs plain PyTorch autocast: largest per-step {worst:.2e} (bound 2e-2), largest final "
          f"{worst_final:.2e} (bound 1e-2); the fp32 reference vs meshtorch fp32: {check:.2e} per step (bound 1e-3)")
    if worst > 2e-2 or worst_final > 1e-2 or check > 1e-3:
        sys.exit(1)


if __name__ == "__main__":
    main()

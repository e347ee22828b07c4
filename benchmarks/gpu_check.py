"""meshtorch on one GPU: correctness against the CPU, the NCCL path, and fp32 / TF32 / bf16 steps against PyTorch.

Not a test (CI has no GPU). One command on a machine with one CUDA GPU (not yet run on one in this form: the
2026-11-25 H100 run compiled each 162M-shaped side in about 50 s, so six compiled configurations and the
eager ones should fit 8 minutes; ``--time-budget``, default 420 s, stops starting new configurations after
that many seconds, bf16 and TF32 first, and ``--modes eager`` or ``--precisions`` narrow it):

    cd benchmarks && PYTHONPATH=../src python3 gpu_check.py

and, to know it works before a GPU session, in seconds on a CPU:

    cd benchmarks && PYTHONPATH=../src python3 gpu_check.py --device cpu --tiny

It prints:

1. **Placement mesh on the GPU** (CUDA only; ``--skip-checks`` skips 1 and 2): the small LM (AdamW, 5 steps)
   on mesh ``data:2,model:2``, layout ``batch:data;heads:model;d_ff:model;vocab:model``, all four simulated
   processors on ``cuda:0``, against the same program on the CPU (float32): the largest relative loss difference.
2. **SPMD over NCCL**: a one-rank NCCL process group running the same steps through
   :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` on ``cuda:0``, against the CPU placement mesh.
3. **fp32 / TF32 / bf16 x eager / compiled** on one processor: the GPT-2-small-shaped LM (12 layers, d_model
   768, 12 heads x 64, d_ff 3072, vocab 50304; batch 8 x 256; AdamW) -- ``--tiny``: 2 layers, d_model 64,
   batch 4 x 32 --
   meshtorch (``build_lm(precision=...)``; default executor for eager, ``mode="compile"`` for compiled)
   against the same model in plain PyTorch (:class:`meshtorch.testing.torch_lm.TorchLM`, the same initial
   weights and batches, ``torch.optim.AdamW(fused=True)``; bf16 under ``torch.autocast(bfloat16)`` with float32
   masters; compiled: ``torch.compile`` of the loss). Per precision the two sides alternate in blocks of
   ``--block`` steps (order swapped every block) after ``--warmup`` steps (compilation included there); it
   prints each side's median step time (min-max), the ratio meshtorch / PyTorch, MFU against the
   ``torch.mm`` rate of that precision measured in the same run (8192^3 on a GPU, bf16 for bf16, TF32 for tf32),
   and the largest relative loss difference. The float32 matmul precision is set by
   :meth:`meshtorch.PrecisionPolicy.set_matmul_precision` before each precision's models are built or compiled.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host import describe  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.models.transformer import build_lm, flops_per_token, preset  # noqa: E402
from meshtorch.testing.torch_lm import TorchLM, state_dict_from_lowering  # noqa: E402

LR = 1e-3


def _batches(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g) for _ in range(n)]


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _train(cfg, impl, batches, mode="codegen"):
    lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(LR))
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl}, mode=mode)
    return [lw.run([lm.loss] + lm.updates, feeds={lm.inputs: b[:, :-1], lm.targets: b[:, 1:]})[0].item()
            for b in batches], lw


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def mm_rate(device, dtype, n, reps=30) -> float:
    """Best ``torch.mm`` rate (FLOP/s) of ``dtype`` n x n x n on ``device`` (with this process's float32
    matmul precision: TF32 when 'high')."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


class MeshtorchStep:
    """One meshtorch training step of ``cfg`` under ``policy`` on one processor on ``device``."""

    name = "meshtorch"

    def __init__(self, cfg, device, policy, compiled):
        self.lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(LR), precision=policy)
        impl = mtf.PlacementMeshImpl("", "", devices=[str(device)])
        self.lw = mtf.Lowering(self.lm.graph, {self.lm.mesh: impl}, mode="compile" if compiled else "codegen")

    def __call__(self, b) -> float:
        lm = self.lm
        return self.lw.run([lm.loss] + lm.updates, feeds={lm.inputs: b[:, :-1], lm.targets: b[:, 1:]})[0].item()


class TorchStep:
    """The same step in plain PyTorch: TorchLM on meshtorch's initial weights, AdamW(fused=True), bf16 under
    ``torch.autocast`` (float32 masters), compiled through ``torch.compile`` of the loss."""

    name = "PyTorch"

    def __init__(self, cfg, device, policy, compiled, init_lowering):
        self.device = device
        model = TorchLM(cfg)
        model.load_state_dict(state_dict_from_lowering(init_lowering, model))
        self.model = model.to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        self.fn = torch.compile(self.model.loss) if compiled else self.model.loss
        self.autocast = policy.compute_dtype if policy.mixed else None

    def __call__(self, b) -> float:
        b = b.to(self.device)
        self.opt.zero_grad(set_to_none=True)
        ctx = torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else nullcontext()
        with ctx:
            loss = self.fn(b[:, :-1], b[:, 1:])
        loss.backward()
        self.opt.step()
        return loss.item()


def compare(cfg, device, precision, compiled, args, peak) -> str:
    """Alternate meshtorch and PyTorch steps in blocks; one table row."""
    policy = mtf.PrecisionPolicy.named(precision)
    policy.set_matmul_precision()  # before anything is built or compiled
    t0 = time.perf_counter()
    ours = MeshtorchStep(cfg, device, policy, compiled)
    theirs = TorchStep(cfg, device, policy, compiled, ours.lw)
    n = args.warmup + args.blocks * args.block
    batches = _batches(cfg, n, seed=1)
    sides = (ours, theirs)
    losses = {s.name: [] for s in sides}
    times = {s.name: [] for s in sides}
    for s in sides:  # warm-up, compilation included
        losses[s.name] += [s(b) for b in batches[:args.warmup]]
    warm = time.perf_counter() - t0
    for k in range(args.blocks):
        chunk = batches[args.warmup + k * args.block: args.warmup + (k + 1) * args.block]
        for s in (sides if k % 2 == 0 else sides[::-1]):
            for b in chunk:
                _sync(device)
                t = time.perf_counter()
                losses[s.name].append(s(b))  # .item() synchronises
                times[s.name].append(time.perf_counter() - t)
    med = {s: statistics.median(t) for s, t in times.items()}
    tokens = cfg.batch_size * cfg.length
    mfu = {s: tokens / m * flops_per_token(cfg) / peak for s, m in med.items()}
    span = {s: f"{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}" for s, t in times.items()}
    mode = "compiled" if compiled else "eager"
    return (f"| {precision} | {mode} | {med['meshtorch'] * 1e3:.2f} ms ({span['meshtorch']}) | "
            f"{med['PyTorch'] * 1e3:.2f} ms ({span['PyTorch']}) | {med['meshtorch'] / med['PyTorch']:.3f} | "
            f"{100 * mfu['meshtorch']:.1f}% / {100 * mfu['PyTorch']:.1f}% of {peak / 1e12:.3g} TFLOP/s | "
            f"{_rel(losses['meshtorch'], losses['PyTorch']):.1e} | {warm:.1f} s |")


def checks(device):
    """Sections 1 and 2 (CUDA only)."""
    torch.set_float32_matmul_precision("highest")
    cfg = preset("small", vocab_size=256)
    batches = _batches(cfg, 5)
    mesh, layout = "data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model"
    cpu, _ = _train(cfg, mtf.PlacementMeshImpl(mesh, layout), batches)
    gpu, lw = _train(cfg, mtf.PlacementMeshImpl(mesh, layout, devices=[str(device)] * 4), batches)
    dev = {str(t.device) for v in lw.store.values.values() for t in (v if isinstance(v, list) else [v])}
    print(f"1. placement {mesh!r} on {device} vs CPU, 5 AdamW steps: losses {[round(x, 5) for x in gpu]}; "
          f"max relative difference {_rel(gpu, cpu):.2e}; variables on {sorted(dev)}", flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device(device))
    spmd_impl = mtf.SpmdMeshImpl("", "")
    one_cpu, _ = _train(cfg, mtf.PlacementMeshImpl("", ""), batches)
    spmd, _ = _train(cfg, spmd_impl, batches)
    print(f"2. SpmdMeshImpl over {torch.distributed.get_backend()} (1 rank, device {spmd_impl.device(0)}) vs CPU "
          f"placement: max relative loss difference {_rel(spmd, one_cpu):.2e}", flush=True)
    torch.distributed.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--shape", default="gpt2", choices=["gpt2", "small", "tiny"],
                    help="gpt2: the 162M GPT-2-small shape (default); small: meshtorch's small preset (3 layers, "
                         "d_model 128, batch 16 x 128); tiny: 2 layers, d_model 64, batch 4 x 32 (seconds on a CPU)")
    ap.add_argument("--tiny", dest="shape", action="store_const", const="tiny", help="shorthand for --shape tiny")
    ap.add_argument("--precisions", default="bf16,tf32,fp32",
                    help="comma-separated: fp32, tf32, bf16, run in this order (default: the acceptance's bf16 and "
                         "TF32 rows first, so that --time-budget cuts the float32 baseline, not them)")
    ap.add_argument("--modes", default=None,
                    help="comma-separated: eager, compiled (default: both on CUDA, eager on the CPU, where "
                         "compiling takes minutes)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps per side, compilation included (default 3; --tiny 1)")
    ap.add_argument("--blocks", type=int, default=None,
                    help="timed blocks per side, the sides alternating per block (default 4; --tiny 2)")
    ap.add_argument("--block", type=int, default=None, help="steps per block (default 3; --tiny 2)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 on the CPU, as meshtorch train: two threads on two busy cores "
                         "wait on each other; torch's own choice on CUDA)")
    ap.add_argument("--skip-checks", action="store_true", help="skip sections 1 and 2")
    ap.add_argument("--time-budget", type=float, default=420.0,
                    help="seconds after which no new configuration starts (default: %(default)s)")
    args = ap.parse_args()
    for flag, full, tiny in (("warmup", 3, 1), ("blocks", 4, 2), ("block", 3, 2)):
        if getattr(args, flag) is None:
            setattr(args, flag, tiny if args.shape == "tiny" else full)
    start = time.perf_counter()
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    print(describe())
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); try --device cpu --tiny.")
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}", flush=True)
        if not args.skip_checks:
            checks(device)
    else:
        print(f"device: {device} ({torch.get_num_threads()} threads); torch {torch.__version__}", flush=True)
    if args.shape == "small":
        cfg = preset("small", vocab_size=256)
    elif args.shape == "tiny":
        cfg = preset("tiny", vocab_size=256, d_model=64, num_heads=4, d_kv=16, d_ff=256, num_layers=2, length=32,
                     batch_size=4)
    else:
        cfg = preset("base", vocab_size=50304, d_model=768, num_heads=12, d_kv=64, d_ff=3072, num_layers=12,
                     length=256, batch_size=8)
    modes = (args.modes or ("eager,compiled" if device.type == "cuda" else "eager")).split(",")
    n = 8192 if device.type == "cuda" else (256 if args.shape == "tiny" else 1024)
    print(f"3. LM {cfg.num_layers} layers, d_model {cfg.d_model}, vocab {cfg.padded_vocab}, batch {cfg.batch_size} "
          f"x {cfg.length}, AdamW; {args.warmup} warm-up steps, then {args.blocks} blocks of {args.block} steps per "
          f"side, alternating; MFU against torch.mm {n}^3 of the precision")
    print("| precision | executor | meshtorch step | PyTorch step | meshtorch / PyTorch | MFU meshtorch / PyTorch "
          "| max rel. loss diff | warm-up (both) |")
    print("|---|---|---|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        policy = mtf.PrecisionPolicy.named(precision)
        policy.set_matmul_precision()
        peak = mm_rate(device, policy.compute_dtype, n)
        for mode in modes:
            if time.perf_counter() - start > args.time_budget:
                print(f"| {precision} | {mode} | skipped: --time-budget {args.time_budget:.0f} s spent |||||| ")
                continue
            print(compare(cfg, device, precision, mode == "compiled", args, peak), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    torch.set_float32_matmul_precision("highest")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""meshtorch on one CUDA GPU: correctness against the CPU, the NCCL path, and a GPT-2-small-shaped step.

Not a test (CI has no GPU): run it on a machine with one, e.g.
``PYTHONPATH=src python benchmarks/gpu_check.py [--skip-124m]``. It prints:

1. **Placement mesh on the GPU**: the small LM (AdamW, 5 steps) on mesh ``data:2,model:2`` with layout
   ``batch:data;heads:model;d_ff:model;vocab:model``, all four simulated processors on ``cuda:0``, against
   the same program on the CPU (float32, TF32 off): the largest relative loss difference.
2. **SPMD over NCCL**: a one-rank NCCL process group (world size 1, mesh ``""``) running the same steps
   through :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` on ``cuda:0``, against the CPU placement mesh.
   One GPU cannot host two NCCL ranks, so no collective crosses a link here.
3. **GPT-2-small-shaped step** (12 layers, d_model 768, 12 heads, d_ff 3072, vocab 50304, length 256,
   batch 8, AdamW) on one processor: step time, tokens/s and MFU against the float32 ``torch.mm`` rate
   measured in the same run (TF32 off, and with TF32 on for the matmul units' float32 mode), beside the
   same model in plain PyTorch (``meshtorch.testing.torch_lm.TorchLM``, the same initial weights) with
   ``torch.optim.AdamW(fused=True)``, eager against meshtorch's default executor and compiled against
   ``--executor compile``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host import describe  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.models.transformer import build_lm, flops_per_token, preset  # noqa: E402
from meshtorch.testing.torch_lm import TorchLM  # noqa: E402


def _batches(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g) for _ in range(n)]


def _train(cfg, impl, batches, mode="codegen"):
    lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl}, mode=mode)
    losses, times = [], []
    for b in batches:
        t0 = time.perf_counter()
        out = lw.run([lm.loss] + lm.updates, feeds={lm.inputs: b[:, :-1], lm.targets: b[:, 1:]})
        losses.append(out[0].item())  # .item() synchronises the device
        times.append(time.perf_counter() - t0)
    return losses, times, lw


def _train_torch(cfg, lw, batches, compiled: bool):
    """The same LM in plain PyTorch (the TorchLM twin, meshtorch's initial weights) with
    ``torch.optim.AdamW(fused=True)``, eager or through ``torch.compile``: (losses, step times)."""
    model = TorchLM(cfg)
    model.load_state_dict({n.replace("/", "."): lw.variable_value(n) for n in lw.variable_names
                           if n != "global_step" and "/adam_" not in n and "_slot_" not in n})
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    loss_fn = torch.compile(model.loss) if compiled else model.loss
    losses, times = [], []
    for b in batches:
        b = b.cuda()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return losses, times


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def mm_rate(n=4096, reps=20) -> float:
    """Best float32 ``torch.mm`` rate (FLOP/s) on cuda:0 for n x n x n, timed with CUDA events."""
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        best = max(best, 2 * n ** 3 / (s.elapsed_time(e) / 1e3))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-124m", action="store_true")
    ap.add_argument("--steps", type=int, default=12, help="timed steps of the 124M model (after 3 warm-up)")
    args = ap.parse_args()
    print(describe())
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible (torch.cuda.is_available() is False).")
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    cfg = preset("small", vocab_size=256)
    batches = _batches(cfg, 5)
    mesh, layout = "data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model"
    cpu, _, _ = _train(cfg, mtf.PlacementMeshImpl(mesh, layout), batches)
    gpu, _, lw = _train(cfg, mtf.PlacementMeshImpl(mesh, layout, devices=["cuda:0"] * 4), batches)
    dev = {str(t.device) for v in lw.store.values.values() for t in (v if isinstance(v, list) else [v])}
    print(f"1. placement {mesh!r} on cuda:0 vs CPU, 5 AdamW steps: losses {[round(x, 5) for x in gpu]}; "
          f"max relative difference {_rel(gpu, cpu):.2e}; variables on {sorted(dev)}")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    spmd_impl = mtf.SpmdMeshImpl("", "")
    one_cpu, _, _ = _train(cfg, mtf.PlacementMeshImpl("", ""), batches)
    spmd, _, _ = _train(cfg, spmd_impl, batches)
    print(f"2. SpmdMeshImpl over {torch.distributed.get_backend()} (1 rank, device {spmd_impl.device(0)}) vs CPU "
          f"placement: max relative loss difference {_rel(spmd, one_cpu):.2e}")
    torch.distributed.destroy_process_group()

    if args.skip_124m:
        return
    big = preset("base", vocab_size=50304, d_model=768, num_heads=12, d_kv=64, d_ff=3072, num_layers=12,
                 length=256, batch_size=8)
    n_params = None
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        peak = mm_rate()
        for mode in ("codegen", "compile"):
            bb = _batches(big, args.steps + 3, seed=1)
            impl = mtf.PlacementMeshImpl("", "", devices=["cuda:0"])
            t0 = time.perf_counter()
            losses, times, lw = _train(big, impl, bb, mode=mode)
            if n_params is None:
                n_params = sum(v.shape.size for v in lw.graph.trainable_variables)
            steady = times[3:]
            med = statistics.median(steady)
            tps = big.batch_size * big.length / med
            mfu = tps * flops_per_token(big) / peak
            print(f"3. 124M-shaped LM ({n_params / 1e6:.1f}M parameters), {mode}, TF32 {'on' if tf32 else 'off'}: "
                  f"step {med * 1e3:.1f} ms (median of {len(steady)}, spread {min(steady) * 1e3:.1f}-"
                  f"{max(steady) * 1e3:.1f}), {tps:.0f} tokens/s, MFU {100 * mfu:.1f}% of the measured "
                  f"torch.mm rate {peak / 1e12:.1f} TFLOP/s; first 3 steps {sum(times[:3]):.1f} s; "
                  f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; total {time.perf_counter() - t0:.0f} s")
            init = build_lm(big, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-3))
            init_lw = mtf.Lowering(init.graph, {init.mesh: mtf.PlacementMeshImpl("", "", devices=["cuda:0"])})
            t_losses, t_times = _train_torch(big, init_lw, bb, compiled=(mode == "compile"))
            del init_lw
            t_med = statistics.median(t_times[3:])
            print(f"   plain PyTorch {'compiled' if mode == 'compile' else 'eager'} + AdamW(fused=True): step "
                  f"{t_med * 1e3:.1f} ms (spread {min(t_times[3:]) * 1e3:.1f}-{max(t_times[3:]) * 1e3:.1f}); "
                  f"meshtorch / PyTorch {med / t_med:.3f}; max relative loss difference {_rel(losses, t_losses):.1e}")
            del lw
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

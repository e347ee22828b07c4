"""FSDP (storage rules) on 4 gloo processes: a model over a per-process budget under replicated data
parallelism fails before allocating; under ``storage "d_model:data"`` it trains. Measured per-rank peak
memory next to the planner's prediction, and side by side with PyTorch FSDP2 (``fully_shard``).

Four jobs of 4 gloo processes each (``meshtorch.testing.spmd.run_spmd``: torchrun's environment, one CPU
thread per process), the same LM (:func:`meshtorch.models.transformer.build_lm`), the same batches and
AdamW:

1. meshtorch, replicated data parallel (``batch:data`` on ``data:4``) with ``--budget``:
   :func:`meshtorch.planning.check_memory_limit` raises before the lowering allocates anything; the
   message (limit, prediction, a storage rule that fits) is printed.
2. meshtorch FSDP (``batch:data``, storage ``d_model:data``) with the same budget: passes the check, trains.
3. meshtorch replicated without the budget (the baseline for memory and step-time ratios).
4. PyTorch FSDP2: :class:`meshtorch.testing.torch_lm.TorchLM` built on the meta device, wrapped with
   ``torch.distributed.fsdp.fully_shard`` as one unit (TorchLM's layers have no ``forward`` of their own,
   so per-layer units are impossible without changing the model; FSDP2 keeps the root unit's parameters
   gathered from forward to backward, like meshtorch today), then materialised with ``to_empty`` +
   ``reset_parameters``; ``torch.optim.AdamW``; each rank computes its quarter of the batch.

Memory per rank: each process first trains a tiny model of the same kind (pays torch / gloo lazy
allocations), then records its current RSS, resets the peak (``/proc/self/clear_refs``, Linux) and
builds and trains the big model; "peak growth" = peak RSS (VmHWM) - that RSS. "state" = bytes of the
parameter and optimizer-state slices the rank holds (measured from the tensors). Step time: median of
``--steps`` steps after one warm-up step. The host is shared, so times are indicative.

Run: ``python benchmarks/fsdp_memory.py [--budget 100MiB] [--steps 4] [--d-model 256] ...``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from rss import peak_rss_bytes, reset_peak  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.models.transformer import build_lm, preset  # noqa: E402
from meshtorch.planning import MemoryLimitError, check_memory_limit, memory_report  # noqa: E402
from meshtorch.runtime.plan_lm import parse_bytes  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402
from meshtorch.testing.torch_lm import TorchLM  # noqa: E402

MESH = "data:4"
LAYOUT = "batch:data"
FSDP = "d_model:data"
MIB = 2 ** 20


def config(**kw):
    return preset("tiny", **kw)


def tiny_config(cfg):
    return config(vocab_size=64, d_model=32, num_heads=2, d_kv=16, d_ff=64, num_layers=1, length=cfg.length,
                  batch_size=cfg.batch_size)


def batch(cfg, step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]




def _meshtorch_lowering(lm, storage: str, async_collectives: bool, bucket_bytes: int, reshard: bool = True):
    impl = mtf.SpmdMeshImpl(MESH, LAYOUT, storage=storage, async_collectives=async_collectives,
                            reshard_after_forward=reshard)
    return mtf.Lowering(lm.graph, {lm.mesh: impl}, bucket_bytes=bucket_bytes)


def _meshtorch_run(cfg, storage: str, budget: int | None, steps: int, async_collectives: bool = False,
                   bucket_bytes: int = 0, reshard: bool = True) -> dict:
    lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0))
    fetches = [lm.loss] + lm.updates
    try:  # the planner's check, before anything is allocated
        check_memory_limit(lm.graph, lm.mesh, fetches, MESH, LAYOUT, storage, budget)
    except MemoryLimitError as e:
        return {"error": str(e), "predicted": e.report.total_bytes}
    lw = _meshtorch_lowering(lm, storage, async_collectives, bucket_bytes, reshard)
    rep = memory_report(lw, fetches)  # the prediction for this run's schedule (buckets, prefetch)
    impl = lw.mesh_impl(lm.loss)
    state = sum(s.numel() * s.element_size() for v in lw.variables.values() for s in impl.local_slices(v))
    losses, times = [], []
    for step in range(steps + 1):
        x, y = batch(cfg, step)
        t0 = time.perf_counter()
        losses.append(float(lw.run(fetches, feeds={lm.inputs: x, lm.targets: y})[0]))
        times.append(time.perf_counter() - t0)
    return {"losses": losses, "step_s": statistics.median(times[1:]), "state": state,
            "predicted": rep.total_bytes, "predicted_state": rep.parameter_bytes + rep.optimizer_state_bytes,
            "predicted_model_state": rep.model_state_bytes, "predicted_act": rep.peak_activation_bytes}


def meshtorch_worker(cfg_kw: dict, storage: str, budget: int | None, steps: int,
                     async_collectives: bool = False, bucket_bytes: int = 0, reshard: bool = True) -> dict:
    """One gloo rank: a tiny warm-up run, then the big model (or its planner error) with peak RSS growth."""
    torch.manual_seed(0)
    cfg = config(**cfg_kw)
    _meshtorch_run(tiny_config(cfg), storage, None, 1, async_collectives, bucket_bytes, reshard)
    base = reset_peak()
    out = _meshtorch_run(cfg, storage, budget, steps, async_collectives, bucket_bytes, reshard)
    out["growth"] = peak_rss_bytes() - base
    return out


def _fsdp2_model(cfg):
    """TorchLM wrapped by ``fully_shard`` over the 4 ranks, materialised, and its AdamW; (model, optimizer)."""
    mesh = init_device_mesh("cpu", (4,))
    with torch.device("meta"):
        model = TorchLM(cfg)
    # TorchLM.forward reads each layer's parameters directly (its layer modules have no forward), so
    # per-layer FSDP units would never be gathered: one unit, the root (FSDP2 keeps the root's
    # parameters unsharded between forward and backward)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.reset_parameters()
        pad = torch.zeros(cfg.padded_vocab)
        pad[cfg.vocab_size:] = -1e9
        model.vocab_pad_mask.copy_(pad)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


def _fsdp2_step(cfg, model, opt, step: int) -> float:
    rank = torch.distributed.get_rank()
    per = cfg.batch_size // 4
    x, y = batch(cfg, step)
    opt.zero_grad(set_to_none=True)
    # through __call__ (FSDP2's hooks gather the root's weights); TorchLM.loss's cross-entropy
    logits = model(x[rank * per:(rank + 1) * per])
    loss = F.cross_entropy(logits.float().flatten(0, 1), y[rank * per:(rank + 1) * per].flatten())
    loss.backward()
    opt.step()
    return loss.item()


def _fsdp2_run(cfg, steps: int) -> dict:
    model, opt = _fsdp2_model(cfg)
    losses, times = [], []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        losses.append(_fsdp2_step(cfg, model, opt, step))
        times.append(time.perf_counter() - t0)
    state = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    state += sum(t.to_local().numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if hasattr(t, "to_local") and t.dim() > 0)
    return {"losses": losses, "step_s": statistics.median(times[1:]), "state": state}


def timing_worker(cfg_kw: dict, steps: int, blocks: int, async_collectives: bool, bucket_bytes: int,
                  fsdp2: bool, reshard: bool = True) -> dict:
    """Step times of meshtorch replicated DP, meshtorch FSDP and FSDP2 built in the same processes and run
    interleaved: ``blocks`` rounds of ``steps`` steps of each (after one warm-up step each), so load
    changes on the shared host hit all alike. {run: [seconds per step, ...]}."""
    torch.manual_seed(0)
    cfg = config(**cfg_kw)
    runs = {}
    for name, storage in (("dp", ""), ("fsdp", FSDP)):
        lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0))
        lw = _meshtorch_lowering(lm, storage, async_collectives, bucket_bytes, reshard)
        fetches = [lm.loss] + lm.updates
        runs[name] = functools.partial(_meshtorch_step, cfg, lm, lw, fetches)
    if fsdp2:
        runs["fsdp2"] = functools.partial(_fsdp2_step, cfg, *_fsdp2_model(cfg))
    times = {k: [] for k in runs}
    for fn in runs.values():
        fn(0)
    for b in range(blocks):
        for k, fn in runs.items():
            for i in range(steps):
                t0 = time.perf_counter()
                fn(1 + b * steps + i)
                times[k].append(time.perf_counter() - t0)
    return times


def _meshtorch_step(cfg, lm, lw, fetches, step: int) -> float:
    x, y = batch(cfg, step)
    return float(lw.run(fetches, feeds={lm.inputs: x, lm.targets: y})[0])


def fsdp2_worker(cfg_kw: dict, steps: int) -> dict:
    torch.manual_seed(0)
    cfg = config(**cfg_kw)
    _fsdp2_run(tiny_config(cfg), 1)
    base = reset_peak()
    out = _fsdp2_run(cfg, steps)
    out["growth"] = peak_rss_bytes() - base
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="100MiB", help="per-process memory budget (planner-checked)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip-fsdp2", action="store_true")
    ap.add_argument("--async", dest="async_collectives", action="store_true",
                    help="meshtorch runs with asynchronous collectives (prefetched all-gathers overlap compute)")
    ap.add_argument("--bucket-mb", type=float, default=0.0,
                    help="meshtorch's bucket_bytes in MiB: weight all-gathers, gradient reduce-scatters and "
                         "all-reduces merged into calls of at most this size (FSDP's flat parameter, DDP's buckets)")
    ap.add_argument("--keep-gathered", action="store_true",
                    help="meshtorch FSDP keeps each forward gather for the backward pass (reshard_after_forward="
                         "False: one all-gather per weight, as FSDP2 does for its root unit)")
    ap.add_argument("--blocks", type=int, default=5, help="interleaved timing: rounds of --steps steps per run")
    args = ap.parse_args(argv)
    bucket = int(args.bucket_mb * MIB)
    cfg_kw = dict(vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads, d_kv=args.d_model // args.heads,
                  d_ff=args.d_ff, num_layers=args.layers, length=args.length, batch_size=args.batch)
    cfg = config(**cfg_kw)
    budget = parse_bytes(args.budget)
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # freed large blocks go back to the OS: RSS tracks live memory
    n_params = sum(v.shape.size for v in build_lm(cfg).graph.trainable_variables)
    print(f"LM: {args.layers} layers, d_model {args.d_model}, d_ff {args.d_ff}, vocab {args.vocab}, "
          f"{n_params / 1e6:.2f}M parameters ({n_params * 16 / MIB:.1f} MiB of parameters + gradients + AdamW "
          f"state replicated); batch {args.batch} x length {args.length}; mesh {MESH!r} layout {LAYOUT!r}; "
          f"4 gloo processes, 1 thread each; budget {args.budget} per process")

    def job(target, *a):
        return run_spmd(f"fsdp_memory:{target}", args=a, nprocs=4, timeout_s=900, extra_path=[HERE],
                        env=env).check().results

    dp_budget = job("meshtorch_worker", cfg_kw, "", budget, args.steps)
    print("\n1. replicated data parallel within the budget:")
    print("   " + (dp_budget[0]["error"] if "error" in dp_budget[0] else "trained (the budget is not exceeded)"))
    fsdp = job("meshtorch_worker", cfg_kw, FSDP, budget, args.steps, args.async_collectives, bucket,
               not args.keep_gathered)
    if "error" in fsdp[0]:
        print(f"\n2. FSDP within the budget failed too:\n   {fsdp[0]['error']}")
        return
    dp = job("meshtorch_worker", cfg_kw, "", None, args.steps, args.async_collectives, bucket,
               not args.keep_gathered)
    rows = [("meshtorch replicated DP", dp), (f"meshtorch FSDP {FSDP!r}", fsdp)]
    if not args.skip_fsdp2:
        rows.append(("torch FSDP2 fully_shard", job("fsdp2_worker", cfg_kw, args.steps)))
    print("\n2. per rank (MiB): state = parameters + optimizer state held (measured); predicted = planner total "
          "(variables + peak activations) for this run's schedule; growth = measured peak RSS growth")
    print(f"   {'run':<30}{'rank':>5}{'state':>9}{'pred. state':>12}{'predicted':>11}{'growth':>9}"
          f"{'pred/growth':>12}{'step s':>9}  losses")
    for name, res in rows:
        for r, s in enumerate(res):
            pred = s.get("predicted")
            ps = s.get("predicted_state")
            print(f"   {name:<30}{r:>5}{s['state'] / MIB:>9.2f}{(ps / MIB if ps else float('nan')):>12.2f}"
                  f"{(pred / MIB if pred else float('nan')):>11.2f}{s['growth'] / MIB:>9.2f}"
                  f"{(pred / s['growth'] if pred else float('nan')):>12.3f}{s['step_s']:>9.3f}  "
                  + ", ".join(f"{v:.4f}" for v in s["losses"]))

    def worst(res, key):
        return max(s[key] for s in res)

    times = job("timing_worker", cfg_kw, args.steps, args.blocks, args.async_collectives, bucket, not args.skip_fsdp2,
                not args.keep_gathered)
    # a step ends for everyone at the slowest rank: per step, the maximum over ranks
    per_step = {k: [max(r[k][i] for r in times) for i in range(len(times[0][k]))] for k in times[0]}
    med = {k: statistics.median(v) for k, v in per_step.items()}
    print(f"\n3. step time, interleaved in one job ({args.blocks} rounds x {args.steps} steps of each run; "
          f"slowest rank per step): median [min, max] s")
    for k, v in per_step.items():
        print(f"   {k:<6} {med[k]:.3f} [{min(v):.3f}, {max(v):.3f}]")

    print("\n4. ratios (worst rank):")
    planned = worst(fsdp, "predicted_model_state") / worst(dp, "predicted_model_state")
    print(f"   FSDP / replicated DP: state held {worst(fsdp, 'state') / worst(dp, 'state'):.3f}, parameters + "
          f"gradients + optimizer state (planned) {planned:.3f}, "
          f"peak RSS growth {worst(fsdp, 'growth') / worst(dp, 'growth'):.3f}, step time {med['fsdp'] / med['dp']:.3f}")
    if not args.skip_fsdp2:
        t = rows[2][1]
        print(f"   meshtorch FSDP / torch FSDP2: state held {worst(fsdp, 'state') / worst(t, 'state'):.3f}, "
              f"peak RSS growth {worst(fsdp, 'growth') / worst(t, 'growth'):.3f}, step time "
              f"{med['fsdp'] / med['fsdp2']:.3f}")
    pred = [s["predicted"] / s["growth"] for s in fsdp]
    print(f"   planner / measured peak growth, FSDP ranks: {min(pred):.3f}-{max(pred):.3f}")
    same = all(abs(a - b) <= 1e-5 * abs(b) for s in fsdp for a, b in zip(s["losses"], dp[0]["losses"], strict=True))
    print(f"   meshtorch FSDP losses equal replicated DP (1e-5 rel.): {same}")


if __name__ == "__main__":
    main()

"""The LM under gloo processes: meshtorch SPMD vs DTensor tensor parallel and vs DDP (issue 13, deliverable 5).

N gloo processes on this host (torchrun's environment, via ``meshtorch.testing.spmd.run_spmd``), 1 torch
thread each, train the same decoder-only LM (``meshtorch.models.transformer.build_lm``; relu FFN, RMS norm,
no dropout, no clipping, AdamW lr 1e-3 without weight decay on both sides) on the same batches:

- ``--mode tp``: meshtorch ``SpmdMeshImpl("all:N", "heads:all;d_ff:all;vocab:all")`` vs the same LM written
  with ``nn.Linear`` / ``nn.Embedding`` and ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D
  ``DeviceMesh`` (Megatron: ColwiseParallel on q, k, v and the first FFN layer, RowwiseParallel on the
  attention output and the second FFN layer, RowwiseParallel on the embedding (vocab rows split, output
  all-reduced), ColwiseParallel on the logits with ``Shard(-1)`` output and ``loss_parallel()`` for a
  vocab-parallel cross entropy). The position embedding and the norm scales are replicated on both sides.
- ``--mode dp``: meshtorch ``SpmdMeshImpl("all:N", "batch:all")`` (optionally with gradient buckets,
  ``--bucket-mb``) vs ``DistributedDataParallel`` around the plain-PyTorch twin
  (``meshtorch.testing.torch_lm.TorchLM``); each DDP rank gets its ``batch / N`` rows.

Both peers start from meshtorch's initial weights, so their first ``--check-steps`` losses must agree to float
rounding (the max relative difference is printed). Timing alternates blocks: meshtorch ``--steps`` steps, peer
``--steps`` steps, repeated ``--blocks`` times, each block between barriers; a block's time is its mean step
time, reported as the median over blocks with the min-max spread. Timed meshtorch steps fetch only the update
operations (the peers do not reduce the loss either). Memory, per rank: the parameters + optimizer state each
side holds (local shards), and the peak RSS growth over a timed block (``/proc/self/clear_refs`` resets the
high-water mark before each block; ``MALLOC_MMAP_THRESHOLD_`` makes freed large blocks go back to the OS).

    python benchmarks/vs_dtensor.py --procs 2 --mode both --steps 5 --blocks 5
    python benchmarks/vs_dtensor.py --procs 4 --mode dp --bucket-mb 25
    python benchmarks/vs_dtensor.py --procs 2 --mode both --bucket-mb 25 --executor compile
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
MIB = 2.0**20
TP_LAYOUT = "heads:all;d_ff:all;vocab:all"
DP_LAYOUT = "batch:all"


def _batches(cfg, n: int):
    """``n`` fixed (inputs, targets) int64 ``[batch, length]`` pairs, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def worker(mode: str, cfg_kw: dict, steps: int, blocks: int, threads: int, bucket_bytes: int,
           check_steps: int, async_collectives: bool = False, executor: str = "codegen",
           peer_compile: bool = False) -> dict:
    """One gloo rank: build both sides, compare the first losses, then time interleaved blocks."""
    sys.path.insert(0, HERE)
    import rss as R
    import torch.distributed as dist
    import vs_dtensor_peers as P

    import meshtorch as mtf
    from meshtorch.models.transformer import LMConfig, build_lm

    torch.set_num_threads(threads)
    cfg = LMConfig(**cfg_kw)
    rank, world = dist.get_rank(), dist.get_world_size()
    lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0))
    layout = TP_LAYOUT if mode == "tp" else DP_LAYOUT
    impl = mtf.SpmdMeshImpl(f"all:{world}", layout, async_collectives=async_collectives)
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl}, bucket_bytes=bucket_bytes, mode=executor)
    weights = {n: lw.variable_value(n) for n in lw.variable_names
               if n != "global_step" and "/adam_" not in n and "_slot_" not in n}
    if mode == "tp":
        peer, peer_step = P.dtensor_tp(cfg, weights, world, compiled=peer_compile)
    else:
        peer, peer_step = P.ddp(cfg, weights, rank, world, compiled=peer_compile)
    data = _batches(cfg, 4)

    def mtf_steps(n, record=None):
        for s in range(n):
            x, y = data[s % len(data)]
            if record is None:
                lw.run(lm.updates, feeds={lm.inputs: x, lm.targets: y})
            else:
                record.append(float(lw.run([lm.loss] + lm.updates, feeds={lm.inputs: x, lm.targets: y})[0]))

    def peer_steps(n, record=None):
        for s in range(n):
            loss = peer_step(*data[s % len(data)])
            if record is not None:
                record.append(loss())

    mtf_losses, peer_losses = [], []
    mtf_steps(check_steps, mtf_losses)
    t0 = time.perf_counter()
    mtf_steps(1)  # the timed plan (update operations only): compiled here with --executor compile
    first_step = time.perf_counter() - t0
    peer_steps(check_steps, peer_losses)
    impl = lw.mesh_impl(lm.loss)
    state = {"meshtorch": sum(s.numel() * s.element_size() for v in lw.variables.values()
                              for s in impl.local_slices(v)),
             "peer": P.state_bytes(peer)}
    times = {"meshtorch": [], "peer": []}
    growth = {"meshtorch": [], "peer": []}
    for _ in range(blocks):
        for name, fn in (("meshtorch", mtf_steps), ("peer", peer_steps)):
            dist.barrier()
            base = R.reset_peak()
            t0 = time.perf_counter()
            fn(steps)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / steps)
            growth[name].append(R.peak_rss_bytes() - base)
    return dict(rank=rank, times=times, growth=growth, state=state, mtf_losses=mtf_losses, peer_losses=peer_losses,
                first_step=first_step, compile_seconds=sorted(v for v in lw.session.compile_seconds.values() if v))


def _spread(v):
    return f"{1e3 * statistics.median(v):7.1f} ms ({1e3 * min(v):.1f}-{1e3 * max(v):.1f})"


def report(mode: str, procs: int, res: list, bucket_mb: float, executor: str = "codegen",
           peer_compile: bool = False) -> None:
    peer = ("DTensor TP" if mode == "tp" else "DDP") + (" compiled" if peer_compile else "")
    layout = TP_LAYOUT if mode == "tp" else DP_LAYOUT
    r0 = res[0]
    m, p = r0["times"]["meshtorch"], r0["times"]["peer"]
    print(f"\n== {mode}: meshtorch SpmdMeshImpl('all:{procs}', {layout!r})"
          f"{f', buckets {bucket_mb:g} MiB' if mode == 'dp' else ''} vs {peer}, {procs} gloo processes")
    if executor == "compile":
        print(f"   meshtorch executor compile: first timed-plan step {r0['first_step']:.1f} s; compile seconds per "
              f"plan {', '.join(f'{v:.1f}' for v in r0['compile_seconds'])} (rank 0)")
    print(f"   step time per block, rank 0: meshtorch  {', '.join(f'{1e3 * v:.0f}' for v in m)} ms")
    print(f"                                {peer:<10} {', '.join(f'{1e3 * v:.0f}' for v in p)} ms")
    print(f"   median (min-max): meshtorch {_spread(m)}, {peer} {_spread(p)}")
    ratio = statistics.median(m) / statistics.median(p)
    paired = statistics.median(a / b for a, b in zip(m, p, strict=True))
    goal = "<= 0.8" if mode == "tp" else "<= 1.0"
    print(f"   ratio meshtorch / {peer}: {ratio:.3f} (medians), {paired:.3f} (median of per-block ratios), range "
          f"{min(m) / max(p):.2f}-{max(m) / min(p):.2f}; issue 13 goal {goal}")
    for r in res:
        sm, sp = r["state"]["meshtorch"], r["state"]["peer"]
        gm, gp = max(r["growth"]["meshtorch"]), max(r["growth"]["peer"])
        print(f"   rank {r['rank']}: params + AdamW state held: meshtorch {sm / MIB:.2f} MiB, {peer} {sp / MIB:.2f} "
              f"MiB; peak RSS growth over a block (max over blocks): meshtorch {gm / MIB:.1f} MiB, {peer} "
              f"{gp / MIB:.1f} MiB" + (f" (ratio {gm / gp:.2f})" if gp > MIB else ""))
    ml, pl = r0["mtf_losses"], r0["peer_losses"]
    err = max(abs(a - b) / abs(b) for a, b in zip(ml, pl, strict=True))
    print(f"   first {len(ml)} losses meshtorch  {', '.join(f'{v:.5f}' for v in ml)}")
    print(f"   first {len(pl)} losses {peer:<10} {', '.join(f'{v:.5f}' for v in pl)}  (max rel. diff {err:.2e})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2, help="gloo processes (the mesh 'all:N')")
    ap.add_argument("--mode", choices=("tp", "dp", "both"), default="both")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=5, help="interleaved blocks per side")
    ap.add_argument("--check-steps", type=int, default=3, help="untimed steps whose losses are compared")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--bucket-mb", type=float, default=0.0,
                    help="dp: meshtorch gradient buckets of this many MiB (0: one all-reduce per gradient)")
    ap.add_argument("--async", dest="async_collectives", action="store_true",
                    help="meshtorch's collectives asynchronous (waited at first use; overlap with compute)")
    ap.add_argument("--executor", choices=("codegen", "interpret", "compile"), default="codegen",
                    help="meshtorch's executor (compile: the step through torch.compile, collectives as functional "
                         "collectives inside the graph; the peers run eagerly unless --peer-compile)")
    ap.add_argument("--peer-compile", action="store_true",
                    help="the peer's module through torch.compile too (forward + backward; its AdamW stays eager)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-kv", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    args = ap.parse_args(argv)
    from meshtorch.testing.spmd import run_spmd

    cfg_kw = dict(vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads, d_kv=args.d_kv, d_ff=args.d_ff,
                  num_layers=args.layers, length=args.length, batch_size=args.batch)
    print(f"LM: {args.layers} layers, d_model {args.d_model}, d_ff {args.d_ff}, {args.heads} heads x d_kv {args.d_kv}, "
          f"vocab {args.vocab}, batch {args.batch} x length {args.length}; AdamW lr 1e-3, no clipping; "
          f"{args.procs} gloo processes x {args.threads} thread(s); {args.blocks} blocks x {args.steps} steps per side "
          f"(torch {torch.__version__})")
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(args.threads)}
    for mode in (("tp", "dp") if args.mode == "both" else (args.mode,)):
        res = run_spmd("vs_dtensor:worker", args=(mode, cfg_kw, args.steps, args.blocks, args.threads,
                                                  int(args.bucket_mb * MIB) if mode == "dp" else 0, args.check_steps,
                                                  args.async_collectives, args.executor, args.peer_compile),
                       nprocs=args.procs, timeout_s=1800, dist_timeout_s=600, extra_path=[HERE], env=env).check()
        report(mode, args.procs, res.results, args.bucket_mb, args.executor, args.peer_compile)


if __name__ == "__main__":
    main()

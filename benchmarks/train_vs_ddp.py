"""``meshtorch train`` with default flags under torchrun (2 ranks) vs DistributedDataParallel on the same model.

Side A, ``mtf``: ``torchrun --standalone --nproc-per-node 2 -m meshtorch train`` with the default model, mesh,
layout and optimizer flags (under torchrun without --mesh/--layout: mesh ``data:2``, layout ``batch:data``;
the ``small`` preset: 3 layers, d_model 128, 4 heads x 32, d_ff 512, ReLU, RMS norm, no dropout, learned
positions, untied logits, byte vocabulary 256, batch 16 x length 128 over both ranks; AdamW lr 6e-3 with the
cosine schedule and 50 warm-up steps, weight decay 0, global-norm clipping 1.0; DDP's default gradient buckets
(25 MiB, the first closed at 1 MiB);
``--threads 1``; the generated-code executor, eager). Only ``--steps`` changes (the schedule's length) and
what runs outside the steps is turned off (``--sample 0 --plot '' --checkpoint-dir ''``, one evaluation batch
at the end). Step times are the train loop's own (``--log-dir``: ``metrics.jsonl``'s ``tokens_per_s`` of
rank 0 is ``batch x length / seconds of lowering.run``: feeds, forward, backward, all-reduces, clipping,
update, the loss fetch).

Side B, ``ddp_fused`` / ``ddp_foreach``: the same computation in plain PyTorch
(:class:`meshtorch.testing.torch_lm.TorchLM`, meshtorch's twin with the same parameter names and shapes,
with ``F.cross_entropy`` as the loss and no padding mask), starting from meshtorch's initial weights (the same
seed drawn on a one-process lowering: the values are layout-independent),
``DistributedDataParallel(broadcast_buffers=False)`` (no buffer to broadcast per step; its default buckets:
``bucket_cap_mb`` None, 25 MiB with a 1 MiB first bucket; before 2026-11-27 ``bucket_cap_mb=25``, which has no
small first bucket),
``torch.optim.AdamW(fused=True)`` or ``(foreach=True)`` with the same learning rate per step
(:func:`meshtorch.runtime.train.host_lr`), ``clip_grad_norm_(1.0, foreach=True)``, the same batches
(the built-in corpus, byte tokenizer, ``PackedDataset.stream`` with seed 0), each rank its half of the rows,
one torch thread. Timed per step: zero_grad, forward, backward, clipping, ``opt.step()`` and ``loss.item()``.

Every job is a torchrun job of its own (startup excluded), run in the order A B C, C B A, ... (``--rounds``); the
first ``--warmup`` steps of every job are dropped. Printed: the host, each job's median step time, per side the
median over all kept steps with the spread of the per-round medians (min-max), the ratio meshtorch / the faster
DDP, per round too, and the check that both sides compute the same thing: meshtorch's logged (global-batch)
loss at every step vs the mean of the two DDP ranks' losses (step 0: same weights, same batch), and the
parameter counts.

``--paired --phases`` also prints, per side, when each part of rank 0's step ended (medians, ms since the step
began): meshtorch's collective calls (issued, done: the flight recorder's times) and its end; DDP's forward,
backward (its bucket waits included), clipping, ``opt.step()``, ``loss.item()`` and its buckets' all-reduces
(issued, done: a comm hook around DDP's default all-reduce, which costs DDP a little).

Run: ``python benchmarks/train_vs_ddp.py [--steps 40] [--warmup 5] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

SIDES = ("mtf", "ddp_fused", "ddp_foreach")
EXTRA = {"mtf": [], "mtf_async": ["--async-collectives"]}  # mtf_async (not a default side): DDP-style overlap
NPROC = 2


def _torchrun(args: list[str], cwd: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src")}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def run_mtf(steps: int, workdir: str, extra=()) -> dict:
    """One ``meshtorch train`` job with default flags (and ``extra``): rank 0's step seconds and (global) losses."""
    logdir = os.path.join(workdir, "log")
    _torchrun(["-m", "meshtorch", "train", "--steps", str(steps), "--eval-every", str(steps), "--eval-batches", "1",
               "--sample", "0", "--plot", "", "--checkpoint-dir", "", "--runs-dir", os.path.join(workdir, "runs"),
               "--log-dir", logdir, *extra], workdir)
    rows = [json.loads(line) for line in open(os.path.join(logdir, "metrics.jsonl"))]
    rows = [r for r in rows if "tokens_per_s" in r]
    from meshtorch.models.transformer import preset
    from meshtorch.runtime.train_config import DEFAULT_PRESET

    model = preset(DEFAULT_PRESET)
    tokens = model.batch_size * model.length  # tokens_per_s counts the global batch
    return {"times": [tokens / r["tokens_per_s"] for r in rows], "losses": [r["loss"] for r in rows]}


def run_ddp(steps: int, optim: str, workdir: str) -> dict:
    """One DDP job: rank 0's step seconds, the mean of both ranks' losses per step, the parameter count."""
    out = os.path.join(workdir, "ddp")
    os.makedirs(out, exist_ok=True)
    _torchrun([os.path.abspath(__file__), "--ddp-worker", "--optim", optim, "--steps", str(steps), "--out", out],
              workdir)
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(NPROC)]
    losses = [sum(r["losses"][s] for r in ranks) / NPROC for s in range(steps)]
    return {"times": ranks[0]["times"], "losses": losses, "params": ranks[0]["params"]}


def _ddp_side(cfg, optim: str, single_world: int = 0, phases: list | None = None):
    """The DDP side for ``cfg`` (a TrainConfig: meshtorch train's defaults): ``(step(batch, step) -> local loss,
    parameter count)``; the process group must exist (DDP broadcasts rank 0's weights at construction).
    ``single_world`` > 0: no process group and no DDP, rank 0's rows of a job of that many ranks (compute only).
    ``phases`` (a list): each step appends ``{phase: seconds since the step began}`` (:data:`DDP_PHASES`, and each
    bucket's all-reduce issue and completion, timed by a comm hook around DDP's default all-reduce)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import meshtorch as mtf
    from meshtorch.models.transformer import build_lm, preset
    from meshtorch.runtime.train import host_lr
    from meshtorch.testing.torch_lm import TorchLM, state_dict_from_lowering

    c = preset(cfg.preset, vocab_size=256)  # the byte tokenizer; batch:data splits no vocab: vocab_multiple 1
    assert c.dropout == 0 and not c.gated and cfg.optimizer == "adamw" and c.padded_vocab == c.vocab_size
    # meshtorch's initial weights (drawn on one simulated processor: the same values as on any layout)
    lm = build_lm(c, seed=cfg.seed)
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("", "")})
    model = TorchLM(c)
    model.load_state_dict(state_dict_from_lowering(lw, model), strict=True)

    class LossModule(torch.nn.Module):
        """TorchLM's blocks and head with ``F.cross_entropy``, without the padding mask (the vocabulary is not
        padded: nothing to mask)."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, targets):
            m = self.m
            x = m.embedding[ids] + m.pos_embedding[: ids.shape[1]]
            for i in range(c.num_layers):
                x = m.block(i, x)[0]
            logits = m._norm(x, m.final_norm) @ m.logits.kernel
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    if single_world:
        rank, world, ddp = 0, single_world, LossModule(model)
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        # no buffers to keep in sync (TorchLM's padding mask is constant and unused here): no per-step broadcast
        ddp = DDP(LossModule(model), broadcast_buffers=False)  # default buckets: 25 MiB, the first 1 MiB
    params = list(ddp.parameters())
    buckets: list = []  # --phases: (issue, done) perf_counter of each bucket's all-reduce this step
    if phases is not None and not single_world:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def timed_hook(state, bucket):
            issued = time.perf_counter()

            def done(fut):
                buckets.append((issued, time.perf_counter()))
                return fut.value()
            return allreduce_hook(state, bucket).then(done)
        ddp.register_comm_hook(None, timed_hook)
    kw = {"fused": True} if optim == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kw)  # betas, eps: torch's = ours
    per = c.batch_size // world

    def step(batch, s: int) -> float:
        t = [time.perf_counter()]
        buckets.clear()
        rows = batch[rank * per:(rank + 1) * per]
        for g in opt.param_groups:
            g["lr"] = host_lr(cfg, s)
        opt.zero_grad(set_to_none=True)
        loss = ddp(rows[:, :-1], rows[:, 1:])
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        if cfg.clip_norm:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm, foreach=True)
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        value = loss.item()
        if phases is not None:
            t.append(time.perf_counter())
            row = dict(zip(DDP_PHASES, (x - t[0] for x in t[1:]), strict=True))
            for i, (a, b) in enumerate(buckets):
                row[f"bucket {i} issued"], row[f"bucket {i} done"] = a - t[0], b - t[0]
            phases.append(row)
        return value
    return step, sum(p.numel() for p in params)


#: --phases, the DDP side: the end of each part of its step (seconds since the step began)
DDP_PHASES = ("forward", "backward (its bucket waits included)", "clip_grad_norm_", "opt.step()", "loss.item()")


def _mtf_phases(records, t0: float, t1: float) -> dict:
    """--phases, the meshtorch side: each collective call of a step (flight-recorder ``records`` issued after
    ``t0``) issued and done (an asynchronous call: its wait at the first use of its result), and the step's end
    ``t1``, in seconds since ``t0``."""
    row = {}
    for i, r in enumerate(r for r in records if r.start >= t0):
        row[f"bucket {i} issued"], row[f"bucket {i} done"] = r.start - t0, r.start + (r.seconds or 0.0) - t0
    row["end (run, loss.item())"] = t1 - t0
    return row


def _batches(cfg):
    """meshtorch train's batch stream: the built-in corpus, bytes, ``PackedDataset.stream`` (seed, epoch 0)."""
    from meshtorch.data.text import ByteTokenizer, PackedDataset, load_documents
    from meshtorch.models.transformer import preset

    c = preset(cfg.preset)
    data = PackedDataset.from_documents(load_documents(None), ByteTokenizer(), c.length + 1)
    return (b for _, _, b in data.stream(c.batch_size, cfg.seed, 0, 0))


def ddp_worker(steps: int, optim: str, out: str) -> None:
    """A torchrun rank of the DDP side (see the module docstring)."""
    import torch.distributed as dist

    from meshtorch.runtime.train_config import DEFAULT_PRESET, TrainConfig

    torch.set_num_threads(1)
    # meshtorch train's defaults: model, optimizer, schedule, clipping, seed
    cfg = TrainConfig(steps=steps, preset=DEFAULT_PRESET)
    dist.init_process_group("gloo")
    step, n_params = _ddp_side(cfg, optim)
    batches = _batches(cfg)
    times, losses = [], []
    for s in range(steps):
        batch = next(batches)
        t0 = time.perf_counter()
        losses.append(step(batch, s))
        times.append(time.perf_counter() - t0)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"times": times, "losses": losses, "params": n_params}, f)
    dist.destroy_process_group()


def paired_worker(steps: int, block: int, optim: str, out: str, async_collectives: bool | None = None,
                  bucket_mb: float | None = None, phases: bool = False) -> None:
    """One torchrun job holding both sides: meshtorch built as ``meshtorch train`` builds it from its default
    config (:meth:`TrainConfig.checked` under torchrun: ``data:2`` / ``batch:data``; ``build_lm`` with
    ``make_optimizer`` and ``--clip-norm``; the lowering with ``--executor`` and ``--bucket-mb``; the loop's
    fetches and ``batch_feeds``) and the DDP side; blocks of ``block`` steps alternate A B B A ... so that
    both see the same load. Rank 0 writes each side's step seconds."""
    import torch.distributed as dist

    from meshtorch.lowering import Lowering
    from meshtorch.mesh.factory import make_mesh_impl
    from meshtorch.mesh.recorder import flight_recorder
    from meshtorch.models.transformer import build_lm, preset
    from meshtorch.runtime.train import batch_feeds, grad_sum_of_squares, make_optimizer, vocab_multiple
    from meshtorch.runtime.train_config import TrainConfig

    cfg, _ = TrainConfig(steps=steps, runs_dir=out, checkpoint_dir="", plot="", sample=0,
                         async_collectives=async_collectives).checked()
    if bucket_mb is not None:
        cfg = cfg.replace(bucket_mb=bucket_mb)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo")
    c = preset(cfg.preset, vocab_size=256, vocab_multiple=vocab_multiple(cfg.mesh, cfg.layout))
    lm = build_lm(c, seed=cfg.seed, optimizer=make_optimizer(cfg), clip_norm=cfg.clip_norm or None)
    impl = make_mesh_impl(cfg.mesh, cfg.layout, device=cfg.device, async_collectives=cfg.async_collectives)
    lw = Lowering(lm.graph, {lm.mesh: impl}, mode=cfg.executor, bucket_bytes=cfg.bucket_bytes)
    fetches = [lm.loss, grad_sum_of_squares(lm.graph), *lm.updates]
    rows: dict = {"mtf": [], "ddp_" + optim: []}  # --phases

    def mtf_step(batch, s):
        t0 = time.perf_counter()
        loss = lw.run(fetches, feeds=batch_feeds(lw, lm, batch), feed_slices=True)[0].item()
        if phases:
            rows["mtf"].append(_mtf_phases(flight_recorder().records(8), t0, time.perf_counter()))
        return loss

    ddp_step, _ = _ddp_side(cfg, optim, phases=rows["ddp_" + optim] if phases else None)
    sides = {"mtf": [mtf_step, _batches(cfg), [], []], "ddp_" + optim: [ddp_step, _batches(cfg), [], []]}
    order = list(sides)
    for b in range(steps // block):
        for name in (order if b % 2 == 0 else order[::-1]):
            fn, batches, times, losses = sides[name]
            for _ in range(block):
                batch, s = next(batches), len(times)
                t0 = time.perf_counter()
                losses.append(fn(batch, s))
                times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "paired.json"), "w") as f:
            json.dump({k: {"times": v[2], "losses": v[3], "phases": rows[k]} for k, v in sides.items()}, f)
    dist.destroy_process_group()


def _mtf_params() -> int:
    from meshtorch.models.transformer import build_lm, preset

    c = preset("small", vocab_size=256)
    return sum(v.shape.size for v in build_lm(c).graph.trainable_variables)


def single(args) -> None:
    """``--single``: compute only, in this process (1 thread): meshtorch's default train graph on one processor
    with one rank's half of the batch vs the plain-PyTorch module (no DDP) with ``--optim``'s AdamW on the same
    rows; blocks of ``--block`` steps alternating A B B A; the ratio of medians. ``--both-cores``: the same in
    each rank of a 2-rank torchrun job, every step started together (a barrier; not timed), so both cores compute
    as in the torchrun comparison but nothing is communicated; rank 0's times."""
    if args.both_cores and not args.single_worker:
        with tempfile.TemporaryDirectory() as tmp:
            _torchrun([os.path.abspath(__file__), "--single", "--single-worker", "--both-cores", "--optim", args.optim,
                       "--steps", str(args.steps), "--block", str(args.block), "--warmup", str(args.warmup),
                       "--out", tmp], tmp)
            print(open(os.path.join(tmp, "single.txt")).read(), end="")
        return
    from meshtorch.lowering import Lowering
    from meshtorch.mesh.factory import placement_mesh_impl
    from meshtorch.models.transformer import build_lm, preset
    from meshtorch.runtime.train import grad_sum_of_squares, make_optimizer
    from meshtorch.runtime.train_config import DEFAULT_PRESET, TrainConfig

    cfg = TrainConfig(steps=args.steps, preset=DEFAULT_PRESET)  # the preset is resolved by checked() in train
    torch.set_num_threads(cfg.threads)
    c = preset(cfg.preset, vocab_size=256)
    half = preset(cfg.preset, vocab_size=256, batch_size=c.batch_size // NPROC)
    lm = build_lm(half, seed=cfg.seed, optimizer=make_optimizer(cfg), clip_norm=cfg.clip_norm or None)
    lw = Lowering(lm.graph, {lm.mesh: placement_mesh_impl("", "")}, mode=cfg.executor, bucket_bytes=cfg.bucket_bytes)
    fetches = [lm.loss, grad_sum_of_squares(lm.graph), *lm.updates]

    def mtf_step(batch, s):
        rows = batch[: half.batch_size]
        return lw.run(fetches, feeds={lm.inputs: rows[:, :-1], lm.targets: rows[:, 1:]})[0].item()

    torch_step, _ = _ddp_side(cfg, args.optim, single_world=NPROC)
    sides = {"mtf": [mtf_step, _batches(cfg), []], "torch_" + args.optim: [torch_step, _batches(cfg), []]}
    if args.both_cores:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    for b in range(args.steps // args.block):
        for name in (list(sides) if b % 2 == 0 else list(sides)[::-1]):
            fn, batches, times = sides[name]
            for _ in range(args.block):
                batch, s = next(batches), len(times)
                if args.both_cores:
                    dist.barrier()
                t0 = time.perf_counter()
                fn(batch, s)
                times.append(time.perf_counter() - t0)
    med = {k: statistics.median(v[2][args.warmup:]) for k, v in sides.items()}
    a, b = (v[2] for v in sides.values())
    pairs = [statistics.median(a[i:i + args.block]) / statistics.median(b[i:i + args.block])
             for i in range(-(-args.warmup // args.block) * args.block, len(a), args.block)]
    line = (("2 ranks computing at once, no communication" if args.both_cores else "one process") + ", 1 thread, "
            "one rank's rows (" + str(half.batch_size) + " x " + str(half.length) + "): "
            + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in med.items())
            + f"; meshtorch / torch {med['mtf'] / med['torch_' + args.optim]:.3f} (block pairs: median "
              f"{statistics.median(pairs):.3f}, {len(pairs)} pairs)")
    if not args.both_cores:
        print(line)
        return
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "single.txt"), "w") as f:
            f.write(line + "\n")
    dist.destroy_process_group()


def paired(args) -> None:
    """``--paired``: ``--rounds`` torchrun jobs of :func:`paired_worker`; per-side medians of the kept steps
    (the first ``--warmup`` of each side dropped), the ratio overall and per job."""
    print(f"{NPROC} gloo ranks, 1 thread each; one job per round holding meshtorch (train's default config"
          f"{', --async-collectives' if args.mtf_async else ''}"
          f"{'' if args.mtf_bucket_mb is None else f', --bucket-mb {args.mtf_bucket_mb:g}'}) and "
          f"DDP (AdamW {args.optim}); blocks of {args.block} steps alternating, {args.steps} steps per side, first "
          f"{args.warmup} dropped; all eager", flush=True)
    per_job, block_ratios = [], []  # block_ratios: meshtorch / DDP of two adjacent blocks (the same load)
    phase_rows: dict = {}  # --phases: per side, per job, the kept steps' phase rows
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            d = os.path.join(tmp, f"paired-{rnd}")
            os.makedirs(d)
            _torchrun([os.path.abspath(__file__), "--paired-worker", "--optim", args.optim, "--steps",
                       str(args.steps), "--block", str(args.block), "--out", d]
                      + (["--mtf-async"] if args.mtf_async else [])
                      + ([] if args.mtf_bucket_mb is None else ["--mtf-bucket-mb", str(args.mtf_bucket_mb)])
                      + (["--phases"] if args.phases else []), d)
            res = json.load(open(os.path.join(d, "paired.json")))
            kept = {k: v["times"][args.warmup:] for k, v in res.items()}
            per_job.append(kept)
            for k, v in res.items():
                if args.phases:
                    phase_rows.setdefault(k, []).append(v["phases"][args.warmup:])
            a, b = (res[k]["times"] for k in ("mtf", "ddp_" + args.optim))
            first = -(-args.warmup // args.block) * args.block  # whole blocks after the warm-up
            block_ratios.extend(statistics.median(a[i:i + args.block]) / statistics.median(b[i:i + args.block])
                                for i in range(first, len(a), args.block))
            print("  job " + str(rnd) + ": " + ", ".join(f"{k} median {1e3 * statistics.median(t):.2f} ms"
                                                          for k, t in kept.items())
                  + f"; ratio {statistics.median(kept['mtf']) / statistics.median(kept['ddp_' + args.optim]):.3f}",
                  flush=True)
    med = {k: statistics.median([t for job in per_job for t in job[k]]) for k in per_job[0]}
    ratios = [statistics.median(j["mtf"]) / statistics.median(j["ddp_" + args.optim]) for j in per_job]
    print("\nmedians: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in med.items())
          + f"; meshtorch / DDP {med['mtf'] / med['ddp_' + args.optim]:.3f} (per job {min(ratios):.3f}-"
            f"{max(ratios):.3f})")
    q = statistics.quantiles(block_ratios, n=4)
    print(f"per adjacent block pair: median ratio {statistics.median(block_ratios):.3f} (quartiles {q[0]:.3f}-"
          f"{q[2]:.3f}, {len(block_ratios)} pairs)")
    for side, rows in (phase_rows or {}).items():
        kept = [r for job in rows for r in job]
        keys = [k for k in kept[0] if all(k in r for r in kept)]
        print(f"phases, {side} (rank 0, ms since the step began, medians over {len(kept)} steps): "
              + "; ".join(f"{k} {1e3 * statistics.median(r[k] for r in kept):.2f}" for k in keys))


def main(argv=None) -> None:
    import host

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="steps per job (the schedule's length too)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps of each job not timed")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the job sequence (reversed every other round)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"of {', '.join([*SIDES, 'mtf_async'])}")
    ap.add_argument("--paired", action="store_true",
                    help="instead: each round one torchrun job holding both sides (meshtorch built as train builds it, "
                         "and DDP with the faster --optim), blocks of --block steps alternating A B B A")
    ap.add_argument("--single", action="store_true",
                    help="instead: compute only, one process (meshtorch on one processor vs the plain module)")
    ap.add_argument("--block", type=int, default=5, help="--paired, --single: steps per block")
    ap.add_argument("--mtf-async", action="store_true", help="--paired: meshtorch with --async-collectives")
    ap.add_argument("--mtf-bucket-mb", type=float, default=None, help="--paired: meshtorch's --bucket-mb")
    ap.add_argument("--phases", action="store_true",
                    help="--paired: also time each side's step by phase (meshtorch: its collectives from the flight "
                         "recorder; DDP: forward, backward, clipping, step, and its buckets through a comm hook, "
                         "which costs DDP a little)")
    ap.add_argument("--both-cores", action="store_true",
                    help="--single: in each of 2 torchrun ranks at once (both cores busy, nothing communicated)")
    ap.add_argument("--single-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--paired-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--optim", default="foreach", choices=["fused", "foreach"],
                    help="--paired, --single: PyTorch's AdamW implementation")
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ddp_worker:
        return ddp_worker(args.steps, args.optim, args.out)
    if args.single_worker:
        return single(args)
    if args.paired_worker:
        return paired_worker(args.steps, args.block, args.optim, args.out, args.mtf_async or None, args.mtf_bucket_mb,
                             args.phases)
    print(host.describe())
    if args.paired:
        return paired(args)
    if args.single:
        return single(args)
    sides = args.sides.split(",")
    print(f"{NPROC} gloo ranks on this host, 1 thread each; small preset, batch 16 x 128 over both ranks; "
          f"{args.steps} steps per job, first {args.warmup} dropped; all eager", flush=True)
    res: dict = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for side in (sides if rnd % 2 == 0 else sides[::-1]):  # A B C, C B A: a load trend hits all alike
                d = os.path.join(tmp, f"{side}-{rnd}")
                os.makedirs(d)
                r = run_mtf(args.steps, d, EXTRA[side]) if side in EXTRA else run_ddp(args.steps, side[4:], d)
                r["kept"] = r["times"][args.warmup:]
                res[side].append(r)
                print(f"  round {rnd} {side:<12} step ms median {1e3 * statistics.median(r['kept']):7.2f} "
                      f"(min {1e3 * min(r['kept']):.2f}, max {1e3 * max(r['kept']):.2f})", flush=True)
    med = {}
    print(f"\n{'side':<13}{'step ms median':>16}{'per-round medians (spread)':>32}")
    for side, runs in res.items():
        allk = [t for r in runs for t in r["kept"]]
        per_round = [statistics.median(r["kept"]) for r in runs]
        med[side] = statistics.median(allk)
        print(f"{side:<13}{1e3 * med[side]:>16.2f}{f'{1e3 * min(per_round):.2f}-{1e3 * max(per_round):.2f}':>32}")
    ddps = [s for s in sides if s.startswith("ddp")]
    if "mtf" in med and ddps:
        best = min(ddps, key=med.get)
        rounds = [statistics.median(a["kept"]) / statistics.median(b["kept"])
                  for a, b in zip(res["mtf"], res[best], strict=True)]
        print(f"\nmeshtorch / DDP ({best}, the faster AdamW): {med['mtf'] / med[best]:.3f} (per round: "
              f"{', '.join(f'{x:.3f}' for x in rounds)})")
        ref = res["mtf"][0]["losses"]
        for side in ddps:
            other = res[side][0]["losses"]
            rel = [abs(a - b) / abs(a) for a, b in zip(ref, other, strict=True)]
            print(f"same computation, {side}: step 0 loss meshtorch {ref[0]:.6f} vs DDP {other[0]:.6f} (rel "
                  f"{rel[0]:.1e}); max rel over {len(rel)} steps {max(rel):.1e}; last {ref[-1]:.4f} vs "
                  f"{other[-1]:.4f}")
        print(f"parameters: meshtorch {_mtf_params()}, DDP {res[ddps[0]][0]['params']}")


if __name__ == "__main__":
    main()

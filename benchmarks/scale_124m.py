"""A GPT-2-small-shaped LM on 4 gloo processes: meshtorch DP vs DDP, FSDP vs FSDP2, FSDP + TP on 2x2 vs FSDP2 + TP.

Model: :func:`meshtorch.models.transformer.build_lm` with 12 layers, d_model 768, 12 heads x 64, d_ff 3072,
vocab 50257, context 256 (untied embeddings: 163M parameters), AdamW (meshtorch's fused kernel). Each run
is a job of 4 gloo processes (``meshtorch.testing.spmd.run_spmd``: torchrun's environment, one CPU thread
each, ``MALLOC_MMAP_THRESHOLD_=131072`` so freed blocks leave the RSS), ``--micro-batch`` sequences per rank:

* ``dp``: meshtorch ``SpmdMeshImpl("data:4", "batch:data")`` (gradient buckets of 25 MiB, given: no 1 MiB first
  bucket, as the peer);
* ``ddp``: the same architecture in plain PyTorch (:class:`BlockLM`), ``DistributedDataParallel``
  (25 MiB buckets), ``torch.optim.AdamW(fused=True)`` (``--peer-optim foreach`` for the foreach one);
* ``fsdp``: meshtorch with storage ``d_model:data`` (FSDP / ZeRO-3: weights all-gathered per use,
  gradients reduce-scattered);
* ``fsdp2``: :class:`BlockLM` with ``torch.distributed.fsdp.fully_shard`` on every block and on the root;
  ``fsdp2_root``: on the root only (one unit: every weight gathered at the start of the forward pass and
  kept to the backward pass, FSDP2's root is not resharded);
* ``dp`` / ``fsdp`` run the SPMD mesh's CPU default (all-reduces of >= 1 MiB, the gradient buckets,
  asynchronous, overlapping the rest of the backward pass as DDP's reducer does; all other calls blocking);
  ``dp_async`` / ``fsdp_async``: ``async_collectives=True`` (every call asynchronous);
  ``dp_blocking`` / ``fsdp_blocking``: ``async_collectives=False`` (every call blocking);
* ``ddp_foreach`` / ``fsdp2_foreach``: the peers with ``torch.optim.AdamW(foreach=True)`` instead of
  ``--peer-optim``;
* ``fsdp_tp``: meshtorch on the 2x2 mesh ``data:2,model:2`` with layout
  ``batch:data;heads:model;d_ff:model;vocab:model`` (Megatron-style tensor parallelism over ``model``: heads,
  feed-forward hidden units, embedding rows and logits split) and storage ``d_model:data`` (every weight also
  sharded over ``data``, FSDP); each rank feeds its ``data`` coordinate's half of the batch
  (:func:`meshtorch.data.sharding.batch_slice`). Its vocabulary is padded to a multiple of 2 (50258);
* ``fsdp2_tp``: the PyTorch peer (:mod:`tp_peer`): ``BlockLM``'s architecture as ``nn.Linear`` modules,
  ``parallelize_module`` (ColwiseParallel q/k/v/wi and the vocab-split logits with ``loss_parallel``,
  RowwiseParallel o/wo and the embedding) over ``tp`` of ``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``, then
  ``fully_shard`` per block and on the root over ``dp`` (TorchTitan's recipe without sequence parallelism),
  same padded vocabulary; ``fsdp_tp_async`` / ``fsdp2_tp_foreach`` as above;
* ``dp_compile`` / ``fsdp_compile``: ``dp`` / ``fsdp`` with ``Lowering(..., mode="compile")`` (the whole step,
  forward, backward, functional collectives and AdamW, one ``torch.compile`` d graph per rank), against
  ``ddp_compile`` (``torch.compile(DDP(model))``) / ``fsdp2_compile`` (TorchTitan's ``torch.compile`` per block,
  then ``fully_shard`` per block and root): ``compiled_peers.py``. Two warm-up steps (the first compiles);
  each job compiles cold (its own empty ``TORCHINDUCTOR_CACHE_DIR``); ``--check-compiled`` compares each run's
  eager and compiled losses on a small LM.

``--check`` runs the correctness checks at a tiny size on 4 gloo ranks instead: the peer under TP + FSDP
against the same module unsharded in one process (losses, gradients, weights after AdamW steps), and
meshtorch ``fsdp_tp`` losses against meshtorch ``dp`` losses from the same seed.

``--rounds N`` repeats the job sequence N times, reversed every other round (A B B A A B ...: each run is a
job of its own, so two 163M replicated jobs never share the host's memory, and the runs are still
interleaved in time; the reversal spreads a trend of the host's load over both sides).

The runs are jobs of their own (a 163M-parameter model replicated with AdamW is ~2.6 GB per rank, so two
runs cannot share the processes on a 24 GB host); ``--rounds`` repeats the job sequence dp, ddp, fsdp,
fsdp2, so slow periods of a shared host spread over all runs. Per rank and job: peak RSS growth (VmHWM
after a reset, minus the RSS before the model was built: variables + activations + transients), the
planner's predicted per-rank total (:func:`meshtorch.planning.memory_report`; meshtorch runs only) and the
step times (wall) and process CPU times (``time.process_time``: all threads of the rank; less sensitive to a
shared host's load than wall time) of ``--steps`` steps after one warm-up step. Printed: per run the median
step time over all rounds and ranks with its spread (min-max), the median CPU time, and peak RSS per rank.
``--profile`` profiles one step of rank 0 per run (``torch.profiler``, self CPU time) instead. Everything runs
eager (meshtorch's generated code, PyTorch eager) except the ``_compile`` runs (two warm-up steps, whose times
are printed: the first minus a step is the compile time); ratios are printed eager/eager and compiled/compiled.

Run: ``python benchmarks/scale_124m.py [--steps 3] [--rounds 1] [--micro-batch 1] [--runs dp,ddp,fsdp,fsdp2]``
(``--runs fsdp_tp,fsdp2_tp`` for the 2x2 pair; ``--check`` first)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import compiled_peers  # noqa: E402
from rss import peak_rss_bytes, reset_peak  # noqa: E402
from tp_peer import TPLM, parallelize  # noqa: E402
from tp_peer import backward as tp_backward  # noqa: E402
from tp_peer import check_worker as peer_check_worker  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.data.sharding import batch_slice  # noqa: E402
from meshtorch.models.transformer import LMConfig, build_lm, preset  # noqa: E402
from meshtorch.planning import memory_report  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402

MIB = 2 ** 20
RANKS = 4
TP_RUNS = ("fsdp_tp", "fsdp_tp_async", "fsdp2_tp", "fsdp2_tp_foreach")


def config(micro_batch: int, run: str = "", **kw) -> LMConfig:
    """The benchmark's LMConfig (``micro_batch`` sequences per rank); TP runs pad the vocabulary to a multiple of 2."""
    if run in TP_RUNS:
        kw.setdefault("vocab_multiple", 2)
    base = dict(vocab_size=50257, d_model=768, num_heads=12, d_kv=64, d_ff=3072, num_layers=12, length=256)
    base.update(kw)
    return preset("tiny", batch_size=micro_batch * RANKS, **base)


def batch(cfg: LMConfig, step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


class Block(nn.Module):
    """One pre-norm block of meshtorch's LM in plain PyTorch, with its own ``forward`` (an FSDP2 unit)."""

    def __init__(self, c: LMConfig):
        super().__init__()
        self.c = c
        self.q, self.k, self.v = (nn.Parameter(torch.empty(c.d_model, c.num_heads, c.d_kv)) for _ in range(3))
        self.o = nn.Parameter(torch.empty(c.num_heads, c.d_kv, c.d_model))
        self.attention_norm = nn.Parameter(torch.ones(c.d_model))
        self.ffn_norm = nn.Parameter(torch.ones(c.d_model))
        self.wi = nn.Parameter(torch.empty(c.d_model, c.d_ff))
        self.wo = nn.Parameter(torch.empty(c.d_ff, c.d_model))
        self.reset_parameters()

    def reset_parameters(self):
        for p in (self.q, self.k, self.v, self.wi):
            nn.init.normal_(p, std=1 / math.sqrt(self.c.d_model))
        nn.init.normal_(self.o, std=1 / math.sqrt(self.c.num_heads * self.c.d_kv))
        nn.init.normal_(self.wo, std=1 / math.sqrt(self.c.d_ff))
        nn.init.ones_(self.attention_norm)
        nn.init.ones_(self.ffn_norm)

    @staticmethod
    def norm(x, scale):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale

    def forward(self, x):
        h = self.norm(x, self.attention_norm)
        q, k, v = (torch.einsum("bld,dhk->bhlk", h, w) for w in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(self.c.d_kv))
        x = x + torch.einsum("bhlk,hkd->bld", o, self.o)
        h = self.norm(x, self.ffn_norm)
        return x + F.relu(h @ self.wi) @ self.wo


class BlockLM(nn.Module):
    """meshtorch's LM architecture (RMS pre-norm, ReLU FFN, learned positions, untied logits) as modules."""

    def __init__(self, c: LMConfig):
        super().__init__()
        self.embedding = nn.Parameter(torch.empty(c.padded_vocab, c.d_model))
        self.pos_embedding = nn.Parameter(torch.empty(c.length, c.d_model))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.final_norm = nn.Parameter(torch.ones(c.d_model))
        self.logits = nn.Parameter(torch.empty(c.d_model, c.padded_vocab))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.embedding)
        nn.init.normal_(self.pos_embedding, std=0.02)
        nn.init.normal_(self.logits, std=1 / math.sqrt(self.logits.shape[0]))
        nn.init.ones_(self.final_norm)

    def forward(self, ids, targets):
        x = self.embedding[ids] + self.pos_embedding[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = Block.norm(x, self.final_norm) @ self.logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _peer_optimizer(params, peer_optim: str):
    kw = {"fused": True} if peer_optim == "fused" else {"foreach": True}
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, **kw)


MESHTORCH_RUNS = tuple(b + x for b in ("dp", "fsdp", "fsdp_tp") for x in ("", "_async", "_blocking"))


def mesh_impl(run: str):
    """The SpmdMeshImpl of a meshtorch ``run`` (layout, storage rules, asynchronous collectives: ``_async`` every
    call, ``_blocking`` none, else the SPMD default)."""
    kw = {"async_collectives": {"async": True, "blocking": False}[run.split("_")[-1]]} \
        if run.endswith(("_async", "_blocking")) else {}
    if run.startswith("fsdp_tp"):
        return mtf.SpmdMeshImpl("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model",
                                storage="d_model:data", **kw)
    return mtf.SpmdMeshImpl(f"data:{RANKS}", "batch:data", storage="d_model:data" if run.startswith("fsdp") else None,
                            **kw)


def _lowering(run: str, cfg: LMConfig, **kw):
    # 25 MiB buckets given, as the DDP peer's bucket_cap_mb=25: neither side has DDP's default 1 MiB first bucket
    kw.setdefault("bucket_bytes", 25 * 2 ** 20)
    lm = build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-4, weight_decay=0.0))
    return lm, mtf.Lowering(lm.graph, {lm.mesh: mesh_impl(run)}, **kw)


def _build(run: str, cfg: LMConfig, peer_optim: str):
    """A step function ``fn(step) -> loss`` for ``run`` and the planner's predicted bytes (meshtorch only)."""
    rank = torch.distributed.get_rank()
    per = cfg.batch_size // RANKS
    if run.endswith("_foreach"):
        run, peer_optim = run[: -len("_foreach")], "foreach"
    compiled = run.endswith("_compile")  # meshtorch mode="compile" / the peers of compiled_peers.py
    run = run.removesuffix("_compile")
    if run in MESHTORCH_RUNS:
        lm, lw = _lowering(run, cfg, mode="compile" if compiled else "codegen")
        fetches = [lm.loss] + lm.updates
        predicted = memory_report(lw, fetches).total_bytes

        def step(s):  # this rank's rows of the batch (a 2-D mesh: its ``data`` coordinate's rows)
            x, y = batch(cfg, s)
            feeds = {lm.inputs: batch_slice(x, lw, lm.inputs), lm.targets: batch_slice(y, lw, lm.targets)}
            return float(lw.run(fetches, feeds=feeds, feed_slices=True)[0])
        return step, predicted
    if run == "fsdp2_tp":
        model = TPLM(cfg)
        dp_rank = parallelize(model)["dp"].get_local_rank()
        rows = slice(dp_rank * cfg.batch_size // 2, (dp_rank + 1) * cfg.batch_size // 2)
        loss_backward = tp_backward
    else:
        model = BlockLM(cfg)
        rows = slice(rank * per, (rank + 1) * per)
        if compiled:
            model = compiled_peers.parallelize(model, run, RANKS)
        elif run == "ddp":
            model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        else:  # fsdp2: per block and the root; fsdp2_root: the root unit only
            mesh = init_device_mesh("cpu", (RANKS,))
            for b in model.blocks if run == "fsdp2" else ():
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)

        def loss_backward(_, loss):
            loss.backward()
    opt = _peer_optimizer(model.parameters(), peer_optim)
    opt_step = compiled_peers.step_fn(opt) if compiled else opt.step

    def step(s):
        x, y = batch(cfg, s)
        opt.zero_grad(set_to_none=True)
        loss = model(x[rows], y[rows])
        loss_backward(model, loss)
        opt_step()
        return loss.item()
    return step, None


def worker(run: str, cfg_kw: dict, steps: int, peer_optim: str, first_step: int) -> dict:
    """One gloo rank of ``run``: tiny warm-up (torch / gloo lazy allocations), then the model; RSS and times."""
    tiny = config(1, vocab_size=64, d_model=32, num_heads=2, d_kv=16, d_ff=64, num_layers=1, length=16)
    _build(run.replace("_compile", ""), tiny, peer_optim)[0](0)  # eager: dynamo would make the shapes dynamic
    cfg = config(**cfg_kw, run=run)
    base = reset_peak()
    t0 = time.perf_counter()
    step, predicted = _build(run, cfg, peer_optim)
    build_s = time.perf_counter() - t0
    warm = 2 if "_compile" in run else 1  # compiled: the first step compiles, the second checks no recompile
    losses, times, cpu = [], [], []
    for s in range(steps + warm):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(first_step + s))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"growth": peak_rss_bytes() - base, "predicted": predicted, "times": times[warm:], "cpu": cpu[warm:],
            "losses": losses, "build_s": build_s, "warm_s": times[:warm]}


def check_compiled_worker(run: str, steps: int) -> list:
    """One gloo rank: ``steps`` losses of ``run`` eager, then compiled, on a small LM (the same initial values)."""
    small = config(1, vocab_size=256, d_model=64, num_heads=4, d_kv=16, d_ff=128, num_layers=2, length=32)
    out = []
    for r in (run, run + "_compile"):
        torch.manual_seed(0)  # BlockLM's initial values; build_lm draws from its own seed
        step = _build(r, small, "fused")[0]
        out.append([step(s) for s in range(steps)])
    return out


def profile_worker(run: str, cfg_kw: dict, rows: int = 25) -> str | None:
    """``--profile``: a warm-up step, a timed step (wall and process CPU seconds), then one step under
    ``torch.profiler`` on rank 0; returns rank 0's times and its self-CPU-time table."""
    step = _build(run, config(**cfg_kw, run=run), "fused")[0]
    step(0)
    t0, c0 = time.perf_counter(), time.process_time()
    step(1)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if torch.distributed.get_rank() != 0:
        step(2)
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(2)
    return (f"unprofiled step: {wall:.2f} s wall, {cpu:.2f} s CPU (all threads of rank 0)\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def predict_worker(run: str, cfg_kw: dict) -> int:
    """The planner's per-rank total for a meshtorch ``run`` on a dry-run lowering (nothing allocated)."""
    lm, lw = _lowering(run, config(**cfg_kw, run=run), materialize=False)
    return memory_report(lw, [lm.loss] + lm.updates).total_bytes


def check_worker(steps: int = 3) -> dict:
    """``--check`` on one of 4 gloo ranks, at a tiny size (2 layers, d_model 64, vocab 101 padded to 102).

    The peer (:func:`tp_peer.check_worker`): TP + FSDP2 on 2x2 against the unsharded module. meshtorch:
    ``fsdp_tp``'s losses over ``steps`` AdamW steps equal ``dp``'s from the same seed (layouts never change
    results). Returns the peer's largest gradient difference and both meshtorch loss lists.

    Raises:
        AssertionError: naming what differs.
    """
    cfg = config(1, run="fsdp_tp", vocab_size=101, d_model=64, num_heads=4, d_kv=16, d_ff=128, num_layers=2,
                 length=16)
    worst = peer_check_worker(cfg)
    losses = {}
    for run in ("dp", "fsdp_tp"):
        step = _build(run, cfg, "fused")[0]
        losses[run] = [step(s) for s in range(steps)]
    torch.testing.assert_close(losses["fsdp_tp"], losses["dp"], rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"meshtorch fsdp_tp vs dp losses: {m}")
    return {"peer_grad_max_diff": worst, **losses}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per job (after one warm-up step)")
    ap.add_argument("--rounds", type=int, default=1, help="repeats of the job sequence")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--runs", default="dp,ddp,fsdp,fsdp2")
    ap.add_argument("--peer-optim", default="fused", choices=["fused", "foreach"],
                    help="torch.optim.AdamW implementation of DDP and FSDP2")
    ap.add_argument("--layers", type=int, default=12, help="(smaller for a quick check)")
    ap.add_argument("--predict-only", action="store_true", help="print the planner's per-rank totals and stop")
    ap.add_argument("--check", action="store_true",
                    help="tiny-size checks of the TP runs (peer vs unsharded module, fsdp_tp vs dp losses) and stop")
    ap.add_argument("--profile", action="store_true", help="profile one step of rank 0 of each run and stop")
    ap.add_argument("--check-compiled", action="store_true",
                    help="compare each run's losses eager vs compiled on a small LM (1e-5) and stop")
    args = ap.parse_args(argv)
    if args.check_compiled:
        for run in args.runs.split(","):
            job = run_spmd("scale_124m:check_compiled_worker", args=(run.removesuffix("_compile"), 3),
                           nprocs=RANKS, timeout_s=1800, dist_timeout_s=1800, extra_path=[HERE])
            eager, comp = job.check().results[0]
            diff = max(abs(a - b) for a, b in zip(eager, comp, strict=True))
            print(f"{run}: eager {eager}, compiled {comp}, max |diff| {diff:.2e} ({'ok' if diff <= 1e-5 else 'FAIL'})")
        return
    if args.profile:
        for run in args.runs.split(","):
            table = run_spmd("scale_124m:profile_worker", args=(run, {"micro_batch": args.micro_batch,
                             "num_layers": args.layers}), nprocs=RANKS, timeout_s=1800, extra_path=[HERE],
                             env={"MALLOC_MMAP_THRESHOLD_": "131072"}).check().results[0]
            print(f"== {run}, rank 0, one step\n{table}", flush=True)
        return
    if args.check:
        res = run_spmd("scale_124m:check_worker", nprocs=RANKS, timeout_s=900, extra_path=[HERE]).check().results[0]
        print(f"peer TP + FSDP2 on 2x2 = unsharded module (largest gradient difference "
              f"{res['peer_grad_max_diff']:.2e}); meshtorch fsdp_tp losses {res['fsdp_tp']} = dp losses {res['dp']}")
        return
    cfg_kw = {"micro_batch": args.micro_batch, "num_layers": args.layers}
    cfg = config(**cfg_kw)
    n_params = sum(v.shape.size for v in build_lm(cfg).graph.trainable_variables)
    print(f"LM: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads x {cfg.d_kv}, d_ff {cfg.d_ff}, "
          f"vocab {cfg.vocab_size}, context {cfg.length}: {n_params / 1e6:.1f}M parameters; {RANKS} gloo ranks x "
          f"{args.micro_batch} sequence(s); 1 thread each; peers' AdamW: {args.peer_optim}; eager unless _compile; "
          f"torch {torch.__version__}, {os.cpu_count()} cores")
    runs = args.runs.split(",")
    if args.predict_only:
        for run in [r for r in runs if r in MESHTORCH_RUNS]:
            pred = run_spmd("scale_124m:predict_worker", args=(run, cfg_kw), nprocs=RANKS, timeout_s=1800,
                            dist_timeout_s=1800, extra_path=[HERE]).check().results[0]
            print(f"{run}: planner per-rank total {pred / MIB:.0f} MiB")
        return
    results: dict = {r: [] for r in runs}
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # 4 ranks on few cores
    for rnd in range(args.rounds):
        for run in (runs if rnd % 2 == 0 else runs[::-1]):  # A B, B A, ...: a load trend hits both alike
            with tempfile.TemporaryDirectory(prefix="inductor_") as cache:  # cold compile in every job
                res = run_spmd("scale_124m:worker", args=(run, cfg_kw, args.steps, args.peer_optim, 1000 * rnd),
                               nprocs=RANKS, timeout_s=3600, dist_timeout_s=1800, extra_path=[HERE],
                               env={**env, "TORCHINDUCTOR_CACHE_DIR": cache}).check().results
            results[run].append(res)
            t = [x for r in res for x in r["times"]]
            c = [x for r in res for x in r["cpu"]]
            print(f"  round {rnd} {run}: step s median {statistics.median(t):.2f} (min {min(t):.2f}, max "
                  f"{max(t):.2f}); CPU s per rank median {statistics.median(c):.2f}; build {res[0]['build_s']:.0f} s; "
                  f"warm-up s {[round(v, 1) for v in res[0]['warm_s']]}; "
                  f"losses rank 0 {[round(v, 3) for v in res[0]['losses']]}", flush=True)
    print(f"\n{'run':<14}{'step s median':>14}{'spread':>16}{'CPU s median':>14}"
          f"{'peak RSS growth per rank, MiB':>34}{'planner MiB':>13}")
    med = {}
    for run, rounds in results.items():
        t = [x for res in rounds for r in res for x in r["times"]]
        med[run] = statistics.median(t)
        med[run + "_cpu"] = statistics.median([x for res in rounds for r in res for x in r["cpu"]])
        growth = [max(res[k]["growth"] for res in rounds) / MIB for k in range(RANKS)]
        pred = rounds[0][0]["predicted"]
        print(f"{run:<14}{med[run]:>14.2f}{f'{min(t):.2f}-{max(t):.2f}':>16}{med[run + '_cpu']:>14.2f}"
              f"{' '.join(f'{g:.0f}' for g in growth):>34}{'' if pred is None else f'{pred / MIB:.0f}':>13}")
        med[run + "_rss"] = max(growth)
    pairs = [(a + x, b + y) for a, b in (("dp", "ddp"), ("fsdp", "fsdp2"), ("fsdp_tp", "fsdp2_tp"))
             for x in ("", "_async", "_blocking") for y in ("", "_foreach", "_root")]
    pairs += [(a + "_compile", b + "_compile") for a, b in (("dp", "ddp"), ("fsdp", "fsdp2"))]
    for a, b in pairs:
        if a in med and b in med:
            both = "compiled" if a.endswith("_compile") else "eager"
            print(f"{a}/{b} ({both} both): step time {med[a] / med[b]:.2f}, "
                  f"CPU time {med[a + '_cpu'] / med[b + '_cpu']:.2f}, "
                  f"peak RSS {med[a + '_rss'] / med[b + '_rss']:.2f}")


if __name__ == "__main__":
    main()

"""The largest native LM this host trains (issue 33, deliverable 4): ``meshtorch train`` on 4 gloo ranks, predicted
by ``meshtorch plan`` before it runs, measured per rank while it runs.

For each ``--optimizers`` entry (default ``adamw,adafactor``):

1. ``meshtorch plan`` (in this process, a dry run: nothing allocated) of the same model, mesh ``data:4``, layout
   ``batch:data``, storage ``d_model:data`` (FSDP / ZeRO-3), ``--remat block``, ``--backend gloo``,
   ``--optimizer`` and ``--accumulate``: the predicted bytes per rank (variables + constants + peak activations).
2. ``meshtorch launch -n 4 -- python largest_model.py --worker ...``: each rank runs ``meshtorch train`` (its
   parser and :func:`meshtorch.runtime.train.main_train`, as ``meshtorch train`` under torchrun does) for
   ``--steps`` steps on the built-in corpus with the byte tokenizer (vocabulary 256), one thread, no dropout,
   no checkpoint, no sample; before training it resets its RSS high-water mark (``/proc/self/clear_refs``),
   after training it writes its peak RSS (VmHWM), the RSS it started from (the interpreter, torch and meshtorch
   imported), its losses and tokens/s to ``rank<r>.json``.

Printed per optimizer: parameters, the plan's bytes per rank, measured peak RSS per rank (worst rank) and its
growth over the starting RSS (what the plan predicts: the plan has no interpreter), growth / plan, bytes per
parameter (the 4 ranks' growths summed over the parameters), the host total (sum of the ranks' peak RSS: an upper
bound, peaks need not coincide) and the steady step time (``meshtorch train``'s tokens/s, compile steps excluded).

``--peer``: the FSDP2 peer at the same size on 4 gloo ranks (:func:`meshtorch.testing.spmd.run_spmd`): the same
architecture in plain PyTorch (:class:`scale_124m.BlockLM`), every block wrapped in activation checkpointing
(``checkpoint_wrapper``) and ``fully_shard`` per block and on the root, ``torch.optim.AdamW(fused=True)``; each
rank trains its quarter of the batch after a tiny warm-up model; its peak RSS growth and step time (median).

Run it alone on the host (every rank holds its share of the model; the RSS of other processes is not counted).
Usage (the 1B shape of issue 33; ``--layers 2 --d-model 128`` for a quick check)::

    python benchmarks/largest_model.py --layers 24 --d-model 2048 --heads 16 --d-kv 128 --d-ff 8192 \\
        --length 1024 --batch-size 4 --optimizers adamw,adafactor --peer
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)
sys.path.insert(0, HERE)

from rss import peak_rss_bytes, reset_peak  # noqa: E402

RANKS = 4
MESH, LAYOUT, STORAGE = f"data:{RANKS}", "batch:data", "d_model:data"
GIB = 2 ** 30


def gib(values) -> str:
    """Byte counts as space-separated GiB."""
    return " ".join(f"{v / GIB:.3f}" for v in values)
SHAPE = ("layers", "d_model", "heads", "d_kv", "d_ff", "length", "batch_size")


def shape_flags(a) -> list[str]:
    """``--layers N --d-model N ...`` of the parsed shape arguments."""
    return [x for k in SHAPE for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]


def train_flags(a, optimizer: str) -> list[str]:
    """The ``meshtorch train`` flags of one run."""
    return ["--preset", "tiny", *shape_flags(a), "--mesh", MESH, "--layout", LAYOUT, "--storage", STORAGE,
            "--remat", "block", "--optimizer", optimizer, "--accumulate", str(a.accumulate), "--steps",
            str(a.steps), "--eval-every", str(a.steps), "--eval-batches", "1", "--warmup-steps", "1", "--dropout",
            "0", "--sample", "0", "--plot", "", "--checkpoint-dir", "", "--threads", "1",
            "--lr", "0" if optimizer == "adafactor" else "1e-4"]


def plan(a, optimizer: str) -> tuple[int, int]:
    """``meshtorch plan``'s predicted bytes per rank and the parameter count."""
    from meshtorch.cli.plan import add_plan_subcommand
    p = argparse.ArgumentParser()
    add_plan_subcommand(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["plan", "--preset", "tiny", *shape_flags(a), "--vocab", "256", "--mesh", MESH, "--layout",
                         LAYOUT, "--storage", STORAGE, "--remat", "block", "--backend", "gloo", "--hardware", "cpu",
                         "--optimizer", optimizer, "--accumulate", str(a.accumulate)])
    with contextlib.redirect_stdout(io.StringIO()):  # the plan's own report is long; its total is printed
        rep = args.func(args)[0][1]
    return rep.total_bytes, rep.trainable_bytes * RANKS // 4  # float32 parameters, sharded over the 4 ranks


def worker(out_dir: str, argv: list[str]) -> None:
    """One rank of ``meshtorch train`` (under ``meshtorch launch``): its peak RSS over the run, to rank<r>.json."""
    import torch

    from meshtorch.cli.train import add_train_subcommand
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    add_train_subcommand(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["train", *argv])
    start = reset_peak()
    t0 = time.perf_counter()
    out = args.func(args)
    rank = int(os.environ.get("RANK", "0"))
    lm = out["lm"]
    params = sum(v.shape.size for v in lm.graph.trainable_variables)
    rec = {"rank": rank, "start_rss": start, "peak_rss": peak_rss_bytes(), "losses": out["history"]["loss"],
           "tokens_per_s": out["tokens_per_s"], "wall_s": time.perf_counter() - t0, "params": params,
           "tokens_per_step": lm.config.batch_size * a_accumulate(argv) * lm.config.length}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)


def a_accumulate(argv: list[str]) -> int:
    """``--accumulate``'s value in ``argv`` (1 if absent): the graph's batch is one microbatch."""
    return int(argv[argv.index("--accumulate") + 1]) if "--accumulate" in argv else 1


def run_meshtorch(a, optimizer: str) -> dict:
    """Plan, then train on 4 gloo ranks; the per-rank records and the plan."""
    predicted, params = plan(a, optimizer)
    with tempfile.TemporaryDirectory(prefix="largest-model-") as tmp:
        cmd = [sys.executable, "-m", "meshtorch", "launch", "-n", str(RANKS), "--timeout", str(a.timeout), "--",
               sys.executable, os.path.abspath(__file__), "--worker", tmp, "--", *train_flags(a, optimizer)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed blocks leave the RSS
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        ranks = []
        for r in range(RANKS):
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
    if proc.returncode != 0 or len(ranks) != RANKS:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"optimizer": optimizer, "predicted": predicted, "params": params, "failed": tail, "wall_s": wall}
    return {"optimizer": optimizer, "predicted": predicted, "params": ranks[0]["params"], "ranks": ranks,
            "wall_s": wall}


def report(res: dict) -> list[str]:
    """The lines printed for one optimizer's run."""
    opt, pred, n = res["optimizer"], res["predicted"], res["params"]
    head = f"{opt}: {n / 1e6:.1f}M parameters; plan {pred / GIB:.3f} GiB per rank"
    if "failed" in res:
        return [head + f"; FAILED after {res['wall_s']:.0f} s:", res["failed"]]
    ranks = res["ranks"]
    growth = [r["peak_rss"] - r["start_rss"] for r in ranks]
    worst = max(range(RANKS), key=lambda i: ranks[i]["peak_rss"])
    step_s = ranks[0]["tokens_per_step"] / ranks[0]["tokens_per_s"]
    return [head,
            f"  measured peak RSS per rank {gib(r['peak_rss'] for r in ranks)} GiB (worst rank "
            f"{worst}); growth over the starting RSS {gib(growth)} GiB; "
            f"max growth / plan = {max(growth) / pred:.3f}",
            f"  bytes per parameter (4 ranks' growth / parameters): {sum(growth) / n:.2f}; host total (sum of peak "
            f"RSS) {sum(r['peak_rss'] for r in ranks) / GIB:.2f} GiB",
            f"  step time {step_s:.2f} s (steady, compile steps excluded); losses "
            f"{[round(x, 4) for x in ranks[0]['losses']]}; job wall {res['wall_s']:.0f} s"]


def fsdp2_worker(shape: dict, steps: int) -> dict:
    """One gloo rank of the FSDP2 peer: per-block checkpoint_wrapper + fully_shard, fused AdamW; RSS and times."""
    import torch
    from scale_124m import BlockLM, batch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshtorch.models.transformer import preset
    rank = torch.distributed.get_rank()

    def build(cfg):
        model = BlockLM(cfg)
        mesh = init_device_mesh("cpu", (RANKS,))
        for i, b in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(b)
            fully_shard(model.blocks[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
        rows = slice(rank * cfg.batch_size // RANKS, (rank + 1) * cfg.batch_size // RANKS)

        def step(s):
            x, y = batch(cfg, s)
            opt.zero_grad(set_to_none=True)
            loss = model(x[rows], y[rows])
            loss.backward()
            opt.step()
            return loss.item()
        return step

    build(preset("tiny", vocab_size=256, d_model=32, num_heads=2, d_kv=16, d_ff=64, num_layers=1, length=16,
                 batch_size=RANKS))(0)  # torch / gloo lazy allocations
    cfg = preset("tiny", vocab_size=256, **shape)
    start = reset_peak()
    step = build(cfg)
    times, losses = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        losses.append(step(s))
        times.append(time.perf_counter() - t0)
    params = cfg.num_layers * (4 * cfg.d_model * cfg.num_heads * cfg.d_kv + 2 * cfg.d_model * cfg.d_ff
                               + 2 * cfg.d_model) + (2 * cfg.padded_vocab + cfg.length + 1) * cfg.d_model
    return {"start_rss": start, "peak_rss": peak_rss_bytes(), "times": times, "losses": losses, "params": params}


def run_peer(a) -> list[str]:
    from meshtorch.testing.spmd import run_spmd
    shape = {"num_layers": a.layers, "d_model": a.d_model, "num_heads": a.heads, "d_kv": a.d_kv, "d_ff": a.d_ff,
             "length": a.length, "batch_size": a.batch_size}
    res = run_spmd("largest_model:fsdp2_worker", (shape, a.steps), nprocs=RANKS, timeout_s=a.timeout,
                   dist_timeout_s=a.timeout, extra_path=[HERE], env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    if res.timed_out or any(c != 0 for c in res.returncodes):
        return ["fsdp2 peer: FAILED (does not fit, or an error):", "\n".join(e[-1500:] for e in res.stderr if e)]
    ranks = res.results
    growth = [r["peak_rss"] - r["start_rss"] for r in ranks]
    later = [t for r in ranks for t in r["times"][1:]] or [t for r in ranks for t in r["times"]]
    return [f"fsdp2 peer (per-block fully_shard + checkpoint_wrapper, fused AdamW): {ranks[0]['params'] / 1e6:.1f}M "
            f"parameters; peak RSS per rank {gib(r['peak_rss'] for r in ranks)} GiB; growth "
            f"{gib(growth)} GiB; bytes per parameter {sum(growth) / ranks[0]['params']:.2f}; host total "
            f"{sum(r['peak_rss'] for r in ranks) / GIB:.2f} GiB; step time median {statistics.median(later):.2f} s; "
            f"losses {[round(x, 4) for x in ranks[0]['losses']]}"]


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    for k, v in (("layers", 24), ("d_model", 2048), ("heads", 16), ("d_kv", 128), ("d_ff", 8192), ("length", 1024),
                 ("batch_size", 4)):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=1, help="meshtorch train --accumulate")
    p.add_argument("--optimizers", default="adamw,adafactor",
                   help="comma-separated meshtorch train --optimizer values")
    p.add_argument("--peer", action="store_true", help="also run the FSDP2 peer at the same size")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    a = p.parse_args(argv)
    lines = [f"largest_model: {RANKS} gloo ranks, mesh {MESH!r}, layout {LAYOUT!r}, storage {STORAGE!r}, --remat "
             f"block, {a.steps} steps; shape {dict((k, getattr(a, k)) for k in SHAPE)}, byte vocabulary (256); "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs"]
    print(lines[0], flush=True)
    for opt in filter(None, a.optimizers.split(",")):
        for line in report(run_meshtorch(a, opt)):
            print(line, flush=True)
            lines.append(line)
    if a.peer:
        for line in run_peer(a):
            print(line, flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        rest = sys.argv[3:]
        worker(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest)
    else:
        main()

"""Per-rank peak memory of one wide layer under FSDP: meshtorch (default flags) vs PyTorch FSDP2, one job.

Model: ``x [batch, 784] -> relu(x w1 [784, H]) w2 [H, 784]``, mean squared error against a target, AdamW
(no weight decay), H = 16384 by default (w1 and w2 are 49 MiB each). One job of 4 gloo processes
(``meshtorch.testing.spmd.run_spmd``, one CPU thread each); every process trains, one after the other:

1. meshtorch replicated data parallel: ``SpmdMeshImpl("all:4", "batch:all")``, the Lowering's default flags
   (25 MiB gradient buckets, a 1 MiB first);
2. meshtorch FSDP: the same with storage ``hidden:all`` (each rank stores a quarter of w1, w2 and their
   AdamW moments; weights all-gathered for use, gradients reduce-scattered), default flags (buckets, prefetch,
   reshard after forward);
3. PyTorch FSDP2: ``nn.Sequential(Linear(784, H), ReLU, Linear(H, 784))`` without biases, ``fully_shard`` on
   each Linear and then the root, ``torch.optim.AdamW``; each rank computes its quarter of the batch.

Memory: glibc's mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_=131072``) so the resident set tracks live
memory; each process trains a tiny model first (lazy torch / gloo allocations), then for each run records its
current RSS, builds the model with its (full, seeded) initial values, resets the high-water mark
(``/proc/self/clear_refs``: the full initial values are not part of training's peak), trains ``--steps``
steps and reports "growth" = peak RSS - the RSS before the run (so the run's sharded state is included), and
frees the run. meshtorch's runs also print ``memory_report``'s prediction
for the lowering that runs (buckets and prefetch included). Losses of the three runs agree (same batches).

Run: ``python benchmarks/fsdp_wide_mlp.py [--hidden 16384] [--batch 64] [--steps 3]``
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from rss import peak_rss_bytes, reset_peak, rss_bytes  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.planning import memory_report  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402

IO = 784
MIB = 2 ** 20


def data(batch: int, step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, IO, generator=g), torch.randn(batch, IO, generator=g)


def init(hidden: int):
    """The initial w1 [784, H], w2 [H, 784] (seed 0, uniform +-1/sqrt(fan_in)), the same for every run."""
    g = torch.Generator().manual_seed(0)
    return ((torch.rand(IO, hidden, generator=g) * 2 - 1) / IO ** 0.5,
            (torch.rand(hidden, IO, generator=g) * 2 - 1) / hidden ** 0.5)


def meshtorch_run(hidden: int, batch: int, steps: int, storage: str) -> dict:
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "m")
    b, i, h = mtf.Dimension("batch", batch), mtf.Dimension("io", IO), mtf.Dimension("hidden", hidden)
    x, t = mtf.placeholder(mesh, "x", [b, i]), mtf.placeholder(mesh, "t", [b, i])
    w1, w2 = mtf.get_variable(mesh, "w1", [i, h]), mtf.get_variable(mesh, "w2", [h, i])
    y = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[b, h])), w2], output_shape=[b, i])
    loss = mtf.reduce_mean(mtf.square(y - t))
    fetches = [loss] + mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0).apply_grads(
        mtf.gradients([loss], [w1, w2]), [w1, w2])
    lw = mtf.Lowering(g, {mesh: mtf.SpmdMeshImpl("all:4", "batch:all", storage=storage or None)}, init="lazy")
    a, c = init(hidden)
    lw.set_variable_value("w1", a)
    lw.set_variable_value("w2", c)
    del a, c
    rep = memory_report(lw, fetches)
    reset_peak()  # the full initial values made above are not part of training's peak
    losses = []
    for s in range(steps):
        xv, tv = data(batch, s)
        losses.append(float(lw.run(fetches, feeds={x: xv, t: tv})[0]))
    return {"losses": losses, "predicted": rep.total_bytes, "state": rep.variable_bytes}


def fsdp2_run(hidden: int, batch: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, per = torch.distributed.get_rank(), batch // 4
    model = torch.nn.Sequential(torch.nn.Linear(IO, hidden, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, IO, bias=False))
    a, c = init(hidden)
    with torch.no_grad():
        model[0].weight.copy_(a.t())
        model[2].weight.copy_(c.t())
    del a, c
    dm = init_device_mesh("cpu", (4,))
    fully_shard(model[0], mesh=dm)
    fully_shard(model[2], mesh=dm)
    fully_shard(model, mesh=dm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    gc.collect()
    reset_peak()  # the full model and initial values made above are not part of training's peak
    losses = []
    for s in range(steps):
        xv, tv = data(batch, s)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(xv[rank * per:(rank + 1) * per]), tv[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        full = loss.detach().clone()
        torch.distributed.all_reduce(full)
        losses.append(float(full) / 4)
    return {"losses": losses}


def worker(hidden: int, batch: int, steps: int) -> dict:
    torch.manual_seed(0)
    meshtorch_run(64, batch, 1, "hidden:all")  # warm-up: lazy allocations of torch and gloo
    meshtorch_run(64, batch, 1, "")
    fsdp2_run(64, batch, 1)
    out = {}
    for name, fn in (("meshtorch replicated DP", lambda: meshtorch_run(hidden, batch, steps, "")),
                     ("meshtorch FSDP hidden:all", lambda: meshtorch_run(hidden, batch, steps, "hidden:all")),
                     ("torch FSDP2 fully_shard per Linear + root", lambda: fsdp2_run(hidden, batch, steps))):
        gc.collect()
        base = rss_bytes()
        r = fn()
        r["growth"] = peak_rss_bytes() - base
        out[name] = r
        gc.collect()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    import host
    print(host.describe())
    res = run_spmd("fsdp_wide_mlp:worker", args=(a.hidden, a.batch, a.steps), nprocs=4, timeout_s=900,
                   extra_path=[HERE], env={"MALLOC_MMAP_THRESHOLD_": "131072"}).check().results
    print(f"MLP 784x{a.hidden}x784, batch {a.batch}, {a.steps} AdamW steps, 4 gloo ranks; per rank, worst rank:")
    names = list(res[0])
    fsdp2 = max(r[names[2]]["growth"] for r in res)
    for n in names:
        g = max(r[n]["growth"] for r in res)
        pred = max((r[n].get("predicted", 0) for r in res), default=0)
        line = f"  {n:<44} peak RSS growth {g / MIB:7.1f} MiB = {g / fsdp2:.2f}x FSDP2's"
        if pred:
            line += f"; planned {pred / MIB:7.1f} MiB (state {res[0][n]['state'] / MIB:.1f} MiB)"
        print(line + f"; losses {[round(x, 5) for x in res[0][n]['losses']]}")


if __name__ == "__main__":
    main()

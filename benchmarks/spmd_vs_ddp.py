"""Data-parallel MNIST MLP: meshtorch SpmdMeshImpl (``batch:all``) vs PyTorch DistributedDataParallel.

N gloo processes (``--procs``, default 2) on this host train the same model (the MNIST MLP of Mesh TF's README:
w1 [r:28, c:28, hidden], w2 [hidden, classes:10], no biases, softmax cross entropy, SGD) on the
same synthetic batches, each process feeding only its share of the batch. DDP starts from
meshtorch's initial weights, so the two loss curves must agree; the script checks that.
Timing alternates blocks of meshtorch and DDP steps (the host is shared) and reports the median
steps/s of each and the ratio meshtorch / DDP (goal >= 0.9). Timed meshtorch steps fetch only the
update operations: like DDP's, they then all-reduce gradients but not the loss.

Run: ``python benchmarks/spmd_vs_ddp.py [--procs 2] [--hidden 1024] [--batch 256] [--steps 20] [--blocks 5]
[--bucket-mb 25] [--executor compile]``
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


def worker(hidden: int, batch: int, steps: int, blocks: int, threads: int, async_collectives: bool = False,
           bucket_bytes: int = 0, executor: str = "codegen") -> dict:
    sys.path.insert(0, HERE)
    import mlp_model as M
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import meshtorch as mtf
    from meshtorch.data.sharding import local_batch_indices, local_feed

    torch.set_num_threads(threads)
    lr = 0.1
    g, mesh, images, labels, loss, update, w1, w2 = M.build(hidden, batch, lr=lr)
    world = dist.get_world_size()
    lw = mtf.Lowering(g, {mesh: mtf.SpmdMeshImpl(f"all:{world}", "batch:all", async_collectives=async_collectives)},
                      bucket_bytes=bucket_bytes, mode=executor)
    fetches = [loss, *update]
    rank = dist.get_rank()

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(lw.variable_value("w1").reshape(28 * 28, hidden).clone())
            self.w2 = torch.nn.Parameter(lw.variable_value("w2").clone())

        def forward(self, x):
            return torch.relu(x.reshape(x.shape[0], -1) @ self.w1) @ self.w2

    ddp = DDP(Mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)

    # one fixed set of batches, made once (only this rank's share of each batch)
    n_batches = 4
    data = []
    for i in range(n_batches):
        ids = local_batch_indices(lw, images, indices=torch.arange(batch) + i * batch)
        x, y = M.examples(ids)
        data.append((local_feed(lw, images, x), local_feed(lw, labels, y)))

    def mtf_steps(n, record=None):
        for s in range(n):
            x, y = data[s % n_batches]
            if record is None:  # timed: the update only, as DDP (which never all-reduces the loss)
                lw.run(update, feeds={images: x, labels: y}, feed_slices=True)
            else:
                out = lw.run(fetches, feeds={images: x, labels: y}, feed_slices=True)
                record.append(float(out[0]))

    def ddp_steps(n, record=None):
        for s in range(n):
            x, y = data[s % n_batches]
            opt.zero_grad(set_to_none=True)
            local = torch.nn.functional.cross_entropy(ddp(x), y)  # mean over this rank's share
            local.backward()  # DDP averages the gradients over ranks = gradient of the global mean
            opt.step()
            if record is not None:
                t = local.detach().clone()
                dist.all_reduce(t)
                record.append(float(t) / dist.get_world_size())

    # equivalence: the same few steps from the same weights give the same losses
    mtf_losses, ddp_losses = [], []
    mtf_steps(5, mtf_losses)
    ddp_steps(5, ddp_losses)
    mtf_steps(1)  # the timed plan (update only): compiled here with --executor compile
    times = {"meshtorch": [], "ddp": []}
    for _ in range(blocks):
        for name, fn in (("meshtorch", mtf_steps), ("ddp", ddp_steps)):
            dist.barrier()
            t0 = time.perf_counter()
            fn(steps)
            dist.barrier()
            times[name].append(steps / (time.perf_counter() - t0))
    return dict(rank=rank, times=times, mtf_losses=mtf_losses, ddp_losses=ddp_losses,
                compile_seconds=sorted(v for v in lw.session.compile_seconds.values() if v))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--procs", type=int, default=2, help="gloo processes (the mesh 'all:N')")
    ap.add_argument("--async", "--async-allreduce", dest="async_collectives", action="store_true",
                    help="asynchronous all-reduces (CPU default: blocking)")
    ap.add_argument("--executor", choices=("codegen", "interpret", "compile"), default="codegen",
                    help="meshtorch's executor (compile: torch.compile of the step, all-reduces inside the graph; "
                         "DDP runs eagerly)")
    ap.add_argument("--bucket-mb", type=float, default=0.0,
                    help="meshtorch gradient buckets of this many MiB per process (0: one all-reduce per gradient; "
                         "DDP's default bucket_cap_mb is 25)")
    args = ap.parse_args(argv)
    from meshtorch.testing.spmd import run_spmd

    res = run_spmd("spmd_vs_ddp:worker", args=(args.hidden, args.batch, args.steps, args.blocks, args.threads,
                                                 args.async_collectives, int(args.bucket_mb * 2**20),
                                                 args.executor),
                   nprocs=args.procs, timeout_s=900, extra_path=[HERE]).check().results[0]
    m = statistics.median(res["times"]["meshtorch"])
    d = statistics.median(res["times"]["ddp"])
    print(f"MNIST MLP hidden {args.hidden}, global batch {args.batch}, {args.procs} gloo processes x {args.threads} "
          f"thread(s), executor {args.executor}"
          + (f" (compile seconds per plan {', '.join(f'{v:.1f}' for v in res['compile_seconds'])})"
             if res["compile_seconds"] else "") + ", "
          f"{args.blocks} blocks of {args.steps} steps, "
          f"{'async' if args.async_collectives else 'blocking'} all-reduce, "
          f"buckets {args.bucket_mb:g} MiB")
    print("meshtorch steps/s per block:", ", ".join(f"{v:.1f}" for v in res["times"]["meshtorch"]))
    print("DDP       steps/s per block:", ", ".join(f"{v:.1f}" for v in res["times"]["ddp"]))
    paired = statistics.median(a / b for a, b in zip(res["times"]["meshtorch"], res["times"]["ddp"], strict=True))
    print(f"median: meshtorch {m:.1f} steps/s, DDP {d:.1f} steps/s, ratio of medians meshtorch/DDP = {m / d:.3f}; "
          f"median of per-block ratios = {paired:.3f}")
    err = max(abs(a - b) / abs(b) for a, b in zip(res["mtf_losses"], res["ddp_losses"], strict=True))
    print(f"first 5 losses meshtorch {[f'{v:.5f}' for v in res['mtf_losses']]}")
    print(f"first 5 losses DDP       {[f'{v:.5f}' for v in res['ddp_losses']]}  (max rel. diff {err:.2e})")


if __name__ == "__main__":
    main()

"""Variable memory per process: SpmdMeshImpl on 4 ranks (weights split) vs one process holding everything.

Model: the MNIST MLP with a large hidden layer (w1 [r:28, c:28, hidden:H], default H = 16384, 51 MB).
Layout ``hidden:all`` on ``all:4``: each rank stores a quarter of w1 and w2. The baseline is one
process with the unsplit model (PlacementMeshImpl on a 1-processor mesh). Reported per process:
the bytes of the variable slices it holds and the peak RSS (``resource.getrusage``) after a warm-up
run of a tiny model (hidden 64, so lazy allocations of torch / gloo are paid), after building the big
model and after a few training steps; "growth" is what the big model adds to the peak.

Run: ``python benchmarks/spmd_memory.py [--hidden 16384] [--steps 3]``
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def _train(kind: str, hidden: int, batch: int, steps: int) -> dict:
    import mlp_model as M

    import meshtorch as mtf
    from meshtorch.data.sharding import local_batch_indices, local_feed

    rss0, now0 = M.max_rss_mib(), M.current_rss_mib()
    g, mesh, images, labels, loss, update, w1, w2 = M.build(hidden, batch)
    impl = mtf.SpmdMeshImpl("all:4", "hidden:all") if kind == "spmd" else mtf.PlacementMeshImpl("", "")
    lw = mtf.Lowering(g, {mesh: impl})
    var_bytes = sum(s.numel() * s.element_size() for v in lw.variables.values() for s in impl.local_slices(v))
    rss_built = M.max_rss_mib()
    losses = []
    for step in range(steps):
        ids = local_batch_indices(lw, images, indices=torch.arange(batch) + step * batch)
        x, y = M.examples(ids)
        out = lw.run([loss, *update], feeds={images: local_feed(lw, images, x), labels: local_feed(lw, labels, y)},
                     feed_slices=True)
        losses.append(float(out[0]))
    return dict(var_bytes=var_bytes, rss_before=rss0, rss_built=rss_built, rss_peak=M.max_rss_mib(), losses=losses,
                rss_now=M.current_rss_mib(), rss_now0=now0)


def worker(kind: str, hidden: int, batch: int, steps: int) -> dict:
    """A tiny model first (hidden 64: warms up every lazy allocation), then the big one; peak RSS of each."""
    sys.path.insert(0, HERE)
    small = _train(kind, 64, batch, steps)
    big = _train(kind, hidden, batch, steps)
    big["rss_small"] = small["rss_peak"]
    big["rss_now0"] = small["rss_now0"]
    return big


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    from meshtorch.testing.spmd import run_spmd

    a = (args.hidden, args.batch, args.steps)
    # glibc's dynamic mmap threshold keeps freed 1-32 MB blocks in the heap (RSS never shrinks); a fixed
    # threshold returns every large block to the OS, so RSS tracks live memory in both kinds of process
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    single = run_spmd("spmd_memory:worker", args=("single", *a), nprocs=1, timeout_s=600,
                      extra_path=[HERE], env=env).check().results[0]
    spmd = run_spmd("spmd_memory:worker", args=("spmd", *a), nprocs=4, timeout_s=600,
                    extra_path=[HERE], env=env).check().results
    mib = 1024 * 1024
    print(f"MNIST MLP, hidden {args.hidden}, batch {args.batch}, {args.steps} SGD steps; "
          f"w1 = {28 * 28 * args.hidden * 4 / mib:.1f} MiB")
    print("RSS columns: peak RSS after the warm-up model (hidden 64), after building the big model, after training;"
          " growth = final peak - warm-up peak (what the big model costs)")
    print("'now +' = current RSS after training the big model minus current RSS before the warm-up model")
    print(f"{'process':<20}{'var MiB':>9}{'warm-up':>10}{'built':>10}{'trained':>10}{'growth':>10}{'now +':>9}  losses")
    rows = [("single process", single)] + [(f"spmd rank {r} of 4", s) for r, s in enumerate(spmd)]
    for name, s in rows:
        print(f"{name:<20}{s['var_bytes'] / mib:>9.2f}{s['rss_small']:>10.1f}{s['rss_built']:>10.1f}"
              f"{s['rss_peak']:>10.1f}{s['rss_peak'] - s['rss_small']:>10.1f}{s['rss_now'] - s['rss_now0']:>9.1f}"
              f"   {', '.join(f'{v:.5f}' for v in s['losses'])}")
    var_ratio = max(s["var_bytes"] for s in spmd) / single["var_bytes"]
    growth_ratio = max(s["rss_peak"] - s["rss_small"] for s in spmd) / (single["rss_peak"] - single["rss_small"])
    same = all(abs(a - b) <= 1e-5 * abs(b) for s in spmd for a, b in zip(s["losses"], single["losses"], strict=True))
    print(f"variable bytes per rank / single process: {var_ratio:.3f}")
    print(f"peak RSS growth per rank / single process: {growth_ratio:.3f} (the peak is set by the initializer)")
    now_ratio = max(s["rss_now"] - s["rss_now0"] for s in spmd) / (single["rss_now"] - single["rss_now0"])
    print(f"current RSS growth after training per rank / single process: {now_ratio:.3f}")
    print(f"losses equal (1e-5 rel.): {same}")


if __name__ == "__main__":
    main()

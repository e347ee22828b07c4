"""gather (per-slice index_select) vs Mesh TF's einsum(one_hot, weights), forward + gradient.

Usage: ``python benchmarks/bench_gather.py [vocab] [d_model] [tokens]``; prints seconds per run
and the ratio on one processor and on a simulated ``all:4`` mesh with the vocab split.
"""

import sys
import time

import torch

import meshtorch as mtf


def build_and_time(vocab, d, tokens, mesh_shape, layout, use_onehot, reps=3):
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    w = mtf.get_variable(mesh, "w", f"v:{vocab},d:{d}")
    ids = mtf.placeholder(mesh, "ids", f"t:{tokens}", dtype=torch.int64)
    if use_onehot:
        y = mtf.einsum([mtf.one_hot(ids, mtf.Dimension("v", vocab)), w], output_shape=f"t:{tokens},d:{d}")
    else:
        y = mtf.gather(w, ids, "v")
    loss = mtf.reduce_sum(mtf.square(y))
    (dw,) = mtf.gradients([loss], [w])
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    feeds = {ids: torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))}
    lw.run([loss, dw], feeds=feeds)  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        out = lw.run([loss, dw], feeds=feeds)
    return (time.perf_counter() - t0) / reps, out[0].item()


def main():
    vocab, d, tokens = (int(a) for a in (sys.argv[1:] + ["8192", "256", "1024"][len(sys.argv) - 1:]))
    torch.set_num_threads(1)
    print(f"vocab={vocab} d_model={d} tokens={tokens} (forward + gradient, 1 thread)")
    for mesh_shape, layout in (("", ""), ("all:4", "v:all")):
        tg, lg = build_and_time(vocab, d, tokens, mesh_shape, layout, False)
        to, lo = build_and_time(vocab, d, tokens, mesh_shape, layout, True)
        assert abs(lg - lo) <= 1e-4 * abs(lo), (lg, lo)
        print(f"  mesh {mesh_shape or '1 processor':<12} gather {tg * 1e3:8.1f} ms   one_hot einsum {to * 1e3:8.1f} ms"
              f"   speed-up x{to / tg:.1f}")


if __name__ == "__main__":
    main()

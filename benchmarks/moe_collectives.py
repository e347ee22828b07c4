"""Collectives of one MoE layer (forward, and forward+backward) per layout, from the plan (no run).

    python benchmarks/moe_collectives.py

Prints, per layout, the count and bytes per processor of each collective kind, so the GShard
layout (``batch:all;experts:all``: all-to-alls) can be compared with the others.
"""

import torch

import meshtorch as mtf

G, S, M, E, H, CAP = 32, 64, 64, 8, 128, 16
LAYOUTS = [("all:4", "batch:all"), ("all:4", "batch:all;expert_batch:all"), ("all:4", "experts:all"),
           ("all:4", "batch:all;experts:all"), ("all:4", "d_ff:all"),
           ("rows:2;cols:2", "batch:rows;experts:cols"), ("rows:2;cols:2", "batch:rows;experts:cols;expert_batch:rows")]


def plan(mesh_shape, layout):
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    x = mtf.get_variable(mesh, "x", f"batch:{G};length:{S};d_model:{M}")
    y, aux = mtf.layers.moe_ffn(x, mtf.Dimension("experts", E), mtf.Dimension("d_ff", H), capacity_factor=2.0,
                                name="moe")
    loss = mtf.reduce_sum(y * y) + aux
    v = g.trainable_variables
    grads = mtf.gradients([loss], v)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    return lw.plan_counters([y]), lw.plan_counters([loss] + grads)


def describe(c):
    kinds = {}
    for col, n in c.records.items():
        k = kinds.setdefault(col.kind, [0, 0])
        k[0] += n
        k[1] += n * col.bytes_per_processor
    return ", ".join(f"{k} x{n} ({b / 1024:.0f} KiB/proc)" for k, (n, b) in sorted(kinds.items())) or "none"


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"MoE layer: groups {G} x tokens {S}, d_model {M}, {E} experts, d_ff {H}; float32")
    for mesh_shape, layout in LAYOUTS:
        fwd, train = plan(mesh_shape, layout)
        print(f"{mesh_shape:>14} {layout:<45} forward: {describe(fwd)}")
        print(f"{'':>14} {'':<45} fwd+bwd: {describe(train)}")

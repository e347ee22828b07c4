"""Worker of tests/test_bucket_defaults.py (runs inside gloo ranks)."""

import torch

import meshtorch as mtf


def mlp_losses(bucket_bytes="default", steps: int = 3):
    """(session bucket bytes, losses, allreduce-bucket calls) of an SGD MLP, data parallel on all ranks."""
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "m")
    b, io, h = mtf.Dimension("batch", 8), mtf.Dimension("io", 8), mtf.Dimension("hidden", 16)
    x = mtf.placeholder(mesh, "x", [b, io])
    w1 = mtf.get_variable(mesh, "w1", [io, h])
    w2 = mtf.get_variable(mesh, "w2", [h, io])
    y = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[b, h])), w2], output_shape=[b, io])
    loss = mtf.reduce_mean(mtf.square(y - x))
    updates = mtf.optim.SgdOptimizer(0.1).apply_grads(mtf.gradients([loss], [w1, w2]), [w1, w2])
    impl = mtf.SpmdMeshImpl(f"data:{torch.distributed.get_world_size()}", "batch:data")
    kw = {} if bucket_bytes == "default" else {"bucket_bytes": bucket_bytes}
    lw = mtf.Lowering(g, {mesh: impl}, **kw)
    losses = [lw.run([loss] + updates, feeds={x: torch.randn(8, 8, generator=torch.Generator().manual_seed(s))})[0]
              .item() for s in range(steps)]
    plan = lw.session.plan(lw._fetch_keys([loss] + updates))
    buckets = sum(st.kind == "allreduce_bucket" for st in plan.steps)
    return lw.session.bucket_bytes, losses, buckets


def worker():
    return {"default": mlp_losses(), "off": mlp_losses(0)}

"""A small MLP trained with momentum on a fixed data order; shared by the checkpoint tests and the
child process that the crash test kills (so it must import without pytest)."""

import torch

import meshtorch as mtf

LAYOUT_A = ("rows:2;cols:2", "batch:rows;hidden:cols")
LAYOUT_B = ("all:4", "hidden:all")
LAYOUT_C = ("", "")
LAYOUT_D = ("rows:2;cols:2", "hidden:rows;out:cols")
BATCH, IO, OUT = 8, 6, 4


def build(mesh_shape, layout, hidden=8, seed=0, extra_var=False, step_dtype=torch.int64, w1_hidden_first=False,
          make_impl=None):
    """Returns ``(lowering, x, y, loss, updates)``; variables: mlp/w1 [io, hidden], mlp/b1 [hidden],
    mlp/w2 [hidden, out], their momentum slots, and a global_step counter. ``make_impl(mesh_shape,
    layout)`` makes the mesh implementation (default ``PlacementMeshImpl``; e.g.
    ``meshtorch.mesh.make_mesh_impl`` for SPMD)."""
    g = mtf.Graph(seed=seed)
    mesh = mtf.Mesh(g, "mesh")
    batch, io = mtf.Dimension("batch", BATCH), mtf.Dimension("io", IO)
    hid, out = mtf.Dimension("hidden", hidden), mtf.Dimension("out", OUT)
    x = mtf.placeholder(mesh, "x", [batch, io])
    y = mtf.placeholder(mesh, "y", [batch, out])
    w1 = mtf.get_variable(mesh, "mlp/w1", [hid, io] if w1_hidden_first else [io, hid])
    b1 = mtf.get_variable(mesh, "mlp/b1", [hid], initializer=0.1)
    w2 = mtf.get_variable(mesh, "mlp/w2", [hid, out])
    if extra_var:
        mtf.get_variable(mesh, "mlp/extra", [out])
    h = mtf.relu(mtf.einsum([x, w1], output_shape=[batch, hid]) + b1)
    pred = mtf.einsum([h, w2], output_shape=[batch, out])
    loss = mtf.reduce_mean(mtf.square(pred - y))
    params = [w1, b1, w2]
    grads = mtf.gradients([loss], params)
    # the optimizer finds this step counter (get_or_create_global_step) and increments it once per update
    mtf.get_variable(mesh, "global_step", [], initializer=0, dtype=step_dtype, trainable=False)
    updates = mtf.optim.MomentumOptimizer(0.05, 0.9).apply_grads(grads, params)
    lw = mtf.Lowering(g, {mesh: (make_impl or mtf.PlacementMeshImpl)(mesh_shape, layout)})
    return lw, x, y, loss, updates


def data(i):
    """Batch ``i`` of the fixed data order."""
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randn(BATCH, IO, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def train(model, start, n):
    """Run steps ``start .. start+n-1``; returns the losses (0-d tensors)."""
    lw, x, y, loss, updates = model
    losses = []
    for i in range(start, start + n):
        xv, yv = data(i)
        losses.append(lw.run([loss] + updates, feeds={x: xv, y: yv})[0])
    return losses


def values(lw):
    return {n: lw.variable_value(n) for n in lw.variable_names}

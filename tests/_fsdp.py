"""The FSDP acceptance runs of tests/test_fsdp.py, importable inside the gloo processes (run_spmd workers).

One tiny LM, three layouts (replicated data parallel; FSDP over ``data``; FSDP + tensor parallel on
``data:2,model:2``), two optimizers (AdamW with global-norm clipping; Adafactor), 10 steps each.
"""

from __future__ import annotations

import torch

import meshtorch as mtf
from meshtorch.models.transformer import build_lm, preset

CFG = preset("tiny", vocab_size=30, vocab_multiple=4, d_model=16, num_heads=4, d_kv=4, d_ff=32, num_layers=2,
             length=8, batch_size=4)
STEPS = 10
TP = "batch:data;heads:model;d_ff:model;vocab:model"
# name -> (mesh shape, compute rules, storage rules)
LAYOUTS = {
    "replicated_dp": ("data:4", "batch:data", ""),
    "fsdp": ("data:4", "batch:data", "d_model:data"),
    "fsdp_tp": ("data:2,model:2", TP, "d_model:data"),
}
OPTIMIZERS = ("adamw_clip", "adafactor")
LR, WD, CLIP = 1e-2, 0.01, 1.0
BUCKET_BYTES = 4096  # a few of the tiny LM's weights per bucket: several buckets per step


def data(step: int):
    """(inputs, targets) int64 [batch, length]: three fixed batches, cycled."""
    g = torch.Generator().manual_seed(step % 3)
    ids = torch.randint(0, CFG.vocab_size, (CFG.batch_size, CFG.length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def build(optimizer: str):
    """The LM training step, built explicitly so the gradients are known: (lm, variables, grads, updates)."""
    lm = build_lm(CFG, seed=4)
    variables = lm.graph.trainable_variables
    grads = mtf.gradients([lm.loss], variables)
    if optimizer == "adamw_clip":
        clipped, _ = mtf.optim.clip_by_global_norm(grads, CLIP)
        updates = mtf.optim.AdamWOptimizer(LR, weight_decay=WD).apply_grads(clipped, variables)
    elif optimizer == "adafactor":
        updates = mtf.optim.AdafactorOptimizer().apply_grads(grads, variables)
    else:
        raise ValueError(optimizer)
    return lm, variables, grads, updates


def train(impl, optimizer: str, steps: int = STEPS, bucket_bytes: int = 0):
    """``steps`` training steps on ``impl``: (losses, final parameter values, counters of all the steps)."""
    lm, variables, _, updates = build(optimizer)
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl}, bucket_bytes=bucket_bytes)
    losses = []
    for s in range(steps):
        x, y = data(s)
        losses.append(lw.run([lm.loss] + updates, feeds={lm.inputs: x, lm.targets: y})[0].item())
    values = {v.name: lw.variable_value(v.name) for v in variables}
    counters = {(c.kind, c.mesh_axes, c.op, c.tensor, c.bytes_per_processor): n
                for c, n in lw.counters.records.items()}
    return losses, values, counters


def spmd_worker():
    """Inside a gloo rank: every (layout, optimizer) run on an SpmdMeshImpl; {(layout, optimizer): train(...)},
    ``(layout, "adamw_clip", "async")`` for the storage layouts with asynchronous collectives,
    plus ``("bf16", storage)``: the bfloat16-activation MLP (:func:`bf16_steps`)."""
    out = {}
    for name, (mesh_shape, layout, storage) in LAYOUTS.items():
        for opt in OPTIMIZERS:
            out[(name, opt)] = train(mtf.SpmdMeshImpl(mesh_shape, layout, storage=storage), opt)
        if storage:  # asynchronous all-gathers (prefetched one ahead) and reduce-scatters waited at first use;
            # then also bucketed (one flat all-gather / reduce-scatter call per bucket of weights / gradients)
            out[(name, "adamw_clip", "async")] = train(
                mtf.SpmdMeshImpl(mesh_shape, layout, storage=storage, async_collectives=True), "adamw_clip")
            out[(name, "adamw_clip", "buckets")] = train(
                mtf.SpmdMeshImpl(mesh_shape, layout, storage=storage, async_collectives=True), "adamw_clip",
                bucket_bytes=BUCKET_BYTES)
    for storage in BF16_STORAGE:
        out[("bf16", storage)] = bf16_steps(mtf.SpmdMeshImpl("all:4", "batch:all", storage=storage))
    return out


# ---------------------------------------------------------------------- mixed precision under storage rules
BF16_STORAGE = ("", "io:all")


def bf16_mlp():
    """A 2-layer MLP with float32 variables read as bfloat16 (``VariableDType``), SGD: (graph, mesh, x, loss,
    variables, grads, updates)."""
    g = mtf.Graph(seed=5)
    mesh = mtf.Mesh(g, "mesh")
    b, io, h = mtf.Dimension("batch", 8), mtf.Dimension("io", 8), mtf.Dimension("hidden", 16)
    vd = mtf.VariableDType(torch.float32, torch.float32, torch.bfloat16)
    x = mtf.placeholder(mesh, "x", [b, io], dtype=torch.bfloat16)
    w1 = mtf.get_variable(mesh, "w1", [io, h], dtype=vd)
    w2 = mtf.get_variable(mesh, "w2", [h, io], dtype=vd)
    y = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[b, h])), w2], output_shape=[b, io])
    loss = mtf.reduce_mean(mtf.square(mtf.cast(y, torch.float32) - mtf.cast(x, torch.float32)))
    variables = g.trainable_variables
    grads = mtf.gradients([loss], variables)
    updates = mtf.optim.SgdOptimizer(0.1).apply_grads(grads, variables)
    return g, mesh, x, loss, variables, grads, updates


def bf16_steps(impl, steps: int = 3):
    """``steps`` SGD steps of :func:`bf16_mlp` on ``impl``: (losses, final float32 weights)."""
    g, mesh, x, loss, variables, _, updates = bf16_mlp()
    lw = mtf.Lowering(g, {mesh: impl})
    losses = []
    for s in range(steps):
        xv = torch.randn(8, 8, generator=torch.Generator().manual_seed(50 + s)).bfloat16()
        losses.append(lw.run([loss] + updates, feeds={x: xv})[0].item())
    return losses, {v.name: lw.variable_value(v.name) for v in variables}


# ---------------------------------------------------------------------- checkpoints across storage layouts
CKPT_STEPS = 3


def ckpt_save_worker(path: str):
    """4 ranks, FSDP over ``data``: train CKPT_STEPS AdamW steps, ``mtf.save`` (each rank writes its shards);
    return (losses, full values of every variable, the plain-PyTorch state dict, checkpoint directory)."""
    mesh_shape, layout, storage = LAYOUTS["fsdp"]
    lm, _, _, updates = build("adamw_clip")
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.SpmdMeshImpl(mesh_shape, layout, storage=storage)})
    local = [list(lw.slice_shape(v.outputs[0])) for v in lw.variables]
    losses = []
    for s in range(CKPT_STEPS):
        x, y = data(s)
        losses.append(lw.run([lm.loss] + updates, feeds={lm.inputs: x, lm.targets: y})[0].item())
    final = mtf.save(lw, path, step=CKPT_STEPS)
    values = {n: lw.variable_value(n) for n in lw.variable_names}
    return losses, values, mtf.to_torch_state_dict(lw, trainable_only=True), final, local

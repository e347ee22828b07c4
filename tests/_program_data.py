"""Graphs for tests/test_program_data.py, importable inside the gloo processes (run_spmd workers)."""

from __future__ import annotations

import torch

import meshtorch as mtf

B, IO, HID = mtf.Dimension("batch", 8), mtf.Dimension("io", 4), mtf.Dimension("hidden", 8)


def mlp_step(lr: float = 0.1):
    """A 2-layer MLP training step: returns (graph, mesh, x, [w1, w2], loss, grads, updates)."""
    g = mtf.Graph(seed=3)
    mesh = mtf.Mesh(g, "mesh")
    x = mtf.placeholder(mesh, "x", [B, IO])
    w1 = mtf.get_variable(mesh, "w1", [IO, HID])
    w2 = mtf.get_variable(mesh, "w2", [HID, IO])
    h = mtf.relu(mtf.einsum([x, w1], output_shape=[B, HID]))
    y = mtf.einsum([h, w2], output_shape=[B, IO])
    loss = mtf.reduce_mean(mtf.square(y - x))
    grads = mtf.gradients([loss], [w1, w2])
    updates = mtf.optim.SgdOptimizer(lr).apply_grads(grads, [w1, w2])
    return g, mesh, x, [w1, w2], loss, grads, updates


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step))


def run_json_steps(text: str, impl, values: dict, steps: int, fetches: list, update_ops: list):
    """Run a serialised training program ``steps`` times on ``impl``: returns per-step fetched values,
    final variable values and the counters (as ``{(kind, axes, op, tensor, bytes): count}``)."""
    program = mtf.Program.from_json(text)
    impls = {"mesh": impl}
    store = mtf.VariableStore(program, impls)
    for n, v in values.items():
        store.set_value(n, v)
    session = mtf.Session(program, impls, store)
    keys = tuple(("tensor", n) for n in fetches) + tuple(("assign", n) for n in update_ops)
    out = []
    for s in range(steps):
        res = session.run(keys, {"x": batch(s)})
        out.append([r for r in res[:len(fetches)]])
    counters = {(c.kind, c.mesh_axes, c.op, c.tensor, c.bytes_per_processor): n
                for c, n in session.counters.records.items()}
    return out, {n: store.value(n) for n in values}, counters


def spmd_json_worker(text: str, values: dict, steps: int, fetches: list, update_ops: list, mesh_shape: str,
                     layout: str, storage: str):
    """Inside a gloo rank: run the JSON program on an SpmdMeshImpl (no graph is built here)."""
    impl = mtf.SpmdMeshImpl(mesh_shape, layout, storage=storage)
    return run_json_steps(text, impl, values, steps, fetches, update_ops)


def spmd_bucket_worker(steps: int, bucket_bytes: int):
    """Inside a gloo rank: the MLP data-parallel over 4 ranks, gradient all-reduces in buckets."""
    g, mesh, x, ws, loss, grads, updates = mlp_step()
    lw = mtf.Lowering(g, {mesh: mtf.SpmdMeshImpl("all:4", "batch:all")}, bucket_bytes=bucket_bytes)
    losses = [lw.run([loss] + updates, feeds={x: batch(s)})[0] for s in range(steps)]
    kinds = [st.kind for st in lw.plan([loss] + updates).steps]
    return losses, {n: lw.variable_value(n) for n in ("w1", "w2")}, kinds, spmd_direct_kernels(steps)


def spmd_direct_kernels(steps: int) -> dict:
    """Inside a gloo rank: the MLP with every gradient all-reduce asynchronous (no buckets) under the generated
    code and the interpreter: per mode the fetched loss and gradients per step and the variables; with the
    generated code's slicewise step count and its kernel calls (``= k`` lines of its source)."""
    out = {}
    for mode in ("codegen", "interpret"):
        g, mesh, x, ws, loss, grads, updates = mlp_step()
        impl = mtf.SpmdMeshImpl("all:4", "batch:all", async_collectives=True)
        lw = mtf.Lowering(g, {mesh: impl}, mode=mode, bucket_bytes=0)
        fetches = [loss, *grads] + updates
        runs = [lw.run(fetches, feeds={x: batch(s)})[:3] for s in range(steps)]
        plan = lw.plan(fetches)
        out[mode] = (runs, {n: lw.variable_value(n) for n in ("w1", "w2")})
        if mode == "codegen":
            out["slicewise"] = sum(st.kind == "slicewise" for st in plan.steps)
            out["kernel_calls"] = plan.fn.source.count(" = k")
    return out


def spmd_compiled_worker(steps: int, mesh_shape: str, layout: str, storage: str, bucket_bytes: int,
                         backend: str = "inductor"):
    """Inside a gloo rank: the MLP compiled (``mode="compile"``, ``torch.compile`` backend ``backend``): losses,
    variables, step kinds, dynamo's graph-break reasons and number of graphs compiled, and whether inductor ran."""
    from torch._dynamo.utils import counters

    counters.clear()
    g, mesh, x, ws, loss, grads, updates = mlp_step()
    # asynchronous: dynamo turns blocking c10d calls into functional collectives by itself, not async_op=True
    # calls (23 graphs for this program before SpmdMeshImpl.traceable())
    impl = mtf.SpmdMeshImpl(mesh_shape, layout, storage=storage, async_collectives=True)
    lw = mtf.Lowering(g, {mesh: impl}, mode="compile", bucket_bytes=bucket_bytes, compile_backend=backend)
    losses = [lw.run([loss] + updates, feeds={x: batch(s)})[0] for s in range(steps)]
    kinds = [st.kind for st in lw.plan([loss] + updates).steps]
    return (losses, {n: lw.variable_value(n) for n in ("w1", "w2")}, kinds, dict(counters["graph_break"]),
            counters["stats"]["unique_graphs"], bool(counters["inductor"]))


class HalfValues(mtf.Initializer):
    """An initializer implementing only ``values`` (not plain data: lost in JSON): 0.5 everywhere."""

    def values(self, shape, dtype, seed, key, index):
        return torch.full(index.shape, 0.5, dtype=dtype)


def init_graph(lost: bool = False):
    """A graph whose variables use several initializers (Glorot, normal, truncated normal, constant, ones);
    ``lost``: one more variable whose initializer is not plain data. Returns (graph, mesh, x, loss)."""
    g = mtf.Graph(seed=5)
    mesh = mtf.Mesh(g, "mesh")
    x = mtf.placeholder(mesh, "x", [B, IO])
    w1 = mtf.get_variable(mesh, "w1", [IO, HID])
    w2 = mtf.get_variable(mesh, "w2", [HID, IO], initializer=mtf.random_normal_initializer(0.1, 0.5))
    w3 = mtf.get_variable(mesh, "w3", [HID], initializer=mtf.truncated_normal_initializer(stddev=2.0))
    b = mtf.get_variable(mesh, "b", [IO], initializer=mtf.constant_initializer(0.25))
    s = mtf.get_variable(mesh, "s", [HID], initializer=mtf.ones_initializer())
    h = mtf.relu(mtf.einsum([x, w1], output_shape=[B, HID]) * s + w3)
    y = mtf.einsum([h, w2], output_shape=[B, IO]) + b
    if lost:
        y = y * mtf.get_variable(mesh, "half", [IO], initializer=HalfValues())
    return g, mesh, x, mtf.reduce_mean(mtf.square(y - x))


def spmd_json_init_worker(text: str, loss_name: str, mesh_shape: str, layout: str, mode: str):
    """Inside a gloo rank: a JSON program's variables as the store initialises them, and one loss."""
    program = mtf.Program.from_json(text)
    impls = {"mesh": mtf.SpmdMeshImpl(mesh_shape, layout)}
    store = mtf.VariableStore(program, impls)
    session = mtf.Session(program, impls, store, mode)
    loss = session.run((("tensor", loss_name),), {"x": batch(0)})[0]
    return {n: store.value(n) for n in store.names}, loss

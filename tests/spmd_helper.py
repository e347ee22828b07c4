"""Functions run inside the 4 gloo processes of tests/test_spmd.py (via meshtorch.testing.spmd.run_spmd).

Each builds a small graph, runs it on SpmdMeshImpl and returns what the parent process compares with
a PlacementMeshImpl run of the same graph (the parent never trusts the workers' own comparisons).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import meshtorch as mtf
from meshtorch.data.sharding import batch_slice, local_batch_indices, local_feed

INIT_LAYOUTS = [("all:4", "hidden:all"), ("all:4", "r:all"), ("rows:2;cols:2", "hidden:rows;classes:cols"),
                ("rows:2;cols:2", "r:rows;c:cols")]
FEED_LAYOUTS = [("all:4", "batch:all"), ("rows:2;cols:2", "batch:rows;hidden:cols"), ("all:4", "hidden:all")]


def init_graph():
    """Variables with several initializers: ``{name: Tensor}`` and the graph."""
    g = mtf.Graph(seed=3)
    mesh = mtf.Mesh(g, "mesh")
    r, c, h, k = mtf.Dimension("r", 4), mtf.Dimension("c", 4), mtf.Dimension("hidden", 8), mtf.Dimension("classes", 4)
    vs = {
        "w1": mtf.get_variable(mesh, "w1", [r, c, h]),  # Glorot uniform
        "w2": mtf.get_variable(mesh, "w2", [h, k], initializer=mtf.random_normal_initializer(stddev=0.5)),
        "w3": mtf.get_variable(mesh, "w3", [k, r], initializer=mtf.truncated_normal_initializer()),
        "b": mtf.get_variable(mesh, "b", [k], initializer=0.25),
    }
    return g, mesh, vs


def init_values_worker():
    """Per layout: {variable name: (local slice, its index bounds, slice shape the impl expects)}."""
    out = {}
    for mesh_shape, layout in INIT_LAYOUTS:
        g, mesh, vs = init_graph()
        lw = mtf.Lowering(g, {mesh: mtf.SpmdMeshImpl(mesh_shape, layout)})
        got = {}
        for name, t in vs.items():
            value = lw.variables[t.operation]
            (bounds,) = lw.local_slice_bounds(t)
            got[name] = (value.clone(), bounds, lw.slice_shape(t), type(value).__name__)
        out[(mesh_shape, layout)] = got
    return out


def feed_graph():
    g = mtf.Graph(seed=5)
    mesh = mtf.Mesh(g, "mesh")
    batch, io, hidden = mtf.Dimension("batch", 8), mtf.Dimension("io", 4), mtf.Dimension("hidden", 8)
    x = mtf.placeholder(mesh, "x", [batch, io])
    w = mtf.get_variable(mesh, "w", [io, hidden])
    y = mtf.relu(mtf.einsum([x, w], output_shape=[batch, hidden]))
    loss = mtf.reduce_mean(mtf.square(y))
    (gw,) = mtf.gradients([loss], [w])
    update = mtf.assign_sub(w, gw * 0.5)
    return g, mesh, x, w, y, loss, update


def example_rows(ids: torch.Tensor) -> torch.Tensor:
    """The 'dataset': example i is a fixed function of i, so a process computes only the rows it reads."""
    j = torch.arange(4, dtype=torch.float32)
    return torch.sin(ids.to(torch.float32)[:, None] * 1.7 + j[None, :] * 0.3) + 0.2


def feeds_worker(steps: int = 3):
    """Train with local feeds; returns per layout the losses, local y slices with bounds and final w."""
    out = {}
    for mesh_shape, layout in FEED_LAYOUTS:
        g, mesh, x, w, y, loss, update = feed_graph()
        lw = mtf.Lowering(g, {mesh: mtf.SpmdMeshImpl(mesh_shape, layout)})
        rec = {"loss": [], "y": [], "ids": []}
        for step in range(steps):
            batch_ids = torch.arange(8) + 8 * step  # the global batch's example ids
            ids = local_batch_indices(lw, x, "batch", indices=batch_ids)
            rec["ids"].append(ids)
            feed = local_feed(lw, x, example_rows(ids))
            loss_v, y_local, _ = lw.run([loss, y, update], feeds={x: feed}, feed_slices=True, return_slices=True)
            (bounds,) = lw.local_slice_bounds(y)
            rec["loss"].append(float(loss_v.reshape(())))
            rec["y"].append((y_local.clone(), bounds))
        rec["w"] = lw.variable_value("w")
        # the same program with a full feed still works, and batch_slice gives the same slice
        full = example_rows(torch.arange(8))
        rec["full_feed_loss"] = float(lw.run(loss, feeds={x: full}))
        rec["batch_slice_loss"] = float(lw.run(loss, feeds={x: batch_slice(full, lw, x)}, feed_slices=True))
        try:
            lw.run(loss, feeds={x: full}, feed_slices=True)
            rec["bad_feed"] = None
        except mtf.FeedError as e:
            rec["bad_feed"] = str(e)
        out[(mesh_shape, layout)] = rec
    try:
        mtf.SpmdMeshImpl("all:2", "")
        out["wrong_mesh"] = None
    except mtf.MeshtorchError as e:
        out["wrong_mesh"] = str(e)
    return out


def failing_worker(fail_rank: int, fail_step: int, how: str = "raise"):
    """Train a data-parallel step in a loop; ``fail_rank`` raises, dies or hangs (``how``) at ``fail_step``."""
    g, mesh, x, w, y, loss, update = feed_graph()
    lw = mtf.Lowering(g, {mesh: mtf.SpmdMeshImpl(f"all:{dist.get_world_size()}", "batch:all")})
    rank = dist.get_rank()
    for step in range(fail_step + 50):
        if rank == fail_rank and step == fail_step:
            print(f"FAILING_AT {time.time():.3f}", file=sys.stderr, flush=True)
            if how == "exit":
                os._exit(3)
            if how == "hang":
                time.sleep(3600)
            raise RuntimeError(f"injected failure at step {step}")
        ids = local_batch_indices(lw, x, indices=torch.arange(8))
        lw.run([loss, update], feeds={x: local_feed(lw, x, example_rows(ids))}, feed_slices=True)
        time.sleep(0.05)
    return "finished"


def assign_sum_graph():
    """``v <- einsum(x, w)`` contracting the split ``batch``: the assigned value is an all-reduce's output."""
    g = mtf.Graph(seed=7)
    mesh = mtf.Mesh(g, "mesh")
    batch, io, hidden = mtf.Dimension("batch", 8), mtf.Dimension("io", 4), mtf.Dimension("hidden", 8)
    x = mtf.placeholder(mesh, "x", [batch, io])
    w = mtf.get_variable(mesh, "w", [batch, hidden])
    v = mtf.get_variable(mesh, "v", [io, hidden], initializer=0.0)
    op = mtf.assign(v, mtf.einsum([x, w], output_shape=[io, hidden]))
    return g, mesh, x, v, op


def async_worker():
    """Assign an all-reduce output directly (async and sync all-reduce); variable must be a plain tensor."""
    out = {}
    for async_collectives in (True, False):
        g, mesh, x, v, op = assign_sum_graph()
        lw = mtf.Lowering(g, {mesh: mtf.SpmdMeshImpl("all:4", "batch:all", async_collectives=async_collectives)})
        lw.run(op, feeds={x: example_rows(torch.arange(8))})
        stored = lw.variables[v.operation]
        out[async_collectives] = (type(stored).__name__, stored.clone(), lw.variable_value("v"))
    return out


PRIMITIVE_MESHES = ["all:4", "rows:2;cols:2"]


def primitive_inputs():
    """Full tensors of three dtypes and the layouts (mesh axis per tensor dim) to import them with."""
    gen = torch.Generator().manual_seed(11)
    f = torch.randn(4, 6, 8, generator=gen)
    tensors = {"float32": f, "int64": (f * 10).to(torch.int64), "bool": f > 0.3}
    layouts = {"all:4": [(None, None, None), (0, None, None), (None, None, 0)],
               "rows:2;cols:2": [(None, None, None), (0, None, 1), (1, 0, None), (None, None, 0)]}
    return tensors, layouts


def primitive_calls(impl, x, layout):
    """``[(name, laid-out result)]``: every primitive on ``x`` (the same list for any MeshImpl)."""
    from itertools import combinations

    out = []
    nd = impl.ndims
    for r in range(1, nd + 1):
        for axes in combinations(range(nd), r):
            for red in ("SUM", "MAX", "MIN"):
                out.append((f"allreduce{axes}{red}", impl.allreduce(x, list(axes), red)))
    for a in range(nd):
        n = impl.shape[a].size
        for c in range(3):
            out.append((f"allconcat{a},{c}", impl.allconcat(x, a, c)))
            for sp in range(3):
                if impl.slice_shape([("d0", 4), ("d1", 6), ("d2", 8)], _layout(layout))[sp] % n == 0:
                    out.append((f"alltoall{a},{sp},{c}", impl.alltoall(x, a, sp, c)))
        for off in (1, -1, 2):
            for wrap in (True, False):
                out.append((f"shift{a},{off},{wrap}", impl.shift_by_n_processors(x, a, off, wrap)))
        out.append((f"receive{a}", impl.receive(x, a, [n - 1 - c if c % 2 == 0 else None for c in range(n)])))
    out.append(("export", impl.export_full(x, _layout(layout))))
    return out


def _layout(t):
    from meshtorch.core.layout import TensorLayout

    return TensorLayout(t)


def primitives_worker():
    """SpmdMeshImpl primitives on every dtype/layout: ``{(mesh, dtype, layout, name): local result}``."""
    tensors, layouts = primitive_inputs()
    out = {}
    for mesh_shape in PRIMITIVE_MESHES:
        impl = mtf.SpmdMeshImpl(mesh_shape, "")
        for dtype, full in tensors.items():
            for lay in layouts[mesh_shape]:
                x = impl.import_full(full, _layout(lay))
                for name, value in primitive_calls(impl, x, lay):
                    out[(mesh_shape, dtype, lay, name)] = impl.local_slices(value)[0] if name != "export" else value
    return out


def leader_barrier_worker(wait_s: float = 0.3):
    """``MeshImpl.is_leader`` and ``barrier`` on SpmdMeshImpl: rank r sleeps ``r * wait_s`` before the
    barrier; returns ``(rank, is_leader, time entering the barrier, time leaving it)``."""
    impl = mtf.SpmdMeshImpl("all:4", "")
    time.sleep(impl.rank * wait_s)
    entered = time.time()
    impl.barrier()
    return impl.rank, impl.is_leader(), entered, time.time()


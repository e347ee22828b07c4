"""Cases of tests/test_flight_recorder.py, importable inside the gloo processes (run_spmd workers).

Each case trains a small graph a few steps and compares the collectives the mesh implementation
recorded executing with those planned (``meshtorch.testing.collectives.executed_vs_planned``).
"""

from __future__ import annotations

import torch

import meshtorch as mtf
from _fsdp import BUCKET_BYTES, build, data
from _program_data import batch, mlp_step
from meshtorch.mesh.recorder import flight_recorder
from meshtorch.testing.collectives import executed_vs_planned

RUNS = 3
# name -> (graph, mesh shape, compute rules, storage rules, bucket bytes, prefetch, mode)
CASES = {
    "dp": ("mlp", "all:4", "batch:all", "", 0, 1, "codegen"),
    "dp_buckets": ("mlp", "all:4", "batch:all", "", 1 << 20, 1, "interpret"),
    "tp": ("mlp", "rows:2;cols:2", "batch:rows;hidden:cols", "", 0, 1, "codegen"),
    "fsdp": ("lm", "data:4", "batch:data", "d_model:data", 0, 1, "codegen"),
    "fsdp_buckets_prefetch": ("lm", "data:4", "batch:data", "d_model:data", BUCKET_BYTES, 1, "codegen"),
    "fsdp_tp_buckets_prefetch2": ("lm", "data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model",
                                  "d_model:data", BUCKET_BYTES, 2, "codegen"),
    "fsdp_tp_compiled": ("mlp", "rows:2;cols:2", "batch:rows;hidden:cols", "io:rows", 1 << 20, 1, "compile"),
    "fsdp2": ("mlp", "rows:2", "batch:rows", "io:rows", 0, 1, "codegen"),  # 2 ranks: the strategy mutations
}


def _graph(kind):
    """(graph, mesh, fetches, feeds(step))."""
    if kind == "mlp":
        g, mesh, x, _, loss, _, updates = mlp_step()
        return g, mesh, [loss] + updates, lambda s: {x: batch(s)}
    lm, _, _, updates = build("adamw_clip")

    def feeds(s):
        xs, ys = data(s)
        return {lm.inputs: xs, lm.targets: ys}
    return lm.graph, lm.mesh, [lm.loss] + updates, feeds


def run_case(name: str, make_impl) -> dict:
    """Run case ``name`` with ``make_impl(mesh shape, rules, storage=..., prefetch=...)``: a dict with
    ``diff`` (executed vs planned), ``losses``, ``calls`` (recorded calls made by program steps),
    ``bucket_calls``, ``planned`` (planned collectives of all runs), ``kinds`` (executed kinds),
    ``timed`` (every backend record has a time), ``sources`` and ``ranks`` of the records."""
    graph, mesh_shape, rules, storage, bucket_bytes, prefetch, mode = CASES[name]
    g, mesh, fetches, feeds = _graph(graph)
    impl = make_impl(mesh_shape, rules, storage=storage, prefetch=prefetch)
    lw = mtf.Lowering(g, {mesh: impl}, bucket_bytes=bucket_bytes, mode=mode)
    rec = flight_recorder()
    rec.clear()
    diff, results = executed_vs_planned(lw, fetches, feeds, RUNS)
    records = [r for r in rec.records() if r.tag]
    return {"diff": diff, "losses": [float(r[0]) for r in results], "calls": len(records),
            "bucket_calls": sum(r.members is not None for r in records),
            "planned": lw.plan_counters(fetches).count() * RUNS, "executed": lw.counters.count(),
            "runs_from_plan": lw.counters.runs_from_plan, "summary": lw.counters.summary(),
            "kinds": sorted({r.kind for r in records}), "timed": all(r.seconds is not None for r in records
                                                                     if r.source == "backend"),
            "sources": sorted({r.source for r in records}), "ranks": sorted({r.rank for r in records})}


def allreduce_then_slice(self, x, mesh_axis, scatter_axis):
    """The mutation: a reduce-scatter computed as an all-reduce plus a local slice (same numbers,
    n times the bytes): what the flight recorder must expose."""
    summed = self.allreduce(x, [mesh_axis])
    n = self.shape[mesh_axis].size
    if isinstance(summed, list):  # placement: every processor's slice
        return [torch.chunk(summed[p], n, dim=scatter_axis)[self.pnum_to_processor_coordinates(p)[mesh_axis]]
                for p in range(self.size)]
    return torch.chunk(self.local_slices(summed)[0], n, dim=scatter_axis)[self.coords[mesh_axis]].contiguous()


def allreduce_then_slice_many(self, *xs, mesh_axis, scatter_axes):
    """The mutation for bucketed reduce-scatters."""
    return tuple(allreduce_then_slice(self, x, mesh_axis, a) for x, a in zip(xs, scatter_axes, strict=True))


def strategy_reduce_scatter_as_allreduce(self, rows, n, group, parts=None):
    """The mutation one layer down, in the SPMD strategy (:class:`~meshtorch.mesh.spmd_strategy.EagerCollectives`):
    the reduce-scatter's process-group call replaced by an all-reduce of every row plus this member's slice."""
    import torch.distributed as dist
    work, out = self.all_reduce(rows, "SUM", group, owned=False)
    if work is not None:
        work.wait()
    s = rows.shape[0] // n
    c = group.ranks.index(dist.get_rank())
    return None, out[c * s:(c + 1) * s]


def strategy_reduce_scatter_unrecorded(self, rows, n, group, parts=None):
    """The mutation that calls ``torch.distributed`` past the recorder: the right collective, no record."""
    import torch.distributed as dist
    out = torch.empty((rows.shape[0] // n, *rows.shape[1:]), dtype=rows.dtype)
    dist.reduce_scatter_tensor(out, rows, group=group.process_group)
    return None, out


def strategy_mutation_worker():
    """Inside a gloo rank (2 ranks): case ``fsdp2`` as is, with the strategy's reduce-scatter made an all-reduce
    plus a slice, and with it called past the recorder: ``{"plain"|"allreduce"|"unrecorded": run_case(...)}``."""
    from meshtorch.mesh.spmd_strategy import EagerCollectives

    def make(mesh_shape, rules, storage, prefetch):
        return mtf.SpmdMeshImpl(mesh_shape, rules, storage=storage, prefetch=prefetch, async_collectives=False)
    out = {"plain": run_case("fsdp2", make)}
    inner = EagerCollectives.reduce_scatter
    try:
        for name, mutation in (("allreduce", strategy_reduce_scatter_as_allreduce),
                               ("unrecorded", strategy_reduce_scatter_unrecorded)):
            EagerCollectives.reduce_scatter = mutation
            out[name] = run_case("fsdp2", make)
    finally:
        EagerCollectives.reduce_scatter = inner
    return out


def primitive_records(impl) -> dict:
    """``{kind: (recorded kind, mesh axes, parts)}`` of one call of each primitive on ``impl`` along
    axis 0 (8x4 float32 slices, rank-dependent values)."""
    n = impl.shape[0].size
    x = impl.from_local_slices([torch.full((8, 4), float(p)) for p in impl.local_pnums()])
    calls = {"allreduce": lambda: impl.allreduce(x, [0]), "allgather": lambda: impl.all_gather(x, 0, 1),
             "reduce_scatter": lambda: impl.reduce_scatter(x, 0, 0), "alltoall": lambda: impl.alltoall(x, 0, 0, 1),
             "collective_permute": lambda: impl.collective_permute(x, 0, [(c + 1) % n for c in range(n)]),
             "broadcast": lambda: impl.broadcast(x, 0, n - 1)}
    out = {}
    for kind, call in calls.items():
        impl.local_slices(call())  # wait for it
        r = flight_recorder().records(last=1)[0]
        out[kind] = (r.kind, r.mesh_axes, r.parts, r.seconds is not None)
    return out


def spmd_worker(names, mutate: bool = False):
    """Inside a gloo rank: ``{name: run_case(name, SpmdMeshImpl)}`` (asynchronous collectives for the
    FSDP cases); with ``mutate``, ``SpmdMeshImpl.reduce_scatter`` is the all-reduce-then-slice mutation."""
    if mutate:
        mtf.SpmdMeshImpl.reduce_scatter = allreduce_then_slice

    def make(mesh_shape, rules, storage, prefetch):
        return mtf.SpmdMeshImpl(mesh_shape, rules, storage=storage, prefetch=prefetch,
                                async_collectives=bool(storage))
    out = {name: run_case(name, make) for name in names}
    out["primitives"] = primitive_records(mtf.SpmdMeshImpl("all:4", "", async_collectives=True))
    return out

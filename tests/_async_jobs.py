"""Jobs of tests/test_async_default.py, importable inside the gloo processes (run_spmd workers)."""

from __future__ import annotations

import torch

import meshtorch as mtf
from meshtorch.mesh.recorder import flight_recorder

MIB = 2 ** 20


def _rank_tensor(impl, numel: int) -> object:
    """A laid-out value: this rank's slice ``[numel]`` float32, values depending on the rank."""
    g = torch.Generator().manual_seed(impl.rank)
    return impl.from_local_slices([torch.randn(numel, generator=g)])


def default_cpu_policy(async_collectives=None) -> dict:
    """On 2 gloo ranks, with ``SpmdMeshImpl(async_collectives=...)``: for each call, whether the flight
    recorder saw it asynchronous, and its result next to the same sum computed from every rank's tensor
    (gathered with plain ``torch.distributed``)."""
    impl = mtf.SpmdMeshImpl("all:2", "", async_collectives=async_collectives)
    big, small = MIB // 4 + 8, 1024  # float32 elements: just over 1 MiB, and 4 KiB
    calls = {
        "allreduce_big": lambda: impl.allreduce(_rank_tensor(impl, big), [0]),
        "allreduce_small": lambda: impl.allreduce(_rank_tensor(impl, small), [0]),
        # a bucket of two small members that together pass 1 MiB, and one that does not
        "bucket_big": lambda: impl.allreduce_many(_rank_tensor(impl, big // 2), _rank_tensor(impl, big // 2 + 8),
                                                  mesh_axes=[0])[1],
        "bucket_small": lambda: impl.allreduce_many(_rank_tensor(impl, small), _rank_tensor(impl, small),
                                                    mesh_axes=[0])[1],
        "allgather_big": lambda: impl.all_gather(_rank_tensor(impl, big), 0, 0),
        "reduce_scatter_big": lambda: impl.reduce_scatter(_rank_tensor(impl, 2 * big), 0, 0),
    }
    rec = flight_recorder()
    out = {"repr": repr(impl.collectives)}
    for name, call in calls.items():
        rec.clear()
        got = impl.local_slices(call())[0]
        out[name] = {"async": [r.asynchronous for r in rec.records()], "value": got}
    # the references, from the same generators
    world = impl.world_size
    full = {n: [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
            for n in (big, small, big // 2 + 8, 2 * big)}
    out["ref"] = {
        "allreduce_big": sum(full[big]), "allreduce_small": sum(full[small]),
        "bucket_big": sum(full[big // 2 + 8]), "bucket_small": sum(full[small]),
        "allgather_big": torch.cat(full[big]),
        "reduce_scatter_big": sum(full[2 * big]).chunk(world)[impl.rank],
    }
    return out

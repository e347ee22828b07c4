"""Jobs of tests/test_bucket_packing.py, importable inside the gloo processes (run_spmd workers)."""

from __future__ import annotations

import torch

import meshtorch as mtf

SHAPES = [(4, 6), (3, 8, 2), (2, 3, 4)]  # members of one bucket
AXES = [0, 1, 2]  # the scatter / concat axis of each member (a multiple of the 2 ranks on that axis)


def member(rank: int, k: int) -> torch.Tensor:
    return torch.randn(*SHAPES[k], generator=torch.Generator().manual_seed(100 * rank + k))


def bucket_job() -> dict:
    """On 2 gloo ranks: one bucketed reduce-scatter and one bucketed all-gather of members scattered /
    concatenated on different axes; this rank's results."""
    impl = mtf.SpmdMeshImpl("all:2", "", async_collectives=False)
    xs = [impl.from_local_slices([member(impl.rank, k)]) for k in range(len(SHAPES))]
    scattered = impl.reduce_scatter_many(*xs, mesh_axis=0, scatter_axes=tuple(AXES))
    gathered = impl.all_gather_many(*xs, mesh_axis=0, concat_axes=tuple(AXES))
    return {"rank": impl.rank, "scattered": [impl.local_slices(t)[0] for t in scattered],
            "gathered": [impl.local_slices(t)[0] for t in gathered]}

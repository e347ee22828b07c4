"""Gloo-rank jobs of test_executors.py (run by ``meshtorch.testing.spmd.run_spmd``)."""

from __future__ import annotations


def spmd_compiled_cases(steps: int, mesh_shape: str, layout: str, storage: str, bucket_sizes: list[int],
                        backend: str):
    """Inside a gloo rank: :func:`_program_data.spmd_compiled_worker` once per bucket size, in one process (one
    process start for all cases); dynamo's caches are reset before each case, as in a fresh process."""
    import torch._dynamo

    from _program_data import spmd_compiled_worker

    out = []
    for bucket_bytes in bucket_sizes:
        torch._dynamo.reset()
        out.append(spmd_compiled_worker(steps, mesh_shape, layout, storage, bucket_bytes, backend))
    return out


def gloo_jobs(compiled_args: tuple, bucket_args: tuple):
    """Both gloo jobs of test_executors.py in one start of the ranks: ``(spmd_compiled_cases(*compiled_args),
    _program_data.spmd_bucket_worker(*bucket_args))``; the bucket worker (not compiled) runs first."""
    from _program_data import spmd_bucket_worker

    bucket = spmd_bucket_worker(*bucket_args)
    return spmd_compiled_cases(*compiled_args), bucket

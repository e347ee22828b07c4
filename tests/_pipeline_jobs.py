"""Gloo-rank jobs of test_pipeline.py (run by ``meshtorch.testing.spmd.run_spmd``)."""

from __future__ import annotations


def pipeline_and_parameter_bytes_worker(parameter_cases):
    """Inside a gloo rank: :func:`_spmd_pipeline.pipeline_worker` and :func:`_spmd_pipeline.parameter_bytes_worker`
    in one process, so two tests share one start of the 4 ranks."""
    import _spmd_pipeline as W

    return W.pipeline_worker(), W.parameter_bytes_worker(parameter_cases)

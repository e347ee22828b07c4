"""Bucketed reduce-scatters and all-gathers on 2 gloo ranks pack members split on any axis into one flat
call (``meshtorch.mesh.spmd``): each member's result equals the sum (or concatenation) of the two ranks'
tensors computed with plain torch, sliced on its own axis."""

from __future__ import annotations

import os

import torch

from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def test_bucket_members_on_different_axes():
    import sys
    sys.path.insert(0, TESTS_DIR)
    from _bucket_jobs import AXES, SHAPES, member

    results = run_spmd("_bucket_jobs:bucket_job", nprocs=2, timeout_s=300, extra_path=[TESTS_DIR]).check().results
    for res in results:
        r = res["rank"]
        for k in range(len(SHAPES)):
            total = member(0, k) + member(1, k)
            torch.testing.assert_close(res["scattered"][k], total.chunk(2, dim=AXES[k])[r], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(res["gathered"][k], torch.cat([member(0, k), member(1, k)], dim=AXES[k]))

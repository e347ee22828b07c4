"""The ported Mesh TF Unitransformer as 4 gloo processes (SpmdMeshImpl) vs one process on the simulated mesh:
same logits, loss, gradients, Adafactor step losses and greedy while-loop decoding."""

from __future__ import annotations

import os

import _spmd_transformer as W
from meshtorch.testing import rel_error
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def test_transformer_on_spmd_equals_placement():
    run = run_spmd("_spmd_transformer:lm_worker", nprocs=4, timeout_s=180, extra_path=[TESTS_DIR]).check()
    ref_out, ref_steps, ref_tokens = W.placement_reference()
    for rank, (out, steps, tokens) in enumerate(run.results):
        assert len(out) == len(ref_out)
        for i, (a, b) in enumerate(zip(out, ref_out, strict=True)):
            assert rel_error(a, b) <= 1e-5, (rank, i)
        assert max(abs(a - b) / abs(b) for a, b in zip(steps, ref_steps, strict=True)) <= 1e-5, (rank, steps)
        assert (tokens == ref_tokens).all(), rank

"""The SPMD mesh's CPU default for asynchronous collectives: all-reduces (single or bucketed) of at least
1 MiB per processor start asynchronously, everything else blocks; results equal plain sums either way."""

from __future__ import annotations

import os

import pytest
import torch

from meshtorch.mesh.spmd_strategy import EagerCollectives
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CALLS = ["allreduce_big", "allreduce_small", "bucket_big", "bucket_small", "allgather_big", "reduce_scatter_big"]


@pytest.fixture(scope="module")
def jobs(once_per_run):
    """{async_collectives setting: per-rank results}: the three settings one after another in one 2-rank job."""
    settings = (None, True, False)

    def run():
        tasks = [("_async_jobs:default_cpu_policy", (a,)) for a in settings]
        results = run_spmd("meshtorch.testing.spmd:run_tasks", args=(tasks,), nprocs=2, timeout_s=300,
                           extra_path=[TESTS_DIR]).check().results
        return {a: [per_rank[i] for per_rank in results] for i, a in enumerate(settings)}

    return once_per_run("test_async_default", run)


@pytest.mark.parametrize("setting, expected", [
    (None, {"allreduce_big": True, "allreduce_small": False, "bucket_big": True, "bucket_small": False,
            "allgather_big": False, "reduce_scatter_big": False}),
    (True, dict.fromkeys(CALLS, True)),
    (False, dict.fromkeys(CALLS, False)),
])
def test_which_calls_start_asynchronously_and_their_values(jobs, setting, expected):
    for res in jobs[setting]:
        for name in CALLS:
            assert res[name]["async"] == [expected[name]], (setting, name, res[name]["async"])
            torch.testing.assert_close(res[name]["value"], res["ref"][name], rtol=1e-6, atol=1e-6)


def test_default_policy_is_named_in_the_repr(jobs):
    assert jobs[None][0]["repr"] == "EagerCollectives(asynchronous=False, async_all_reduce_min_bytes=1048576)"
    assert jobs[False][0]["repr"] == "EagerCollectives(asynchronous=False)"


def test_rule_boundaries_and_bad_threshold():
    c = EagerCollectives(False, async_all_reduce_min_bytes=100)
    assert c.is_async("allreduce", 100) and not c.is_async("allreduce", 99)
    assert not c.is_async("allgather", 10 ** 9) and not c.is_async("reduce_scatter", 10 ** 9)
    assert EagerCollectives(True).is_async("allgather", 1)
    assert not EagerCollectives(False).is_async("allreduce", 10 ** 9)
    with pytest.raises(ValueError, match="async_all_reduce_min_bytes"):
        EagerCollectives(False, async_all_reduce_min_bytes=-1)

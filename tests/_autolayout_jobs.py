"""Rank bodies for tests/test_layout_auto.py's torchrun case (run by meshtorch.testing.spmd.run_spmd)."""

import itertools
import json
import os

import torch.distributed as dist

from meshtorch.models.transformer import preset
from meshtorch.runtime import autolayout
from meshtorch.runtime import calibrate as cal_mod


def _setup(cache_dir, times_by_rank):
    """This rank's cached gloo calibration (fixed numbers) and fake candidates: the i-th measured candidate's
    timed steps take ``times_by_rank[rank][i]`` s (a list: step after step, cycling; 1 s beyond the list).
    Returns (the rank, the measured candidates' layouts, their steps' seconds as this rank timed them)."""
    os.environ["MESHTORCH_CACHE_DIR"] = cache_dir
    rank = int(os.environ["RANK"])
    cal = cal_mod.Calibration(host=cal_mod._host_key(), backend="gloo", threads=1, gemm_flop_rate=5e10,
                              kernel_overhead=5e-6, memory_bandwidth=1e10,
                              collectives={k: [1e-5, 1e-10] for k in cal_mod.KINDS},
                              version=cal_mod.CALIBRATION_VERSION)
    path = cal_mod.cache_path("gloo", 1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.{rank}", "w") as f:
        json.dump(cal.__dict__, f)
    os.replace(f"{path}.{rank}", path)
    calls, steps = [], []

    def prepare(config, mesh_shape, c, **kw):
        calls.append(c.layout)
        t = times_by_rank[rank][len(calls) - 1] if len(calls) <= len(times_by_rank[rank]) else 1.0
        cycle, took = itertools.cycle(t if isinstance(t, list) else [t]), []
        steps.append(took)
        return lambda: took.append(next(cycle)) or took[-1]

    autolayout.prepare_candidate = prepare
    return rank, calls, steps


def _config(multiple):
    return preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                  vocab_size=256, vocab_multiple=multiple)


def agree(cache_dir, times_by_rank):
    """``choose_layout`` on mesh all:2 over 2 gloo ranks whose measured times differ (``times_by_rank[rank][i]``
    for the i-th measured candidate), twice; returns this rank's (chosen layout, measured layouts) per call."""
    _, calls, _ = _setup(cache_dir, times_by_rank)
    out = []
    for _ in range(2):
        n = len(calls)
        layout = autolayout.choose_layout(_config, "all:2", backend="gloo", threads=1, world=2,
                                          print_fn=lambda *a: None)[0]
        out.append((layout, calls[n:]))
    dist.destroy_process_group()
    return out


def decide_alike(cache_dir, cases):
    """``choose_layout`` on mesh all:2 over 2 gloo ranks (not cached), once per case of ``cases`` (each a
    ``times_by_rank``, in one process group); returns per case this rank's (chosen layout, measured layouts,
    the seconds of each measured candidate's steps as this rank timed them, the printed lines)."""
    out = []
    for times_by_rank in cases:
        _, calls, steps = _setup(cache_dir, times_by_rank)
        said = []
        layout = autolayout.choose_layout(_config, "all:2", backend="gloo", threads=1, world=2, cache=False,
                                          print_fn=said.append)[0]
        out.append((layout, calls, steps, said))
    dist.destroy_process_group()
    return out

"""Rank bodies for tests/test_layout_auto.py's torchrun case (run by meshtorch.testing.spmd.run_spmd)."""

import json
import os

import torch.distributed as dist

from meshtorch.models.transformer import preset
from meshtorch.runtime import autolayout
from meshtorch.runtime import calibrate as cal_mod


def agree(cache_dir, times_by_rank):
    """``choose_layout`` on mesh all:2 over 2 gloo ranks whose measured times differ (``times_by_rank[rank][i]``
    for the i-th measured candidate), twice; returns this rank's (chosen layout, measured layouts) per call."""
    os.environ["MESHTORCH_CACHE_DIR"] = cache_dir
    rank = int(os.environ["RANK"])
    cal = cal_mod.Calibration(host=cal_mod._host_key(), backend="gloo", threads=1, gemm_flop_rate=5e10,
                              kernel_overhead=5e-6, memory_bandwidth=1e10,
                              collectives={k: [1e-5, 1e-10] for k in cal_mod.KINDS}, version=cal_mod.CALIBRATION_VERSION)
    path = cal_mod.cache_path("gloo", 1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.{rank}", "w") as f:
        json.dump(cal.__dict__, f)
    os.replace(f"{path}.{rank}", path)
    calls = []

    def prepare(config, mesh_shape, c, **kw):
        calls.append(c.layout)
        t = times_by_rank[rank][len(calls) - 1] if len(calls) <= len(times_by_rank[rank]) else 1.0
        return lambda: t

    autolayout.prepare_candidate = prepare

    def config(multiple):
        return preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                      vocab_size=256, vocab_multiple=multiple)
    out = []
    for _ in range(2):
        n = len(calls)
        layout = autolayout.choose_layout(config, "all:2", backend="gloo", threads=1, world=2,
                                          print_fn=lambda *a: None)[0]
        out.append((layout, calls[n:]))
    dist.destroy_process_group()
    return out

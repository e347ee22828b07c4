"""A cached placement calibration with fixed numbers (tests of the layout search: nothing is measured)."""

from __future__ import annotations

import json
import os

from meshtorch.runtime import calibrate as cal_mod


def write_fixed_calibration(cache_dir, monkeypatch):
    """Point ``MESHTORCH_CACHE_DIR`` at ``cache_dir`` and cache a placement calibration there (50 GFLOP/s, 5 us per
    kernel call, 10 GB/s, collectives 10 us + 0.1 ns/B); measuring a GEMM afterwards fails the test. Returns it."""
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(cache_dir))
    cal = cal_mod.Calibration(host=cal_mod._host_key(), backend="placement", threads=1, gemm_flop_rate=5e10,
                              kernel_overhead=5e-6, memory_bandwidth=1e10,
                              collectives={k: [1e-5, 1e-10] for k in cal_mod.KINDS},
                              version=cal_mod.CALIBRATION_VERSION)
    path = cal_mod.cache_path("placement", 1)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(cal.__dict__, f)
    monkeypatch.setattr(cal_mod, "_gemm_rate", lambda *a: (_ for _ in ()).throw(AssertionError("measured")))
    return cal

"""One line naming the machine a benchmark ran on, printed with its results.

Ratios against Mesh TF or plain PyTorch depend on the host's CPU: on the Intel Xeon of 2026-11-23
torch.mm reached 165-200 GFLOP/s per core, on the AMD EPYC (Zen 4) of 2026-11-24 evening 85-100
(docs/performance.md), so every table names the CPU it was measured on.
"""

from __future__ import annotations

import os
import platform
import time

import torch


def describe() -> str:
    """``cpu: <model name> (family F model M), N cores; torch V`` from ``/proc/cpuinfo`` (Linux) or
    ``platform.processor()`` elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    family = f" (family {fields['cpu family']} model {fields['model']})" if "cpu family" in fields else ""
    return f"cpu: {name}{family}, {os.cpu_count()} cores; torch {torch.__version__}"


def mm_times(m: int, k: int, n: int, repeats: int) -> list[float]:
    """Seconds of ``repeats`` float32 ``torch.mm`` calls of an ``[m, k] x [k, n]`` product (after one warm-up
    call); the GEMM rate is ``2 m k n / t``."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        ts.append(time.perf_counter() - t0)
    return ts

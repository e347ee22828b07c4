"""Training metrics: an honest MFU denominator and the ``--log-dir`` writers (TensorBoard, ``metrics.jsonl``).

MFU (PaLM appendix B) = achieved model FLOP/s / peak FLOP/s of the hardware the job really has. The
peak is a float32 matmul loop measured once per process with its torch threads (the best of several
rounds: a busy host only ever slows a round down), scaled to the share of the host's cores that
process gets when ``LOCAL_WORLD_SIZE`` processes share them (torchrun / ``meshtorch launch``), times
the number of processes in the job. A simulated mesh is one process. ``meshtorch train --peak-tflops``
gives the peak instead. A measured peak is a lower bound of the true one, and so is any achieved
rate: :func:`mfu` divides by the larger of the two, so it never exceeds 100%.
"""

from __future__ import annotations

import json
import os
import time

import torch

from meshtorch.runtime.optional import optional_module


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure_peak_flops(seconds: float = 1.0, n: int | None = None, rounds: int = 8, device=None) -> float:
    """FLOP/s of a float32 ``n x n`` matmul loop on ``device`` (default the CPU, with this process's torch
    threads; ``n`` 512 there, 4096 on a GPU, synchronised per round): the maximum over ``rounds`` rounds of
    ``seconds / rounds`` each (other work on the host only lowers a round's rate, so the maximum is the
    stable estimate)."""
    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    n = n or (4096 if cuda else 512)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    torch.mm(a, b, out=out)
    best = 0.0
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize(device)
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / rounds:
            torch.mm(a, b, out=out)
            count += 1
            if cuda:
                torch.cuda.synchronize(device)
        best = max(best, 2 * n ** 3 * count / (time.perf_counter() - t0))
    return best


def mfu(model_flops_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1]: ``model_flops_per_s / max(peak_flops, model_flops_per_s)``.

    Both a measured peak and an achieved rate are lower bounds of the hardware's true peak, so the
    larger is the denominator: a peak measured while the host was busy never yields an MFU over 100%.

    Raises:
        ValueError: if ``peak_flops`` is not > 0.
    """
    if not peak_flops > 0:
        raise ValueError(f"mfu: the peak FLOP/s must be > 0, got {peak_flops}.")
    return max(0.0, model_flops_per_s) / max(peak_flops, model_flops_per_s)


def job_peak_flops(measured: float, threads: int, local_processes: int, processes: int) -> float:
    """Peak FLOP/s of the whole job.

    Args:
        measured: :func:`measure_peak_flops` of one process running ``threads`` torch threads.
        threads: this process's torch threads.
        local_processes: processes sharing this host's cores (``LOCAL_WORLD_SIZE``).
        processes: processes in the job (``WORLD_SIZE``).

    Each process's share is ``min(threads, cores / local_processes)`` cores, so 4 processes on 2 cores
    each count half a core, not one.
    """
    share = min(float(threads), available_cores() / max(local_processes, 1))
    return measured * share / max(threads, 1) * processes


class MetricsLog:
    """``--log-dir`` writers: TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``, needs the
    ``tensorboard`` package) and ``metrics.jsonl`` (one JSON object per line: ``step`` and the scalars).

    Raises:
        MeshtorchError: if ``tensorboard`` is not installed (``pip install 'meshtorch[cli]'``).
    """

    def __init__(self, log_dir: str, config: dict | None = None):
        optional_module("tensorboard", "meshtorch train --log-dir")  # names the package if it is missing
        tb = optional_module("torch.utils.tensorboard", "meshtorch train --log-dir")
        os.makedirs(log_dir, exist_ok=True)
        self.writer = tb.SummaryWriter(log_dir)
        self.jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a")
        if config:
            self.writer.add_text("config", json.dumps(config, indent=1, default=str))

    def log(self, step: int, **scalars) -> None:
        """Write the finite scalars (e.g. ``loss=2.3``) at ``step``."""
        row = {"step": step}
        for k, v in scalars.items():
            if v is None:
                continue
            self.writer.add_scalar(k, float(v), step)
            row[k] = float(v)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()

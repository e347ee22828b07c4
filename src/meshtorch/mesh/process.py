"""Process groups of a multi-process job (one process per processor, torchrun or ``meshtorch launch``).

- :func:`init_distributed` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``) and initializes the default process group (gloo on CPU, NCCL on
  GPU) with a bounded timeout, and starts the failure watchdog (:mod:`meshtorch.mesh.watchdog`).
- :func:`shutdown_distributed` (registered at exit) leaves together and destroys the groups.

Failure behaviour (no silent hang): a rank that raises is reported to the others by the watchdog;
a rank that dies without raising (killed) closes its sockets, so its peers' next collective raises at
once; a rank that hangs makes its peers' collectives time out after ``timeout_s`` (default 60 s,
env ``MESHTORCH_TIMEOUT``). ``meshtorch launch`` (and torchrun) also stop the remaining ranks when
one exits non-zero.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtorch.mesh.watchdog import failure_recorded, start_watchdog, stop_watchdog


def default_timeout_s() -> float:
    """``MESHTORCH_TIMEOUT`` (seconds), else 60; read when used, not at import (a process forked from a fork
    server that imported meshtorch has its own)."""
    return float(os.environ.get("MESHTORCH_TIMEOUT", "60"))


_ON_SHUTDOWN: list[Callable[[], None]] = []


def on_shutdown(fn: Callable[[], None]) -> None:
    """Call ``fn()`` in :func:`shutdown_distributed` before the process groups are destroyed
    (e.g. to drop caches of process groups)."""
    _ON_SHUTDOWN.append(fn)


def init_distributed(timeout_s: float | None = None, backend: str | None = None, watchdog: bool = True) -> int:
    """Initialize ``torch.distributed`` from torchrun's environment; returns this process's rank.

    Args:
        timeout_s: collective / rendezvous timeout in seconds (default ``MESHTORCH_TIMEOUT`` or 60).
        backend: ``"gloo"``/``"nccl"``; default NCCL if CUDA is available, else gloo.
        watchdog: start the failure watchdog (see the module docstring).

    Raises:
        RuntimeError: if ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` are missing (not run
            under torchrun or ``meshtorch launch``).

    Does nothing (but return the rank) if the default process group already exists. Source:
    ``torch.distributed.init_process_group`` (env:// rendezvous), torchrun's environment contract.
    """
    if dist.is_initialized():
        return dist.get_rank()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed: environment variables {missing} are not set; run under "
                           "`torchrun --nproc-per-node N ...` or `meshtorch launch -n N -- ...`.")
    timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend=backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s),
                            **kwargs)
    if watchdog:
        start_watchdog()
    atexit.register(shutdown_distributed)
    return dist.get_rank()


def shutdown_distributed() -> None:
    """Stop the watchdog and destroy the process groups (registered at exit by :func:`init_distributed`).

    Unless some rank recorded a failure, the ranks first meet at a barrier (gloo: ``monitored_barrier``,
    at most 30 s) so that none tears down its connections while a peer is still inside the last
    collective. Then every reference meshtorch holds to a group is dropped (the :func:`on_shutdown`
    hooks) and the groups are destroyed and collected here, while the interpreter is alive:
    ``destroy_process_group`` alone leaves a gloo group's worker threads running while anything still
    references it, and a worker that drops its last tensor after the interpreter started finalizing
    cannot take the GIL and aborts the process ("terminate called without an active exception",
    status -6, seen on loaded hosts). Groups the user's own code still references live on, and so do
    those of a plan compiled on the SPMD mesh (``mode="compile"``: torch's compile state keeps them).
    """
    stop_watchdog()
    if dist.is_initialized() and not failure_recorded():  # all ranks leave together
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=min(30.0, default_timeout_s())))
            else:
                dist.barrier()
        except Exception:  # noqa: BLE001 - a peer is gone: nothing to wait for
            pass
    for fn in _ON_SHUTDOWN:
        fn()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    gc.collect()  # unreferenced groups (and their worker threads) end now, not during finalization


def is_main_process() -> bool:
    """True on rank 0, or when not distributed (print and save only there)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` (any picklable value) on every rank of the job (``dist.broadcast_object_list``);
    ``obj`` itself when not distributed."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise maximum of the host floats ``values`` over the ranks of the job (an all-reduce MAX of a
    float64 tensor, on the rank's GPU under NCCL); ``values`` itself when not distributed."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()

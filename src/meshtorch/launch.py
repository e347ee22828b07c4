"""Running meshtorch programs as one process per processor (torchrun or ``meshtorch launch``).

- :func:`init_distributed` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``) and initializes the default process group (gloo on CPU, NCCL on
  GPU) with a bounded timeout, and starts the failure watchdog (below).
- :func:`make_mesh_impl` returns an :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` under torchrun
  (``WORLD_SIZE`` > 1) and a :class:`~meshtorch.mesh.placement.PlacementMeshImpl` otherwise, so one
  program runs either way.
- ``meshtorch launch -n N -- <command...>`` (:func:`main_launch`) starts N local processes with
  torchrun's environment variables, like ``torchrun --standalone --nproc-per-node N``.

Failure behaviour (no silent hang): when a rank raises, its uncaught exception is recorded in the
process group's key-value store ("rank R: <exception>"); a watchdog thread in every other rank polls
that key (every 0.25 s) and exits the process with status 1 (2 s later, so that the failed rank
exits first and launchers name it) and a message naming the failed rank and the cause. A rank
that dies without raising (killed) closes its sockets, so its peers' next collective raises at
once; a rank that hangs makes its peers' collectives time out after ``timeout_s`` (default 60 s,
env ``MESHTORCH_TIMEOUT``). ``meshtorch launch`` (and torchrun) also stop the remaining ranks when
one exits non-zero.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

FAILED_KEY = "meshtorch/failed"
DEFAULT_TIMEOUT_S = float(os.environ.get("MESHTORCH_TIMEOUT", "60"))
_watchdog: _Watchdog | None = None


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
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
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

    Without it gloo's threads may abort the interpreter at exit ("terminate called without an
    active exception", status -6). Unless some rank recorded a failure, the ranks first meet at a
    barrier (gloo: ``monitored_barrier``, at most 30 s) so that none tears down its connections
    while a peer is still inside the last collective.
    """
    from meshtorch.mesh import spmd

    stop_watchdog()
    spmd._GROUPS.clear()
    if not dist.is_initialized():
        return
    if not _failure_recorded():  # all ranks leave together, so none tears down mid-collective
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=min(30.0, DEFAULT_TIMEOUT_S)))
            else:
                dist.barrier()
        except Exception:  # noqa: BLE001 - a peer is gone: nothing to wait for
            pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def _failure_recorded() -> bool:
    store = _store()
    if store is None:
        return False
    try:
        return bool(store.check([FAILED_KEY]))
    except Exception:  # noqa: BLE001 - store gone: treat as failed, do not wait
        return True


def make_mesh_impl(mesh_shape, layout, device=None):
    """The mesh implementation for how this process was started.

    Under torchrun / ``meshtorch launch`` (``WORLD_SIZE`` > 1): initializes ``torch.distributed`` if
    needed and returns ``SpmdMeshImpl(mesh_shape, layout, device)`` (the mesh size must equal the
    world size). Otherwise a ``PlacementMeshImpl(mesh_shape, layout)`` simulating the mesh in this
    one process (``device``, if given, holds every processor's slices).
    """
    from meshtorch.mesh.placement import PlacementMeshImpl
    from meshtorch.mesh.spmd import SpmdMeshImpl

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
        init_distributed()
        return SpmdMeshImpl(mesh_shape, layout, device=device)
    impl = PlacementMeshImpl(mesh_shape, layout)
    if device is not None:
        impl = PlacementMeshImpl(mesh_shape, layout, devices=[device] * impl.size)
    return impl


def is_main_process() -> bool:
    """True on rank 0, or when not distributed (print and save only there)."""
    return not dist.is_initialized() or dist.get_rank() == 0


# ====================================================================== failure watchdog
def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API; without it we fall back on timeouts
        return None


def report_failure(exc: BaseException | str) -> str | None:
    """Record this rank's failure in the store (first failure wins); returns the first failure's text."""
    store = _store()
    if store is None:
        return None
    rank = dist.get_rank()
    cause = exc if isinstance(exc, str) else "".join(traceback.format_exception_only(type(exc), exc)).strip()
    mine = f"rank {rank} (host {socket.gethostname()}, pid {os.getpid()}): {cause}"[:4000]
    try:
        first = store.compare_set(FAILED_KEY, "", mine)
        return first.decode() if isinstance(first, bytes) else str(first)
    except Exception:  # noqa: BLE001 - the store may be gone already
        return None


class _Watchdog(threading.Thread):
    def __init__(self, store, rank: int, poll_s: float, exit_delay_s: float):
        super().__init__(name="meshtorch-failure-watchdog", daemon=True)
        self.store, self.rank, self.poll_s, self.exit_delay_s = store, rank, poll_s, exit_delay_s
        self.stopped = threading.Event()
        self.reported = False  # this rank recorded its own failure

    def run(self):
        while not self.stopped.wait(self.poll_s):
            try:
                if not self.store.check([FAILED_KEY]):
                    continue
                msg = self.store.get(FAILED_KEY).decode()
            except Exception:  # noqa: BLE001 - store host gone (normal at exit): stop watching
                return
            if self.reported or msg.startswith(f"rank {self.rank} "):
                return
            print(f"meshtorch: rank {self.rank} stopping because {msg}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # exit a little after the failed rank, so that torchrun / meshtorch launch name it as the first failure
            time.sleep(self.exit_delay_s)
            os._exit(1)


def start_watchdog(poll_s: float = 0.25, exit_delay_s: float = 2.0) -> None:
    """Start the failure watchdog thread and the uncaught-exception hook (idempotent).

    The watchdog checks the store every ``poll_s`` seconds; on another rank's failure it prints the
    record and exits with status 1 after ``exit_delay_s`` seconds (so the failed rank exits first).
    """
    global _watchdog
    store = _store()
    if store is None or _watchdog is not None:
        return
    _watchdog = _Watchdog(store, dist.get_rank(), poll_s, exit_delay_s)
    _watchdog.start()
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if _watchdog is None or not dist.is_initialized():
            previous(exc_type, exc, tb)
            return
        _watchdog.reported = True
        first = report_failure(exc)
        previous(exc_type, exc, tb)
        rank = dist.get_rank()
        if first and not first.startswith(f"rank {rank} "):
            print(f"meshtorch: rank {rank} failed (above) after {first}", file=sys.stderr, flush=True)
        else:
            print(f"meshtorch: rank {rank} failed: {first or exc!r}", file=sys.stderr, flush=True)
        time.sleep(2 * poll_s + 0.25)  # let the others read the record before this process (maybe the store host) exits

    sys.excepthook = hook


def stop_watchdog() -> None:
    """Stop watching (call before a deliberate, uneven shutdown)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stopped.set()
        if _watchdog is not threading.current_thread():
            _watchdog.join(timeout=5.0)  # never leave it inside a store call while the store is torn down
        _watchdog = None


# ====================================================================== meshtorch launch
def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(rank: int, nprocs: int, port: int, base=None, timeout_s: float | None = None) -> dict:
    """The environment torchrun gives worker ``rank`` of ``nprocs`` on one host."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    if timeout_s is not None:
        env["MESHTORCH_TIMEOUT"] = str(timeout_s)
    return env


def launch(command: list[str], nprocs: int, timeout_s: float | None = None, grace_s: float = 10.0,
           poll_s: float = 0.1) -> int:
    """Run ``command`` as ``nprocs`` local processes (ranks 0..nprocs-1); returns the job's exit status.

    When a rank exits non-zero the others get ``grace_s`` seconds to stop by themselves (their
    watchdogs usually make them exit within a second), then are terminated (SIGTERM, then SIGKILL).
    A summary naming the first failed rank and its exit status goes to stderr.
    """
    port = free_port()
    procs = [subprocess.Popen(command, env=launch_env(r, nprocs, port, timeout_s=timeout_s))
             for r in range(nprocs)]
    first_fail, fail_time = None, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if first_fail is None:
                for r, c in enumerate(codes):
                    if c not in (None, 0):
                        first_fail, fail_time = (r, c), time.monotonic()
                        break
            if all(c is not None for c in codes):
                break
            if first_fail is not None and time.monotonic() - fail_time > grace_s:
                _terminate(procs)
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _terminate(procs)
        raise
    codes = [p.wait() for p in procs]
    if first_fail is None:
        return 0
    r, c = first_fail
    how = f"signal {signal.Signals(-c).name}" if c < 0 else f"status {c}"
    print(f"meshtorch launch: rank {r} failed first ({how}); exit statuses by rank: {codes}", file=sys.stderr)
    return 1


def _terminate(procs, wait_s: float = 5.0):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def add_launch_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add ``launch`` to a CLI's ``argparse`` subparsers (sets ``func=main_launch_args``)."""
    p = subparsers.add_parser(
        "launch", help="run a command as N local processes (one per mesh processor) like torchrun",
        description="Run COMMAND as N processes on this host with torchrun's environment (RANK, WORLD_SIZE, "
                    "LOCAL_RANK, MASTER_ADDR, MASTER_PORT). A COMMAND that is not an executable is taken as a "
                    "meshtorch subcommand: `meshtorch launch -n 4 -- mnist --mesh all:4` runs "
                    "`python -m meshtorch mnist --mesh all:4`. For several hosts use torchrun (docs/distributed.md).")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of processes (= mesh size)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before a collective that a failed or hung rank never joins raises (default 60)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the other ranks get to exit after one fails before they are terminated")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after `--`")
    p.set_defaults(func=main_launch_args)
    return p


def main_launch_args(args) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("meshtorch launch: give a command after `--`, e.g. "
                         "`meshtorch launch -n 4 -- python train.py`.")
    if args.nproc < 1:
        raise SystemExit(f"meshtorch launch: -n must be >= 1, got {args.nproc}.")
    if os.sep not in command[0] and shutil.which(command[0]) is None:
        command = [sys.executable, "-m", "meshtorch", *command]
    return launch(command, args.nproc, timeout_s=args.timeout, grace_s=args.grace)


def main_launch(argv=None) -> int:
    """``meshtorch launch -n N -- <command...>`` as a function (argv without the word ``launch``)."""
    parser = argparse.ArgumentParser(prog="meshtorch")
    add_launch_subcommand(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["launch", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


add_parser = add_launch_subcommand  # the CLI's per-command hook (meshtorch.cli._COMMANDS)

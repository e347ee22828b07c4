"""``meshtorch launch``'s process spawning: N local processes with torchrun's environment.

Like ``torchrun --standalone --nproc-per-node N``: each process gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; when one rank exits non-zero the others get a grace
period (their failure watchdogs, :mod:`meshtorch.mesh.watchdog`, usually stop them within a second)
and are then terminated.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from meshtorch.core.errors import UsageError
from meshtorch.mesh.watchdog import PEER_FAILED_STATUS


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(rank: int, nprocs: int, port: int, base=None, timeout_s: float | None = None,
               run_name: str | None = None) -> dict:
    """The environment torchrun gives worker ``rank`` of ``nprocs`` on one host, plus ``MESHTORCH_RUN_NAME``
    (``run_name``: the default ``meshtorch train --run-name`` every rank agrees on)."""
    env = dict(os.environ if base is None else base)
    if run_name:
        env.setdefault("MESHTORCH_RUN_NAME", run_name)
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
    run_name = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    procs = [subprocess.Popen(command, env=launch_env(r, nprocs, port, timeout_s=timeout_s, run_name=run_name))
             for r in range(nprocs)]
    first_fail, fail_time = None, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            for r, c in enumerate(codes):
                if c in (None, 0):
                    continue
                fail_time = fail_time or time.monotonic()
                # a rank its watchdog stopped (because another rank failed) is named only if no other did
                if first_fail is None or (first_fail[1] == PEER_FAILED_STATUS and c != PEER_FAILED_STATUS):
                    first_fail = (r, c)
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
    print(f"meshtorch launch: rank {r} failed first ({_how(c)}); exit statuses by rank: {codes}", file=sys.stderr)
    return c if 0 < c != PEER_FAILED_STATUS else 1


def _how(code: int) -> str:
    """Words for a process's exit status."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 2:
        return "status 2: invalid input, see its message above"
    if code == PEER_FAILED_STATUS:
        return f"status {code}: stopped because another rank failed"
    return f"status {code}: its error is above"


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


def launch_command(command: list[str], nprocs: int, timeout_s: float | None = None, grace_s: float = 10.0) -> int:
    """``meshtorch launch -n nprocs -- command...``: checks the arguments, runs ``launch``.

    A leading ``--`` is dropped; a ``command[0]`` that is neither a path nor an executable on ``PATH``
    is taken as a meshtorch subcommand (``python -m meshtorch command...``).

    Raises:
        UsageError: if the command is empty, ``nprocs`` < 1, or a time is not positive (naming the flag).
    """
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("give a command after `--`, e.g. `meshtorch launch -n 4 -- python train.py`.")
    if nprocs < 1:
        raise UsageError(f"-n/--nproc must be >= 1, got {nprocs}.")
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UsageError(f"--timeout must be a finite number of seconds > 0, got {timeout_s}.")
    if not (math.isfinite(grace_s) and grace_s >= 0):
        raise UsageError(f"--grace must be a finite number of seconds >= 0, got {grace_s}.")
    if os.sep not in command[0] and shutil.which(command[0]) is None:
        command = [sys.executable, "-m", "meshtorch", *command]
    return launch(command, nprocs, timeout_s=timeout_s, grace_s=grace_s)

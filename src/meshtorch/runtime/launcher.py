"""``meshtorch launch``'s process spawning: N local processes with torchrun's environment.

Like ``torchrun --standalone --nproc-per-node N``: each process gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; when one rank exits non-zero the others get a grace
period (their failure watchdogs, :mod:`meshtorch.mesh.watchdog`, usually stop them within a second)
and are then terminated.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from meshtorch.checkpoint.format import complete_checkpoints, verify_checkpoint
from meshtorch.core.errors import CheckpointError, UsageError
from meshtorch.mesh.watchdog import PEER_FAILED_STATUS
from meshtorch.runtime.failures import LAUNCH_PREFIX_ENV, RUN_STATE_ENV, resume_argv

#: the file in a run's directory that lists its restarts, one JSON object a line
RESTART_LOG = "restarts.jsonl"


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
           poll_s: float = 0.1, max_restarts: int = 0, prefix: list[str] | None = None) -> int:
    """Run ``command`` as ``nprocs`` local processes (ranks 0..nprocs-1); returns the job's exit status.

    When a rank exits non-zero the others get ``grace_s`` seconds to stop by themselves (their
    watchdogs usually make them exit within a second), then are terminated (SIGTERM, then SIGKILL).
    A summary naming the first failed rank and its exit status goes to stderr.

    With ``max_restarts`` > 0, a job that failed (a rank died, was killed or hung: anything but status 2, an
    input error that a restart would repeat) is started again, up to ``max_restarts`` times, like torchrun's
    ``--max-restarts``: a ``meshtorch train`` job continues from the newest checkpoint of its run that verifies
    (``--resume-from``, with its data position, random-generator state and schedule step), anything else starts
    over. Each restart is appended to ``restarts.jsonl`` in the run directory (time, attempt, cause, exit
    statuses, the checkpoint). ``prefix`` is the launch command (``meshtorch launch -n 4 --``) that the ranks'
    interrupt messages print.
    """
    run_name = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="meshtorch-launch-") as tmp:
        extra = {RUN_STATE_ENV: os.path.join(tmp, "run.json"), LAUNCH_PREFIX_ENV: shlex.join(prefix or [])}
        attempt, cmd, first = 0, list(command), {}  # first: the first attempt's run state (its run directory)
        while True:
            extra["MESHTORCH_RESTART"] = str(attempt)
            codes, first_fail, hung = _run_once(cmd, nprocs, timeout_s, grace_s, poll_s, run_name, extra)
            if first_fail is None:
                return 0
            r, c = first_fail
            how = _how(c)
            if c == PEER_FAILED_STATUS and hung:  # the others stopped because of a rank that never exited
                r, how = hung[0], f"hung: it never exited, terminated {grace_s:g} s after its peers stopped"
            print(f"meshtorch launch: rank {r} failed first ({how}); exit statuses by rank: {codes}",
                  file=sys.stderr, flush=True)
            rc = c if 0 < c != PEER_FAILED_STATUS else 1
            if attempt >= max_restarts or c == 2:
                return rc
            attempt += 1
            cmd, note = _restart_command(command, extra[RUN_STATE_ENV], f"rank {r} {how}", codes, attempt, first)
            print(f"meshtorch launch: restart {attempt} of {max_restarts}: {note}", file=sys.stderr, flush=True)


def _run_once(command, nprocs, timeout_s, grace_s, poll_s, run_name, extra):
    """One attempt: ``(exit statuses by rank, (first failed rank, its status) or None, ranks still running
    when the launcher terminated them)``."""
    port = free_port()
    procs = [subprocess.Popen(command, env={**launch_env(r, nprocs, port, timeout_s=timeout_s, run_name=run_name),
                                            **extra}) for r in range(nprocs)]
    first_fail, fail_time, hung = None, None, []
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
                hung = [r for r, c in enumerate(codes) if c is None]
                _terminate(procs)
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _terminate(procs)
        raise
    return [p.wait() for p in procs], first_fail, hung


def newest_verified_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest complete checkpoint under ``checkpoint_dir`` whose files match their sizes and sha256 (None:
    none does)."""
    for _, d in reversed(complete_checkpoints(os.path.abspath(checkpoint_dir))):
        try:
            verify_checkpoint(d)
            return d
        except CheckpointError:
            continue
    return None


def _restart_command(command: list[str], state_file: str, cause: str, codes: list, attempt: int, first: dict):
    """The command of restart ``attempt`` and a line saying what it does; logs the restart in the run directory
    the first attempt reported (``first``, filled on the first call: a resumed attempt names no run directory)."""
    try:
        with open(state_file) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {}
    if not first and state:
        first.update(state)
    state = {**state, "run_dir": first.get("run_dir")}
    ckpt = newest_verified_checkpoint(state["checkpoint_dir"]) if state.get("checkpoint_dir") else None
    cmd = list(command)
    if ckpt is not None:
        i = next((k for k, a in enumerate(cmd) if a == "train"), None)
        if i is not None:
            cmd = [*cmd[:i + 1], *resume_argv(cmd[i + 1:], state.get("name"), ckpt)]
    note = f"after {cause}, " + (f"resuming from {ckpt}" if ckpt else "starting over (no checkpoint to resume)")
    if state.get("run_dir"):
        os.makedirs(state["run_dir"], exist_ok=True)
        with open(os.path.join(state["run_dir"], RESTART_LOG), "a") as f:
            f.write(json.dumps({"time": time.time(), "attempt": attempt, "cause": cause, "exit_statuses": codes,
                                "resume_from": ckpt}) + "\n")
    return cmd, note


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


def launch_command(command: list[str], nprocs: int, timeout_s: float | None = None, grace_s: float = 10.0,
                   max_restarts: int = 0) -> int:
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
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {max_restarts}.")
    prefix = ["meshtorch", "launch", "-n", str(nprocs)]
    if timeout_s is not None:
        prefix += ["--timeout", f"{timeout_s:g}"]
    if max_restarts:
        prefix += ["--max-restarts", str(max_restarts)]
    prefix.append("--")
    if os.sep not in command[0] and shutil.which(command[0]) is None:
        command = [sys.executable, "-m", "meshtorch", *command]
    elif command[1:3] == ["-m", "meshtorch"]:
        prefix += command[:3]
    else:
        prefix = None  # not a meshtorch command: its ranks print no resume command
    return launch(command, nprocs, timeout_s=timeout_s, grace_s=grace_s, max_restarts=max_restarts, prefix=prefix)

"""One line naming the cause of a command's failure, the same on every rank of a multi-process job.

Outside a job it is the exception itself. Inside one (torchrun / ``meshtorch launch``) the first
failure is recorded in the job's store (:mod:`meshtorch.mesh.watchdog`) and every rank prints it: a
rank that raised records its own exception; a rank whose collective broke because a peer vanished
(killed by a signal, crashed) finds the peer whose watchdog heartbeat stopped and records that rank.
Each rank also prints its last collectives (the flight recorder, :mod:`meshtorch.mesh.recorder`) to
stderr, so a hang or a timeout shows which collective each rank was in.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time

import torch.distributed as dist

from meshtorch.checkpoint import latest_checkpoint
from meshtorch.core.errors import MeshtorchError
from meshtorch.mesh.recorder import print_last_collectives
from meshtorch.mesh.watchdog import PEER_FAILED_STATUS, mark_reported, record_failure_text, silent_ranks

__all__ = ["PEER_FAILED_STATUS", "Interrupted", "describe_failure", "failed_first", "forget_run", "inject_fault",
           "interrupt_message", "is_communication_error", "note_run", "terminate_as_interrupt"]

#: what the running ``meshtorch train`` told :func:`note_run`: its checkpoint directory, run name, run directory
_RUN: dict = {}
#: the file ``meshtorch launch`` reads the run's directories from (it restarts from their newest checkpoint)
RUN_STATE_ENV = "MESHTORCH_RUN_STATE"
#: the launch command a rank runs under (``meshtorch launch -n 4 --max-restarts 3 --``), for resume commands
LAUNCH_PREFIX_ENV = "MESHTORCH_LAUNCH_PREFIX"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the command; ``signame`` names the signal."""

    def __init__(self, signame: str = "SIGINT"):
        super().__init__(signame)
        self.signame = signame


def terminate_as_interrupt() -> None:
    """Make SIGTERM (a scheduler's or launcher's stop) raise :class:`Interrupted` like SIGINT does, so the
    command stops at a Python instruction and says how to resume (main thread only; else nothing)."""
    def _raise(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)
    try:
        signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread
        pass


def note_run(checkpoint_dir: str, name: str, run_dir: str) -> None:
    """Record the running training job's checkpoint directory, run name and run directory (where restarts are
    logged): for :func:`interrupt_message`, and, in rank 0 under ``meshtorch launch``, in the launcher's
    state file (``$MESHTORCH_RUN_STATE``) from which it restarts a failed job."""
    _RUN.update(checkpoint_dir=checkpoint_dir, name=name, run_dir=run_dir)
    state = os.environ.get(RUN_STATE_ENV)
    if state and int(os.environ.get("RANK", "0")) == 0:
        tmp = f"{state}.tmp"
        with open(tmp, "w") as f:
            json.dump(_RUN, f)
        os.replace(tmp, state)


def forget_run() -> None:
    """Forget what :func:`note_run` recorded (a new command starts in this process)."""
    _RUN.clear()


def resume_argv(argv: list[str], name: str | None, checkpoint: str) -> list[str]:
    """``argv`` (a ``train`` command line) continuing from ``checkpoint``: ``--resume``/``--resume-from``
    dropped, ``--resume-from <checkpoint>`` added (and ``--run-name`` when the run had an automatic name)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--resume-from" or (a == "--resume" and i + 1 < len(argv) and argv[i + 1] == "auto"):
            skip = True
            continue
        if a in ("--resume", "--resume=auto") or a.startswith("--resume-from="):
            continue
        out.append(a)
    if name and not any(a == "--run-name" or a.startswith("--run-name=") for a in out):
        out += ["--run-name", name]
    return [*out, "--resume-from", checkpoint]


def interrupt_message(command: str, argv: list[str], signame: str) -> str:
    """The line printed when SIGINT/SIGTERM stops ``meshtorch <command> <argv...>``: for a training run, its
    last checkpoint and the exact command that resumes it."""
    head = f"meshtorch {command}: interrupted ({signame})"
    ckdir = _RUN.get("checkpoint_dir")
    if not ckdir:
        return head
    last = latest_checkpoint(ckdir)
    if last is None:
        return f"{head}; no checkpoint was saved yet in {ckdir} (nothing to resume: start it again)"
    prefix = shlex.split(os.environ.get(LAUNCH_PREFIX_ENV, "")) or ["meshtorch"]
    again = shlex.join([*prefix, command, *resume_argv(argv, _RUN.get("name"), last)])
    return f"{head}; the last checkpoint is {last}; resume with: {again}"


def inject_fault(step: int) -> None:
    """Test hook of the fault tests and ``benchmarks/chaos.py``: ``$MESHTORCH_FAULT`` =
    ``"<step>:<SIGNAL>[:<rank>[:<attempt>]],..."`` sends this process ``SIGNAL`` (e.g. ``SIGKILL``, ``SIGSTOP``,
    ``SIGINT``) once it has finished step ``<step>`` (and saved its checkpoint), in rank ``<rank>`` (default 0)
    of launch attempt ``<attempt>`` (``$MESHTORCH_RESTART``, default 0: the first run, not its restarts)."""
    spec = os.environ.get("MESHTORCH_FAULT")
    if not spec:
        return
    here = (step, int(os.environ.get("RANK", "0")), int(os.environ.get("MESHTORCH_RESTART", "0")))
    for item in spec.split(","):
        parts = item.split(":")
        want = (int(parts[0]), int(parts[2]) if len(parts) > 2 else 0, int(parts[3]) if len(parts) > 3 else 0)
        if want == here:
            os.kill(os.getpid(), getattr(signal, parts[1]))

_COMM_WORDS = ("gloo", "nccl", "connection", "socket", "timed out", "timeout", "broken pipe", "peer",
               "closed", "collective")


def _cause(exc: BaseException) -> str:
    if isinstance(exc, MeshtorchError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]


def is_communication_error(exc: BaseException) -> bool:
    """True for an error a collective raises when a peer is gone or hangs (gloo/NCCL, sockets, timeouts)."""
    if isinstance(exc, MeshtorchError):
        return False
    dist_error = getattr(dist, "DistError", ())
    text = str(exc).lower()
    return isinstance(exc, dist_error or ()) or (isinstance(exc, RuntimeError | OSError)
                                                and any(w in text for w in _COMM_WORDS))


def describe_failure(exc: BaseException) -> str:
    """The line to print for ``exc``; in a multi-process job it names the rank that failed first and why.

    In a job, records this rank's failure in the store unless one is recorded (a communication error
    is blamed on the rank whose heartbeat stopped, see :func:`meshtorch.mesh.watchdog.silent_ranks`)
    and waits 0.75 s so the other ranks' watchdogs read it; prints this rank's last collectives (flight
    recorder) to stderr. :func:`failed_first` tells from the line whether this rank is the one named.
    """
    if not dist.is_initialized():
        return _cause(exc)
    rank, world = dist.get_rank(), dist.get_world_size()
    mark_reported()
    print_last_collectives()
    if is_communication_error(exc):
        silent = silent_ranks(world)
        if silent is None:
            mine = (f"rank {rank}: the job's store is unreachable: rank 0 (or the launcher) is gone "
                    f"({_cause(exc)})")
        elif silent:
            mine = (f"rank {silent[0]}: stopped responding (killed by a signal, crashed or hung; its own "
                    f"exit status is in the launcher's summary)")
        else:
            mine = f"rank {rank}: {_cause(exc)}"
    else:
        mine = f"rank {rank}: {_cause(exc)}"
    first = record_failure_text(mine) or mine
    time.sleep(0.75)  # let the other ranks' watchdogs read the record before this process exits
    if first.startswith(f"rank {rank}:") or first.startswith(f"rank {rank} "):
        return f"{first}"
    return f"rank {rank} stopping because {first}"


def failed_first(message: str) -> bool:
    """True if ``message`` (from :func:`describe_failure`) names this process as the first failure."""
    return not (dist.is_initialized() and " stopping because " in message)

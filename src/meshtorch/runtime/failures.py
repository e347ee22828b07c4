"""One line naming the cause of a command's failure, the same on every rank of a multi-process job.

Outside a job it is the exception itself. Inside one (torchrun / ``meshtorch launch``) the first
failure is recorded in the job's store (:mod:`meshtorch.mesh.watchdog`) and every rank prints it: a
rank that raised records its own exception; a rank whose collective broke because a peer vanished
(killed by a signal, crashed) finds the peer whose watchdog heartbeat stopped and records that rank.
Each rank also prints its last collectives (the flight recorder, :mod:`meshtorch.mesh.recorder`) to
stderr, so a hang or a timeout shows which collective each rank was in.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from meshtorch.core.errors import MeshtorchError
from meshtorch.mesh.recorder import print_last_collectives
from meshtorch.mesh.watchdog import PEER_FAILED_STATUS, mark_reported, record_failure_text, silent_ranks

__all__ = ["PEER_FAILED_STATUS", "describe_failure", "failed_first", "is_communication_error"]

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

"""The failure watchdog of a multi-process (torchrun / ``meshtorch launch``) job: no silent hang.

When a rank raises, its uncaught exception is recorded in the process group's key-value store
("rank R: <exception>"); a watchdog thread in every other rank polls that key (every 0.25 s) and
exits the process with status :data:`PEER_FAILED_STATUS` (75; 2 s later, so that the failed rank
usually exits first and torchrun names it) and a message naming the failed rank and the cause.
``meshtorch launch`` never names a rank that exited with that status as the first failure. Started by
:func:`meshtorch.mesh.process.init_distributed`. Before it exits, a rank prints the last collectives of
its flight recorder (:mod:`meshtorch.mesh.recorder`): what each rank was doing when the job failed.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback

import torch.distributed as dist

from meshtorch.mesh.recorder import print_last_collectives

FAILED_KEY = "meshtorch/failed"
HEARTBEAT_KEY = "meshtorch/alive/{rank}"  # a counter each rank's watchdog increments every poll
#: exit status of a rank the watchdog stops because another rank failed
PEER_FAILED_STATUS = 75  # sysexits EX_TEMPFAIL: not this rank's fault
_watchdog: _Watchdog | None = None


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API; without it we fall back on timeouts
        return None


def failure_recorded() -> bool:
    """True if some rank recorded a failure in the store (or the store is gone)."""
    store = _store()
    if store is None:
        return False
    try:
        return bool(store.check([FAILED_KEY]))
    except Exception:  # noqa: BLE001 - store gone: treat as failed, do not wait
        return True


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
                self.store.add(HEARTBEAT_KEY.format(rank=self.rank), 1)
                if not self.store.check([FAILED_KEY]):
                    continue
                msg = self.store.get(FAILED_KEY).decode()
            except Exception:  # noqa: BLE001 - store host gone (normal at exit): stop watching
                return
            if self.reported or msg.startswith(f"rank {self.rank} "):
                return
            print(f"meshtorch: rank {self.rank} stopping because {msg}", file=sys.stderr, flush=True)
            print_last_collectives()
            sys.stdout.flush()
            # exit a little after the failed rank, so that torchrun / meshtorch launch name it as the first failure
            time.sleep(self.exit_delay_s)
            os._exit(PEER_FAILED_STATUS)


def silent_ranks(world_size: int, wait_s: float = 1.0) -> list[int] | None:
    """Ranks whose watchdog heartbeat did not advance during ``wait_s`` seconds (killed or hung), or None if
    the store cannot be read (its host, rank 0 or the launcher, is gone)."""
    store = _store()
    if store is None:
        return None
    try:
        keys = [HEARTBEAT_KEY.format(rank=r) for r in range(world_size)]
        before = [store.add(k, 0) for k in keys]
        time.sleep(wait_s)
        after = [store.add(k, 0) for k in keys]
    except Exception:  # noqa: BLE001 - the store host is gone
        return None
    return [r for r in range(world_size) if before[r] == after[r]]


def record_failure_text(text: str) -> str | None:
    """Record ``text`` (``"rank R: cause"``) as the job's failure unless one is recorded; returns the first."""
    store = _store()
    if store is None:
        return None
    try:
        first = store.compare_set(FAILED_KEY, "", text[:4000])
        return first.decode() if isinstance(first, bytes) else str(first)
    except Exception:  # noqa: BLE001 - the store may be gone already
        return None


def mark_reported() -> None:
    """Tell this rank's watchdog that this rank handles the failure itself (it stops watching)."""
    if _watchdog is not None:
        _watchdog.reported = True


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
        print_last_collectives()
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



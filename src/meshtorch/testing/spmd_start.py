"""Starting the ranks of a :func:`~meshtorch.testing.spmd.run_spmd` job: forked from a fork server that has
torch and meshtorch imported (the default), or as fresh interpreters (``MESHTORCH_SPMD_START=subprocess``).

Why: a fresh ``python -m meshtorch.testing.spmd`` interpreter spends 3-4 s of CPU importing torch and meshtorch
before its rank does anything; on a 2-core host a 4-rank job spent about 8 s of wall time starting
(``run_spmd("os:getpid", nprocs=4)``: 7.8 s, 2 ranks 3.3 s, measured 2026-11-28 on the idle 2-core test host),
and the test suite starts about 40 such jobs. A rank forked from a process that already imported them starts in
milliseconds.

How (the source followed: Python's :mod:`multiprocessing` documentation, "Contexts and start methods",
``forkserver`` and :func:`multiprocessing.set_forkserver_preload`): the fork server is a fresh interpreter (exec'd,
not forked from the caller, so it holds none of the caller's threads, locks or process groups), started once per
calling process with ``OMP_NUM_THREADS=1``; it imports :data:`PRELOAD` (then ``gc.freeze()``, so that a rank's
garbage collection does not copy the server's heap) and never runs a torch op, so no OpenMP or intra-op thread
pool exists when it forks. Each rank then, in the forked child: points fd 2 at its
per-rank stderr file and fd 1 at ``/dev/null`` (``os.dup2``), replaces ``os.environ`` by the job's environment
(torchrun's variables, ``MESHTORCH_TIMEOUT``, the caller's ``env``), puts ``SRC_DIR`` and ``extra_path`` first on
``sys.path``, runs :func:`_child_main` as the ``python -m`` path does, and exits like an interpreter would
(uncaught exception: ``sys.excepthook``, where the failure watchdog records it, and status 1; then the ``atexit``
handlers, where the ranks leave their process groups together). Exit statuses, signals (negative statuses) and
kills behave as with :class:`subprocess.Popen`.

meshtorch reads its environment when a value is used, not at import, with one exception, the flight recorder's
``MESHTORCH_FLIGHT_RECORDER``; a job whose value of it (or of a torch / OpenMP / MKL / Python start-up variable,
:data:`IMPORT_TIME_ENV`) differs from the fork server's starts its ranks as fresh interpreters, and so does a
program run as a script file (see :func:`start_method`).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import subprocess
import sys
import threading

import torch

from meshtorch.mesh.process import init_distributed

#: the directory that holds the meshtorch package
SRC_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: ``MESHTORCH_SPMD_START``: ``forkserver`` or ``subprocess`` (a fresh interpreter per rank); unset: see start_method
START_ENV = "MESHTORCH_SPMD_START"
#: modules the fork server imports before it forks any rank (torch, meshtorch, then ``gc.freeze()``)
PRELOAD = ["meshtorch.testing.spmd_preload"]
#: variables read when a module is imported (meshtorch's flight recorder switch) or when the interpreter, torch,
#: OpenMP or MKL start; a job whose values differ from the fork server's gets fresh interpreters
IMPORT_TIME_ENV = ("MESHTORCH_FLIGHT_RECORDER",)
IMPORT_TIME_PREFIXES = ("TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_", "PYTHON")
_NOT_COMPARED = ("PYTHONPATH",)  # the fork path puts SRC_DIR and extra_path on sys.path itself

_server_env: dict | None = None  # the import-time variables of the fork server this process started


def start_ranks(tmp: str, envs: list, extra_path=(), method: str | None = None) -> list:
    """Start one rank per environment in ``envs`` (rank r gets ``envs[r]``); returns handles with
    :class:`subprocess.Popen`'s ``poll()``, ``kill()`` and ``wait()``.

    Rank r's stderr goes to ``tmp/rank{r}.err``, its stdout to ``/dev/null``; it runs :func:`_child_main` on
    ``tmp``. ``method``: see :func:`start_method`.
    """
    method = start_method(envs[0], method)
    err_paths = [os.path.join(tmp, f"rank{r}.err") for r in range(len(envs))]
    for err in err_paths:  # exists even if a rank dies before it opens it
        open(err, "w").close()  # noqa: SIM115
    if method == "forkserver":
        _fork_server_env()  # started once per process
        ctx = multiprocessing.get_context("forkserver")
        path = [SRC_DIR, *extra_path]
        procs = [ctx.Process(target=_forked_rank, args=(tmp, env, path, err), name=f"meshtorch-spmd-rank{r}")
                 for r, (env, err) in enumerate(zip(envs, err_paths, strict=True))]
        handles = []
        try:
            for p in procs:
                p.start()
                handles.append(_ForkedRank(p))
        except BaseException:
            for h in handles:
                h.kill()
            raise
        return handles
    out = []
    for env, err in zip(envs, err_paths, strict=True):
        with open(err, "w") as f:
            out.append(subprocess.Popen([sys.executable, "-m", "meshtorch.testing.spmd", tmp], env=env,
                                        stdout=subprocess.DEVNULL, stderr=f))
    return out


def start_method(env: dict, method: str | None = None) -> str:
    """How a job with environment ``env`` starts its ranks: ``"forkserver"`` or ``"subprocess"``.

    ``method`` (default: ``MESHTORCH_SPMD_START``) decides if given; unset: the fork server (started by
    :func:`start_ranks` when first used, never for a job that takes the subprocess path), unless the calling
    program is a script file (``python script.py``: multiprocessing would run its top level again in every rank,
    its "safe importing of main module" rule; the benchmarks' per-rank peak memory stays a fresh interpreter's) or
    ``env``'s import-time variables differ from the server's.

    Raises:
        ValueError: an unknown ``method`` (or ``MESHTORCH_SPMD_START`` value).
    """
    method = method or os.environ.get(START_ENV) or ""
    if method not in ("forkserver", "subprocess", ""):
        raise ValueError(f"{START_ENV}={method!r}: use 'forkserver' or 'subprocess' (or leave it unset)")
    if method:
        return method
    fits = not _main_is_script() and _server_import_env() == _import_time_env(env)
    return "forkserver" if fits else "subprocess"


def _main_is_script() -> bool:
    """True if ``__main__`` is a file run by path (not ``python -m``, ``-c`` or interactive)."""
    main = sys.modules.get("__main__")
    run_by_name = getattr(getattr(main, "__spec__", None), "name", None) is not None
    return not run_by_name and getattr(main, "__file__", None) is not None


class _ForkedRank:
    """A forked rank with :class:`subprocess.Popen`'s ``poll``/``kill``/``wait`` (statuses as Popen's)."""

    def __init__(self, proc):
        self.proc = proc
        self.pid = proc.pid

    def poll(self):
        return self.proc.exitcode

    def kill(self):
        if self.proc.exitcode is None:
            self.proc.kill()

    def wait(self):
        self.proc.join()
        return self.proc.exitcode


def _import_time_env(env) -> dict:
    return {k: v for k, v in env.items()
            if (k in IMPORT_TIME_ENV or k.startswith(IMPORT_TIME_PREFIXES)) and k not in _NOT_COMPARED}


def _server_extra_env() -> dict:
    """What the fork server's environment adds to this process's: no OpenMP thread pool, and this meshtorch (Python
    3.11's fork server ignores the caller's sys.path; an installed meshtorch of another checkout must not win)."""
    return {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}


def _server_import_env() -> dict:
    """The fork server's import-time environment: the running server's, else the one it would start with (without
    starting it)."""
    return _server_env if _server_env is not None else _import_time_env({**os.environ, **_server_extra_env()})


def _fork_server_env() -> dict:
    """Start the fork server (once per process); its import-time environment (:data:`IMPORT_TIME_ENV`)."""
    global _server_env
    if _server_env is None:
        extra = _server_extra_env()
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
            multiprocessing.forkserver.ensure_running()
            _server_env = _import_time_env(os.environ)
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    return _server_env


def _forked_rank(tmp: str, env: dict, path: list, err_path: str) -> None:
    """A rank in a child of the fork server: the ``python -m meshtorch.testing.spmd`` path's start and exit."""
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.close(fd)
    if path[0] != SRC_DIR:  # the server imported another checkout's meshtorch
        raise RuntimeError(f"the fork server's meshtorch is in {SRC_DIR}, the caller's in {path[0]}; "
                           f"set {START_ENV}=subprocess")
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = path
    sys.argv = [os.path.join(SRC_DIR, "meshtorch", "testing", "spmd.py"), tmp]  # as ``python -m`` sets it
    code = 0
    try:
        _child_main(tmp)
    except SystemExit as e:  # as the interpreter treats it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: the hook (watchdog report), status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    # As the interpreter exits: ``threading._shutdown`` first runs the callbacks registered with
    # ``threading._register_atexit`` (concurrent.futures' executors tell their idle workers to stop: joining those
    # workers without it waits forever, as a compiled job's rank did), then joins the non-daemon threads.
    threading._shutdown()
    atexit._run_exitfuncs()  # CPython's own exit step; a multiprocessing child otherwise skips the handlers
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - as at interpreter exit
            pass
    os._exit(code)


def _child_main(tmp: str) -> None:
    """One rank: read ``tmp/args.pkl``, one intra-op thread, ``init_distributed``, call the target, pickle
    its value to ``tmp/rank{rank}.pkl``."""
    with open(os.path.join(tmp, "args.pkl"), "rb") as f:
        target, args = pickle.load(f)
    torch.set_num_threads(1)
    rank = init_distributed()
    mod, fn = target.split(":")
    result = getattr(importlib.import_module(mod), fn)(*args)
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)

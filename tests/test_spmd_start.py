"""run_spmd's ranks start from the fork server (torch and meshtorch imported there), with the job's environment.

Structural checks, no timing: a rank's parent process is the multiprocessing fork server and that process has
libtorch mapped (so the rank did not import torch itself); the job's variables, ``MESHTORCH_TIMEOUT`` (read when
used, not at import) and ``extra_path`` reach the rank. The start semantics shared with the ``python -m`` path
(exit statuses, stderr, time-outs, a hanging rank) are tested in tests/test_spmd.py.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import sys
import types

import pytest

from meshtorch.testing.spmd import run_spmd
from meshtorch.testing.spmd_start import START_ENV, start_method

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def rank_view():
    """(target of the job below) What a rank sees of its start."""
    from meshtorch.mesh.process import default_timeout_s

    return os.getppid(), os.environ.get("MESHTORCH_PROBE"), default_timeout_s(), sys.path.index(TESTS_DIR), sys.argv


_POOL = None


def leave_idle_executor():
    """(target) Return with a ThreadPoolExecutor's idle worker alive, as inductor's compile pool leaves one."""
    from concurrent.futures import ThreadPoolExecutor

    global _POOL
    _POOL = ThreadPoolExecutor(max_workers=1)  # kept alive (a collected executor wakes its workers itself)
    return _POOL.submit(os.getpid).result()


@pytest.fixture
def no_main_script(monkeypatch):
    """The test run's ``__main__`` as under ``python -m pytest`` or a pytest-xdist worker (not a script file)."""
    monkeypatch.delenv(START_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))


def test_ranks_fork_from_the_preloaded_server(no_main_script):
    run = run_spmd("test_spmd_start:rank_view", nprocs=2, timeout_s=120, dist_timeout_s=7,
                   extra_path=[TESTS_DIR], env={"MESHTORCH_PROBE": "job-env"}).check()
    parents = {ppid for ppid, *_ in run.results}
    assert len(parents) == 1 and os.getpid() not in parents, (parents, os.getpid())
    server = parents.pop()
    with open(f"/proc/{server}/cmdline") as f:
        assert "from multiprocessing.forkserver import main" in f.read().replace("\0", " ")
    with open(f"/proc/{server}/maps") as f:
        assert "libtorch" in f.read(), "the fork server has not imported torch"
    for _, probe, timeout_s, path_index, argv in run.results:
        assert probe == "job-env" and timeout_s == 7.0
        assert path_index <= 1  # extra_path first, after SRC_DIR
        assert argv[0].endswith(os.path.join("meshtorch", "testing", "spmd.py"))


def test_start_method_choice(no_main_script, monkeypatch):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as run_spmd sets it
    assert start_method(env) == "forkserver"
    # the flight recorder's switch is read when meshtorch is imported: a job that changes it gets fresh interpreters
    flipped = "0" if os.environ.get("MESHTORCH_FLIGHT_RECORDER", "1") != "0" else "1"
    assert start_method({**env, "MESHTORCH_FLIGHT_RECORDER": flipped}) == "subprocess"
    assert start_method({**env, "MESHTORCH_TIMEOUT": "3"}) == "forkserver"  # read when used
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__file__="/x/bench.py", __spec__=None))
    assert start_method(env) == "subprocess"  # a script's top level would run again in every rank
    monkeypatch.setenv(START_ENV, "forkserver")
    assert start_method(env) == "forkserver"
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ValueError, match=f"{START_ENV}='fork'"):
        start_method(env)


def test_a_rank_with_an_idle_executor_exits(no_main_script):
    """A rank exits as an interpreter does: ``threading._shutdown`` stops concurrent.futures' idle workers before it
    joins the non-daemon threads (joining them first hung a compiled job's rank until the job's time-out)."""
    run = run_spmd("test_spmd_start:leave_idle_executor", nprocs=2, timeout_s=60, extra_path=[TESTS_DIR])
    assert not run.timed_out and run.returncodes == [0, 0], (run.returncodes, run.stderr)


def test_choosing_does_not_start_the_fork_server(no_main_script, monkeypatch):
    """start_method only compares environments; the server starts when a rank is forked (start_ranks), so a job
    that takes the subprocess path leaves no idle server behind."""
    import meshtorch.testing.spmd_start as spmd_start

    def refuse():
        raise AssertionError("start_method started the fork server")

    monkeypatch.setattr(spmd_start, "_server_env", None)
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", refuse)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    flipped = "0" if os.environ.get("MESHTORCH_FLIGHT_RECORDER", "1") != "0" else "1"
    assert start_method({**env, "MESHTORCH_FLIGHT_RECORDER": flipped}) == "subprocess"
    assert start_method(env) == "forkserver"
    assert spmd_start._server_env is None

import fcntl
import os
import pickle
import sys

# Test this checkout's sources even when another checkout is pip-installed (e.g. git worktrees).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import pytest  # noqa: E402
import torch  # noqa: E402

# The suite's tensors are small: one intra-op thread avoids oversubscribing the 2 CPU cores (and
# the gloo worker processes some tests start), which made steps 10-20x slower under load.
torch.set_num_threads(1)

# `meshtorch plan` reads a cached calibration of this machine (meshtorch.runtime.calibrate) when one exists: the
# suite uses its own empty cache, so a developer's calibration never changes what a test sees.
if "MESHTORCH_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MESHTORCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshtorch-test-cache-")


def pytest_collection_modifyitems(config, items):
    """Test files holding a test marked ``slow`` run first, each file's tests kept together and in order. With
    ``-n 2`` pytest-xdist hands the first quarter of the tests out round-robin, so the minute-long tests start
    early on both workers instead of one of them ending the run alone (the longest-first rule of scheduling)."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """``once_per_run(name, compute)``: ``compute()``'s value, computed by one process of the test run.

    A module- or session-scoped fixture runs once per pytest-xdist worker (``-n 2`` ran each multi-process job of
    the suite twice). The first worker to ask computes the value and pickles it next to the workers' temporary
    directories; the others wait on a file lock and read it (the pattern of pytest-xdist's documentation,
    "Making session-scoped fixtures execute only once"; ``--dist loadgroup`` with ``xdist_group`` would do it by
    scheduling, but pytest-xdist 3.8 cannot name the groups under pytest 9). Without xdist: ``compute()``."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return lambda name, compute: compute()
    root = tmp_path_factory.getbasetemp().parent  # shared by this run's workers

    def once(name: str, compute):
        path = root / f"once-{name}.pkl"
        with open(root / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if path.exists():
                with open(path, "rb") as f:
                    return pickle.load(f)
            value = compute()
            with open(path.with_suffix(".tmp"), "wb") as f:
                pickle.dump(value, f)
            os.replace(path.with_suffix(".tmp"), path)
            return value

    return once

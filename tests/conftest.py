import os
import sys

# Test this checkout's sources even when another checkout is pip-installed (e.g. git worktrees).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

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

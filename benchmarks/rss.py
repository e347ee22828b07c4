"""Resident-set-size helpers of the memory benchmarks (Linux ``/proc``): current RSS, its high-water mark, reset."""

from __future__ import annotations

import gc
import os
import re


def rss_bytes() -> int:
    """This process's resident set size, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def reset_peak() -> int:
    """Collect garbage, reset the RSS high-water mark to the current RSS (clear_refs 5); return the current RSS."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()

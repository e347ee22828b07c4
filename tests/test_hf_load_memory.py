"""Importing a Hugging Face checkpoint grows a process by the bytes of the slices it holds (issue 33).

A GPT-2 of 17M parameters (made with ``transformers``, seed 0) is imported in a fresh process after a tiny one
(lazy torch allocations paid); its peak resident-set growth is compared with the bytes of the variable slices
held, as ``benchmarks/hf_load_memory.py`` does at 124M. A slice copied after it is read (the store's copy of a
caller's tensor) held each weight twice for a moment, and the allocator kept the freed copies: 1.27x at 124M.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"n_layer": 4, "n_embd": 512, "n_head": 8, "vocab_size": 8192, "n_positions": 256}


def test_replicated_import_peak_growth_is_within_1_1x_of_the_bytes_held(tmp_path):
    src, bench = os.path.join(ROOT, "src"), os.path.join(ROOT, "benchmarks")
    code = (f"import sys, json; sys.path[:0] = [{src!r}, {bench!r}]; import hf_load_memory as B; "
            f"tiny, small = B.make_checkpoints({str(tmp_path)!r}, {SMALL!r}, 'gpt2-small-test'); "
            "print(json.dumps(B.measure(tiny, small, False)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["held"] == r["total"] > 60 * 2 ** 20  # one process holds every slice: the whole model
    assert r["growth"] <= 1.1 * r["held"], f"peak RSS growth {r['growth'] / r['held']:.3f}x the bytes held"

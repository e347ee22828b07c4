"""Peak RSS growth while importing a GPT-2-small-shaped Hugging Face checkpoint (124M parameters, random
weights made locally with ``transformers``), replicated in one process and FSDP-sharded on 4 gloo ranks.

Each process first imports a tiny GPT-2 (so torch's and meshtorch's lazy allocations are paid), then resets
its RSS high-water mark (``/proc/self/clear_refs``), runs ``mtf.hf.load`` on the 124M directory and reports
the peak growth against the bytes of the variable slices it holds. Goal (issue 33): growth <= 1.05x the slice
bytes held, replicated and per FSDP rank (``tests/test_hf_load_memory.py`` fails past 1.1x at a small size).

Run: ``python benchmarks/hf_load_memory.py [--dir /tmp/gpt2-124m] [--nprocs 4]`` (needs ``transformers``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, HERE)

MIB = 2**20


def make_checkpoints(root: str, big: dict | None = None, big_name: str = "gpt2-124m") -> tuple[str, str]:
    """``(tiny, big)`` GPT-2 directories under ``root`` (made once, reused, with seed 0); ``big``: the
    ``GPT2Config`` fields of the big one (default GPT-2 small's, 124M parameters), named ``big_name``."""
    import torch
    import transformers

    dirs = []
    for name, kw in (("tiny", {"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64}),
                     (big_name, big or {})):
        d = os.path.join(root, name)
        if not os.path.isfile(os.path.join(d, "model.safetensors")):
            torch.manual_seed(0)
            transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw)).save_pretrained(d, safe_serialization=True)
        dirs.append(d)
    return dirs[0], dirs[1]


def measure(tiny: str, big: str, spmd: bool) -> dict:
    """Load ``tiny`` (warm-up), reset the high-water mark, load ``big``; bytes of slices held and RSS growth."""
    import rss

    import meshtorch as mtf
    from meshtorch.checkpoint import hf

    def impl():
        if spmd:
            return mtf.SpmdMeshImpl("data:4", "batch:data", storage="d_model:data")
        return mtf.PlacementMeshImpl("", "")

    hf.load(tiny, impl(), batch_size=4, length=8)
    base = rss.reset_peak()
    model, lw = hf.load(big, impl(), batch_size=4, length=8)
    peak = rss.peak_rss_bytes()
    i = lw.mesh_impl(model.logits)
    held = 0
    for v in lw.variables:
        out = v.outputs[0]
        n = 1
        for s in i.slice_shape(out.shape, lw.tensor_layout(out)):
            n *= s
        held += n * out.dtype.itemsize * len(i.local_pnums())
    total = sum(v.outputs[0].shape.size * v.outputs[0].dtype.itemsize for v in lw.variables)
    return {"held": held, "growth": peak - base, "total": total, "rss_after": rss.rss_bytes() - base}


def spmd_worker(tiny: str, big: str) -> dict:
    return measure(tiny, big, spmd=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/meshtorch-hf-bench")
    ap.add_argument("--nprocs", type=int, default=4)
    a = ap.parse_args()
    import host

    from meshtorch.testing.spmd import run_spmd

    print(host.describe())
    tiny, big = make_checkpoints(a.dir)
    src = os.path.join(ROOT, "src")
    code = (f"import sys, json; sys.path[:0] = [{src!r}, {HERE!r}]; import hf_load_memory as B; "
            f"print(json.dumps(B.measure({tiny!r}, {big!r}, False)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.strip().splitlines()[-1]
    r = json.loads(out)
    print(f"replicated (1 process): model {r['total'] / MIB:.1f} MiB, slices held {r['held'] / MIB:.1f} MiB, "
          f"peak RSS growth {r['growth'] / MIB:.1f} MiB = {r['growth'] / r['held']:.2f}x the bytes held "
          f"(goal <= 1.05x); RSS after load +{r['rss_after'] / MIB:.1f} MiB")
    run = run_spmd("hf_load_memory:spmd_worker", args=(tiny, big), nprocs=a.nprocs, timeout_s=900,
                   extra_path=[HERE]).check()
    for rank, r in enumerate(run.results):
        print(f"FSDP rank {rank}/{a.nprocs} (storage d_model:data): slices held {r['held'] / MIB:.1f} MiB of "
              f"{r['total'] / MIB:.1f}, peak RSS growth {r['growth'] / MIB:.1f} MiB = {r['growth'] / r['held']:.2f}x "
              f"(goal <= 1.05x); RSS after load +{r['rss_after'] / MIB:.1f} MiB")


if __name__ == "__main__":
    main()

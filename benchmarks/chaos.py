"""Chaos run (issue 35): a 4-rank ``meshtorch launch --max-restarts`` training job whose ranks are killed and
stopped ends with the variables, bitwise, of an uninterrupted run with the same checkpoint cadence.

4 gloo ranks train the tiny LM (data parallel, storage ``d_model:data``) for ``--steps`` steps (120) with a
checkpoint every ``--every`` (10). Three times a random rank SIGKILLs itself after a random step, and once a
random rank SIGSTOPs itself (a hang: its peers' collectives time out after ``--timeout`` s, the watchdogs stop
them, the launcher kills the stopped rank); the launcher restarts the job from the newest checkpoint that
verifies each time (the faults come from ``$MESHTORCH_FAULT``, one per launch attempt, see
``meshtorch.runtime.failures.inject_fault``). An uninterrupted run with the same flags is the reference.
Printed: the faults, the restarts the launcher logged, whether every variable of the final checkpoints is
bitwise equal, the steps computed again (fault step - checkpoint resumed from, summed) and the wall time lost
(chaos run - uninterrupted run, both timed here on the same host).

Run: ``python benchmarks/chaos.py [--steps 120] [--every 10] [--seed 0] [--timeout 10]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import safetensors.torch
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "",
        "--warmup-steps", "1", "--mesh", "data:4", "--layout", "batch:data", "--storage", "d_model:data",
        "--threads", "1"]


def _run(runs: str, name: str, args, fault: str = "", restarts: int = 0) -> float:
    argv = [sys.executable, "-m", "meshtorch", "launch", "-n", "4", "--timeout", str(args.timeout),
            "--max-restarts", str(restarts), "--", "train", *TINY, "--steps", str(args.steps), "--eval-every",
            str(args.steps), "--checkpoint-every", str(args.every), "--keep", "2", "--runs-dir", runs,
            "--run-name", name]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), MESHTORCH_FAULT=fault)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if args.log:
        with open(f"{args.log}.{name}", "w") as f:
            f.write(p.stderr)
    if p.returncode != 0:
        sys.exit(f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return wall


def _tensors(ckpt: str) -> dict:
    out = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            out.update({f"{f}:{k}": v for k, v in safetensors.torch.load_file(os.path.join(ckpt, f)).items()})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="collective timeout (s): how long a hang lasts")
    ap.add_argument("--log", default="", help="write each launch's stderr to LOG.<name>")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    steps = sorted(rng.sample(range(args.every + 1, args.steps), 4))
    kinds = ["SIGKILL"] * 3 + ["SIGSTOP"]
    rng.shuffle(kinds)
    faults = [(s, k, rng.randrange(4), attempt) for attempt, (s, k) in enumerate(zip(steps, kinds, strict=True))]
    spec = ",".join(f"{s}:{k}:{r}:{a}" for s, k, r, a in faults)
    with tempfile.TemporaryDirectory() as runs:
        chaos = _run(runs, "chaos", args, spec, restarts=len(faults))
        ref = _run(runs, "ref", args)
        with open(os.path.join(runs, "chaos", "restarts.jsonl")) as f:
            log = [json.loads(ln) for ln in f]
        final = f"ckpt-{args.steps}"
        a, b = _tensors(os.path.join(runs, "chaos", "ckpt", final)), _tensors(os.path.join(runs, "ref", "ckpt", final))
        equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    redone = sum(s - (s // args.every) * args.every for s, _, _, _ in faults)
    print(f"faults (step, signal, rank, attempt): {faults}")
    for e in log:
        print(f"restart {e['attempt']}: {e['cause']}; exit statuses {e['exit_statuses']}; "
              f"resumed from {os.path.basename(e['resume_from'] or '-')}")
    print(f"final variables bitwise equal to the uninterrupted run: {equal} ({len(b)} tensors)")
    print(f"steps computed again: {redone} of {args.steps}; wall time: chaos {chaos:.1f} s, uninterrupted "
          f"{ref:.1f} s, lost {chaos - ref:.1f} s (collective timeout {args.timeout:g} s for the hang)")
    sys.exit(0 if equal and len(log) == len(faults) else 1)


if __name__ == "__main__":
    main()

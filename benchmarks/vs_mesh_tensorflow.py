"""One LM training step, meshtorch vs Mesh TensorFlow 0.1.21 (TF 2.12 graph mode), interleaved.

Issue 13's LM: d_model 256, d_ff 1024, 4 layers, 4 heads x d_kv 64, vocab 256, batch 16 x length 128,
relu, no dropout, no clipping, Adafactor with Mesh TF's defaults on both sides, float32, one step =
forward + backward + optimizer update (+ global step increment), loss fetched each step.

    bash benchmarks/mtf_venv.sh                 # once: the Mesh TF venv (default /work/mtf-venv)
    python benchmarks/vs_mesh_tensorflow.py --threads 1 2 --blocks 5 --block-steps 3
    python benchmarks/vs_mesh_tensorflow.py --threads 1 2 --layouts   # + 4-processor placement meshes
    python benchmarks/vs_mesh_tensorflow.py --threads 1 --gemm-peak   # + GEMM peak, FLOP rate over it

Run it with meshtorch's python. The Mesh TF side is a subprocess under the Mesh TF venv's python
(``benchmarks/_mtf_lm_worker.py``: builds the mtf graph, lowering and tf.compat.v1 Session once,
then times steps on command over stdin/stdout JSON lines); the meshtorch side runs in this process
(``lm_common.meshtorch_lm``, i.e. ``meshtorch.models.transformer.build_lm`` on a
``PlacementMeshImpl``). Both get the same token batch. For each thread count, every configuration
(1 processor, and with ``--layouts`` the placement meshes ``all:4`` with ``batch:all`` and with
``heads:all;d_ff:all``) on both sides is warmed up, then the runs are interleaved: ``--blocks``
rounds, each running ``--block-steps`` steps of every (side, configuration) in turn, the starting
side rotating every round, so machine load falls on both alike. Reported: median seconds/step with
the min-max over all timed steps, the ratio of medians meshtorch / Mesh TF with the range of the
per-round ratios (of the round's medians), the same ratios over the "quiet" rounds only (no step
slower than ``--quiet-factor`` x its series' fastest: other jobs' load bursts hit PyTorch's 2-thread
OpenMP steps far harder than TF's thread pool), model GFLOP/s (``flops_per_token`` x tokens / median),
parameter counts (must be equal: the script stops otherwise) and the first/last timed loss of each
side (must go down). ``--gemm-peak`` adds float32 GEMM rates on the LM's shapes (``torch.mm`` here,
``tf.matmul`` in the worker, same threads) and each side's model FLOP rate over them.
By default the Mesh TF variables start from meshtorch's initial values (passed as an ``.npz``), so
the loss before the first update must agree (relative 1e-4, else the script stops: the two models
would not be the same computation) and the losses then track each other step by step.

Threads: this process ``torch.set_num_threads(n)``; the worker gets ``OMP_NUM_THREADS``,
``MKL_NUM_THREADS``, ``TF_NUM_INTRAOP_THREADS`` = n and a ConfigProto with
``intra_op_parallelism_threads`` = n and ``inter_op_parallelism_threads`` = ``--tf-inter-op``
(0, the default: n). The worker blocks on its pipe while meshtorch runs and vice versa.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter

import numpy as np
import torch
from host import describe
from lm_common import meshtorch_lm

import meshtorch as mtf
from meshtorch.models.transformer import LMConfig, flops_per_token

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_mtf_lm_worker.py"
DEFAULT_VENV = "/work/mtf-venv"
LAYOUTS = [("all:4", "batch:all"), ("all:4", "heads:all;d_ff:all")]


def mtf_python(venv: str) -> str:
    """The Mesh TF venv's python, or exit with one line naming the venv and how to create it."""
    py = Path(venv) / "bin" / "python"
    if not os.access(py, os.X_OK):
        sys.exit(f"vs_mesh_tensorflow: no Mesh TF venv at {venv} ({py} missing); "
                 f"create it with: bash {HERE / 'mtf_venv.sh'} {venv}")
    return str(py)


class MtfWorker:
    """One Mesh TF LM (one mesh, layout, thread count) in a subprocess of the Mesh TF venv."""

    def __init__(self, python, cfg: LMConfig, ids, mesh_shape, layout, threads, inter_op, init=None):
        n = str(threads)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, TF_NUM_INTRAOP_THREADS=n,
                   TF_NUM_INTEROP_THREADS=str(inter_op), TF_CPP_MIN_LOG_LEVEL="2")
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env, bufsize=1)
        c = {"vocab": cfg.padded_vocab, "d_model": cfg.d_model, "num_heads": cfg.num_heads, "d_kv": cfg.d_kv,
             "d_ff": cfg.d_ff, "num_layers": cfg.num_layers, "length": cfg.length, "batch_size": cfg.batch_size}
        self.info = self._ask({"cfg": c, "mesh_shape": mesh_shape, "layout": layout, "threads": threads,
                               "inter_op": inter_op, "ids": ids.tolist(), "init": init})

    def _ask(self, msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            tail = "".join(self.err.readlines()[-15:])
            raise RuntimeError(f"Mesh TF worker exited (rc {self.proc.wait()}); its stderr ends:\n{tail}")
        return json.loads(line)

    def steps(self, k):
        r = self._ask({"steps": k})
        return r["times"], r["losses"]

    def gemm_rates(self, shapes, repeats):
        return self._ask({"gemm": shapes, "repeats": repeats})["flops"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.err.close()


class MeshtorchLM:
    """meshtorch's LM (``lm_common.meshtorch_lm``, Adafactor, no clipping) lowered on a placement mesh."""

    def __init__(self, cfg: LMConfig, ids, mesh_shape, layout, executor="codegen"):
        t0 = perf_counter()
        self.lm, self.lw = meshtorch_lm(cfg, 0, None, 0, 0, None, mesh_shape, layout, optimizer="adafactor")
        if executor != "codegen":  # same initial values (counter-based), another executor; compiles at warm-up
            self.lw = mtf.Lowering(self.lm.graph, {self.lm.mesh: self.lw.mesh_impl(self.lm.loss)}, mode=executor)
        self.fetches = [self.lm.loss] + self.lm.updates
        self.feeds = {self.lm.inputs: ids[:, :-1], self.lm.targets: ids[:, 1:]}
        self.info = {"params": sum(v.outputs[0].shape.size for v in self.lm.graph.trainable_variables),
                     "build_s": perf_counter() - t0}

    def save_initial_values(self, path):
        """Write the trainable variables' initial values (by name) to an ``.npz`` for the Mesh TF worker."""
        np.savez(path, **{v.name: self.lw.variable_value(v.name).numpy()
                          for v in self.lm.graph.trainable_variables})

    def steps(self, k):
        times, losses = [], []
        for _ in range(k):
            t0 = perf_counter()
            out = self.lw.run(self.fetches, feeds=self.feeds)
            times.append(perf_counter() - t0)
            losses.append(float(out[0]))
        return times, losses

    def close(self):
        pass


def gemm_shapes(cfg: LMConfig):
    """The LM's GEMM shapes [m, k, n]: tokens x d_model x d_ff and back, the attention projections, a
    weight gradient (as ``benchmarks/lm_step.py``)."""
    t = cfg.batch_size * cfg.length
    return [[t, cfg.d_model, cfg.d_ff], [t, cfg.d_ff, cfg.d_model], [t, cfg.d_model, cfg.d_model],
            [cfg.d_model, t, cfg.d_ff]]


def torch_gemm_rates(shapes, repeats):
    """Median float32 ``torch.mm`` FLOP/s of each ``[m, k, n]`` at the current torch thread count."""
    rates = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        ts = []
        for _ in range(repeats):
            t0 = perf_counter()
            torch.mm(a, b)
            ts.append(perf_counter() - t0)
        rates.append(2.0 * m * k * n / statistics.median(ts))
    return rates


def _config_name(mesh_shape, layout):
    return "1 processor" if not mesh_shape else f"{mesh_shape} {layout}"


def measure(cfg, ids, threads, configs, args, python):
    """Interleaved timings at one thread count: {(side, config): {"times", "losses", "block_medians", ...}}."""
    torch.set_num_threads(threads)
    inter_op = args.tf_inter_op or threads
    runners = {}
    tmp = tempfile.TemporaryDirectory(prefix="vs_mtf_")
    init = None if args.random_init else str(Path(tmp.name) / "init.npz")
    try:
        for mesh_shape, layout in configs:
            name = _config_name(mesh_shape, layout)
            runners[("meshtorch", name)] = mt = MeshtorchLM(cfg, ids, mesh_shape, layout, args.executor)
            if init and not os.path.exists(init):
                mt.save_initial_values(init)
            runners[("Mesh TF", name)] = MtfWorker(python, cfg, ids, mesh_shape, layout, threads, inter_op, init)
        res = {key: {"times": [], "losses": [], "block_medians": [], **r.info} for key, r in runners.items()}
        for key, r in runners.items():
            _, losses = r.steps(args.warmup)
            res[key]["warmup_losses"] = losses
        keys = list(runners)
        for b in range(args.blocks):
            for j in range(len(keys)):
                key = keys[(b + j) % len(keys)]
                times, losses = runners[key].steps(args.block_steps)
                res[key]["times"] += times
                res[key]["losses"] += losses
                res[key]["block_medians"].append(statistics.median(times))
        if args.gemm_peak:
            one = _config_name("", "")
            res[("meshtorch", one)]["gemm"] = torch_gemm_rates(gemm_shapes(cfg), 10)
            res[("Mesh TF", one)]["gemm"] = runners[("Mesh TF", one)].gemm_rates(gemm_shapes(cfg), 10)
        return res
    finally:
        for r in runners.values():
            r.close()
        tmp.cleanup()


def report(cfg, threads, configs, res, args) -> list[str]:
    """Print the table for one thread count; return the problems found (params differ, loss not falling)."""
    flops = flops_per_token(cfg) * cfg.batch_size * cfg.length
    problems = []
    print(f"\n== threads {threads} (torch.set_num_threads {threads}; TF intra_op {threads}, "
          f"inter_op {args.tf_inter_op or threads}); {args.blocks} blocks x {args.block_steps} steps per side "
          f"after {args.warmup} warm-up steps; {flops / 1e9:.2f} GFLOP per step")
    print(f"{'side':<10} {'configuration':<28} {'median ms':>9} {'(min-max)':>15} {'GFLOP/s':>8} "
          f"{'params':>9} {'build s':>7}  loss first -> last")
    for mesh_shape, layout in configs:
        name = _config_name(mesh_shape, layout)
        for side in ("meshtorch", "Mesh TF"):
            r = res[(side, name)]
            t = r["times"]
            med = statistics.median(t)
            r["median"] = med
            print(f"{side:<10} {name:<28} {1e3 * med:9.1f} {f'({1e3 * min(t):.0f}-{1e3 * max(t):.0f})':>15} "
                  f"{flops / med / 1e9:8.2f} {r['params']:9d} {r['build_s']:7.1f}  "
                  f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
            every = r["warmup_losses"] + r["losses"]  # from before the first update to the last step
            if not every[-1] < every[0]:
                problems.append(f"threads {threads}, {side} {name}: loss did not go down ({every})")
        a, b = res[("meshtorch", name)], res[("Mesh TF", name)]
        if a["params"] != b["params"]:
            problems.append(f"{name}: parameter counts differ: meshtorch {a['params']}, Mesh TF {b['params']}")
        if not args.random_init:
            l0, l1 = a["warmup_losses"][0], b["warmup_losses"][0]
            print(f"   loss before the first update, same initial weights: meshtorch {l0:.6f}, Mesh TF {l1:.6f}")
            if abs(l0 - l1) > 1e-4 * abs(l1):
                problems.append(f"threads {threads}, {name}: initial losses differ ({l0} vs {l1}) with the same "
                                "weights: the two models are not the same computation")
        per_block = [x / y for x, y in zip(a["block_medians"], b["block_medians"], strict=True)]
        goal = "; issue 13 goal <= 0.8" if not mesh_shape else ""
        print(f"   ratio meshtorch / Mesh TF, {name}: {a['median'] / b['median']:.3f} (of the medians; per-block "
              f"ratios: median {statistics.median(per_block):.3f}, range {min(per_block):.2f}-{max(per_block):.2f}"
              f"{goal})")
    one = _config_name("", "")
    for mesh_shape, layout in configs:
        name = _config_name(mesh_shape, layout)
        if name != one:
            print(f"   {name} / 1 processor: meshtorch "
                  f"{res[('meshtorch', name)]['median'] / res[('meshtorch', one)]['median']:.2f}, Mesh TF "
                  f"{res[('Mesh TF', name)]['median'] / res[('Mesh TF', one)]['median']:.2f}")
    _report_quiet(threads, configs, res, args)
    if args.gemm_peak:
        a, b = res[("meshtorch", one)], res[("Mesh TF", one)]
        pa, pb = max(a["gemm"]), max(b["gemm"])
        best = max(pa, pb)
        ra, rb = flops / a["median"], flops / b["median"]
        print(f"   float32 GEMM on the LM's shapes {gemm_shapes(cfg)}, median GFLOP/s: torch.mm "
              f"{', '.join(f'{r / 1e9:.0f}' for r in a['gemm'])}; "
              f"tf.matmul {', '.join(f'{r / 1e9:.0f}' for r in b['gemm'])}")
        print(f"   1 processor, model FLOP rate / best GEMM rate: meshtorch {100 * ra / pa:.1f}% of torch.mm's "
              f"{pa / 1e9:.0f}; Mesh TF {100 * rb / pb:.1f}% of tf.matmul's {pb / 1e9:.0f}; of the machine's "
              f"best ({best / 1e9:.0f}): meshtorch {100 * ra / best:.1f}%, Mesh TF {100 * rb / best:.1f}%")
    return problems


def _report_quiet(threads, configs, res, args):
    """The same ratios over the quiet rounds only: rounds in which no step of any series took more than
    ``--quiet-factor`` times that series' fastest step (another job's load burst slows PyTorch's 2-thread
    OpenMP steps far more than TF's, so a burst in one side's turn skews the round)."""
    k, f = args.block_steps, args.quiet_factor
    quiet = [r for r in range(args.blocks)
             if all(max(v["times"][r * k:(r + 1) * k]) <= f * min(v["times"]) for v in res.values())]
    print(f"   quiet rounds (no step over {f}x its series' fastest): {len(quiet)} of {args.blocks}"
          + (f" (rounds {', '.join(str(r + 1) for r in quiet)})" if quiet else ""))
    if not quiet:
        return
    med = {key: statistics.median([t for r in quiet for t in v["times"][r * k:(r + 1) * k]])
           for key, v in res.items()}
    one = _config_name("", "")
    for mesh_shape, layout in configs:
        name = _config_name(mesh_shape, layout)
        a, b = med[("meshtorch", name)], med[("Mesh TF", name)]
        line = (f"   quiet rounds, {name}: meshtorch {1e3 * a:.1f} ms, Mesh TF {1e3 * b:.1f} ms, "
                f"ratio {a / b:.3f}")
        if name != one:
            line += (f"; / 1 processor: meshtorch {a / med[('meshtorch', one)]:.2f}, "
                     f"Mesh TF {b / med[('Mesh TF', one)]:.2f}")
        print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts, each measured in turn")
    ap.add_argument("--blocks", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--executor", choices=("codegen", "interpret", "compile"), default="codegen",
                    help="meshtorch's executor (compile: torch.compile of the generated step, during warm-up)")
    ap.add_argument("--block-steps", type=int, default=3, help="steps per side and configuration in a round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side and configuration first")
    ap.add_argument("--layouts", action="store_true",
                    help="also the 4-processor placement meshes: all:4 batch:all and all:4 heads:all;d_ff:all")
    ap.add_argument("--gemm-peak", action="store_true",
                    help="after the rounds, measure float32 GEMM rates on the LM's shapes on both sides "
                         "(torch.mm here, tf.matmul in the worker) and report the FLOP rate over that peak")
    ap.add_argument("--quiet-factor", type=float, default=1.5,
                    help="a round is quiet if no step took more than this times its series' fastest step")
    ap.add_argument("--tf-inter-op", type=int, default=0, help="TF inter_op_parallelism_threads (0: --threads)")
    ap.add_argument("--mtf-venv", default=os.environ.get("MTF_VENV", DEFAULT_VENV),
                    help=f"the Mesh TF venv from benchmarks/mtf_venv.sh (default $MTF_VENV or {DEFAULT_VENV})")
    ap.add_argument("--random-init", action="store_true",
                    help="let each side draw its own initial weights (default: Mesh TF starts from meshtorch's)")
    ap.add_argument("--json", help="also write the raw timings and losses to this file")
    args = ap.parse_args()
    python = mtf_python(args.mtf_venv)
    cfg = LMConfig(vocab_size=args.vocab, vocab_multiple=4, d_model=args.d_model, num_heads=args.heads,
                   d_kv=args.d_model // args.heads, d_ff=args.d_ff, num_layers=args.layers, length=args.length,
                   batch_size=args.batch_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
    configs = [("", "")] + (LAYOUTS if args.layouts else [])
    print(describe())
    print(f"config: {cfg.num_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.num_heads} heads x "
          f"d_kv {cfg.d_kv}, vocab {cfg.padded_vocab}, batch {cfg.batch_size} x length {cfg.length}; relu, "
          f"no dropout, no clipping, Adafactor (Mesh TF defaults); torch {torch.__version__}; "
          f"Mesh TF venv {args.mtf_venv}")
    problems, dump = [], {}
    for threads in args.threads:
        res = measure(cfg, ids, threads, configs, args, python)
        if threads == args.threads[0]:
            info = res[("Mesh TF", _config_name("", ""))]
            print(f"Mesh TF side: tensorflow-cpu {info['tf']}, mesh-tensorflow {info['mtf']}")
        problems += report(cfg, threads, configs, res, args)
        dump[str(threads)] = {f"{s} | {n}": r for (s, n), r in res.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1))
    if problems:
        sys.exit("vs_mesh_tensorflow: " + "; ".join(problems))


if __name__ == "__main__":
    main()

"""How long a native LM program takes to build, phase by phase (issue 33, deliverable 3).

For each model (``--models``, default ``124m,1b``), one process, AdamW (meshtorch's fused kernel), a
one-processor placement mesh, ``--threads`` intra-op threads (default 1: a torchrun rank's setting), phases
timed separately (wall seconds, and process CPU seconds, which a shared host's load inflates less):

1. ``graph``: :func:`meshtorch.models.transformer.build_lm` (named-dimension graph, gradients, optimizer ops;
   nothing is allocated);
2. ``plan``: :func:`meshtorch.lowering.stages.plan` of the training fetches (``[loss] + updates``): the Program
   from metadata only;
3. ``lowering``: ``Lowering(graph, ..., init="lazy")``: planning again, the variable store and the session
   bound to the mesh, no variable drawn (what ``Lowering`` costs besides the draw);
4. ``init``: drawing every variable's initial value (``store.draw_pending()``; what ``init="random"`` adds);
5. ``step 1`` / ``step 2``: the first training step (its fetch set's schedule and generated code, then the
   step) and a second one, on ``--batch-size`` sequences.

``build`` = graph + lowering + init (what a training job waits for before its first step; ``plan`` is
counted in ``lowering``). A model whose variables (weights and AdamW slots) need more than ``--max-gib`` is
not allocated: its ``init`` is scaled from a proxy of the same shape with 1 layer and a vocabulary cut until
it fits in half of ``--max-gib`` (the draw and the zero fills are linear in the elements; printed with a
``*``) and its steps are not run.

Models: ``124m``: GPT-2 small's shape with untied embeddings (12 layers, d_model 768, 12 heads x 64, d_ff 3072,
vocab 50257, length 1024: 163M parameters); ``1b``: issue 33's 1.42B shape (24 layers, d_model 2048, 16 heads
x 128, d_ff 8192, vocab 50304, length 1024); ``--layers`` etc. override the shape of every model.

``--ranks N`` (with ``--storage``, default ``d_model:data``, and ``--remat``, default ``block``): the program of
``benchmarks/largest_model.py``'s run instead, built by N gloo ranks (mesh ``data:N``, layout ``batch:data``, byte
vocabulary 256 unless ``--vocab``, AdamW), each drawing and allocating only its own slices. Printed per rank, wall
and process CPU seconds from the process's start: ``import`` (the interpreter, torch, meshtorch and joining the
gloo group, up to the rank's first line of work), ``graph``, ``plan`` (with the SPMD schedule of ``meshtorch plan
--backend gloo``), ``lowering``, ``init``; ``to step 1`` (process start to the first step: what the job waits
for; import + graph + lowering + init, since ``Lowering`` plans again) and, unless ``--steps 0``, ``step 1``...;
and the rank's RSS when the build ends and its high-water mark. Model
``1b-run``: the AdamW row of docs/memory.md's largest-model table (26 x 1792, d_ff 7168, length 256: 1003M
parameters). Nothing is scaled: every rank allocates its quarter (the 1003M model: ~0.95 GiB of weights per rank,
plus the AdamW moments when written).

Run: ``python benchmarks/build_time.py [--models 124m,1b] [--repeats 1] [--threads 1] [--max-gib 3]``
(``--models 124m --layers 2`` for a quick check); ``python benchmarks/build_time.py --models 1b-run --ranks 4
[--steps 0]`` for the largest-model program (``--layers 2`` for a quick check).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from host import describe  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.lowering import stages  # noqa: E402
from meshtorch.models.transformer import build_lm, preset  # noqa: E402

GIB = 2 ** 30
MODELS = {
    "124m": dict(num_layers=12, d_model=768, num_heads=12, d_kv=64, d_ff=3072, vocab_size=50257, length=1024),
    "1b": dict(num_layers=24, d_model=2048, num_heads=16, d_kv=128, d_ff=8192, vocab_size=50304, length=1024),
    "1b-run": dict(num_layers=26, d_model=1792, num_heads=14, d_kv=128, d_ff=7168, vocab_size=256, length=256),
}
OVERRIDES = {"layers": "num_layers", "d_model": "d_model", "heads": "num_heads", "d_kv": "d_kv", "d_ff": "d_ff",
             "vocab": "vocab_size", "length": "length"}


class Clock:
    """Wall and process CPU seconds of the phases timed with :meth:`phase`."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def phase(self, name: str, fn):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        self.wall[name], self.cpu[name] = time.perf_counter() - w, time.process_time() - c
        return out


def _lm(cfg_kw: dict, batch: int, remat: str = "none"):
    cfg = preset("tiny", batch_size=batch, remat=remat, **cfg_kw)
    return build_lm(cfg, seed=0, optimizer=mtf.optim.AdamWOptimizer(1e-3, weight_decay=0.0))


def variable_bytes(lm) -> int:
    """Bytes of every variable of the graph (weights, AdamW slots, step counter) in its slice dtype."""
    return sum(v.shape.size * v.outputs[0].dtype.itemsize for v in lm.graph.all_variables)


def measure(cfg_kw: dict, batch: int, steps: bool) -> tuple[Clock, object]:
    """Time the phases for one shape; ``steps=False`` stops after the lowering (no variable drawn)."""
    clock = Clock()
    lm = clock.phase("graph", lambda: _lm(cfg_kw, batch))
    fetches = [lm.loss] + lm.updates
    clock.phase("plan", lambda: stages.plan(lm.graph, fetches, mtf.MeshSpec("", "")))
    lw = clock.phase("lowering", lambda: mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec("", "")}, init="lazy"))
    if not steps:
        return clock, lm
    clock.phase("init", lw.store.draw_pending)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg_kw["vocab_size"], (batch, cfg_kw["length"] + 1), generator=g)
    feeds = {lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]}
    for i in (1, 2):
        clock.phase(f"step {i}", lambda: lw.run(fetches, feeds))
    return clock, lm


def extrapolated_init(cfg_kw: dict, max_bytes: float) -> tuple[float, float, int]:
    """(wall, CPU) seconds of ``init`` at ``cfg_kw``, scaled from a proxy that fits in ``max_bytes``: the same
    shape with 1 layer and the vocabulary cut until its variables fit (the draw and the fills are linear in the
    elements: scaled by the ratio of variable elements, the drawn : filled ratio being AdamW's 1 : 2 in both).
    Returns the proxy's parameter count too."""
    proxy = dict(cfg_kw, num_layers=1)
    lm = _lm(proxy, 1)
    while variable_bytes(lm) > max_bytes and proxy["vocab_size"] > 64:
        proxy["vocab_size"] //= 2
        lm = _lm(proxy, 1)
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec("", "")}, init="lazy")
    c = Clock()
    c.phase("init", lw.store.draw_pending)
    n_proxy = sum(v.shape.size for v in lm.graph.all_variables)
    params = sum(v.shape.size for v in lm.graph.trainable_variables)
    del lw, lm
    n_full = sum(v.shape.size for v in _lm(cfg_kw, 1).graph.all_variables)
    return c.wall["init"] * n_full / n_proxy, c.cpu["init"] * n_full / n_proxy, params


def process_age() -> float:
    """Seconds since this process started (Linux: its start time after boot in ``/proc/self/stat``, field 22, against
    ``/proc/uptime``; 10 ms resolution)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def rank_worker(cfg_kw: dict, batch: int, storage: str, remat: str, steps: int) -> dict:
    """One gloo rank (under :func:`meshtorch.testing.spmd.run_spmd`) building the program of
    ``largest_model.py``'s run: phases as wall / CPU seconds since the process started, RSS when built and its
    high-water mark (bytes)."""
    import torch.distributed as dist
    from rss import peak_rss_bytes, rss_bytes

    from meshtorch.mesh.factory import make_mesh_impl
    from meshtorch.runtime.plan_lm import backend_options
    clock = Clock()
    clock.wall["import"], clock.cpu["import"] = process_age(), time.process_time()
    mesh, layout = f"data:{dist.get_world_size()}", "batch:data"
    impl = make_mesh_impl(mesh, layout, storage=storage)
    lm = clock.phase("graph", lambda: _lm(cfg_kw, batch, remat))
    fetches = [lm.loss] + lm.updates
    clock.phase("plan", lambda: stages.plan(lm.graph, fetches, mtf.MeshSpec(mesh, layout, storage),
                                            backend_options("gloo")))
    lw = clock.phase("lowering", lambda: mtf.Lowering(lm.graph, {lm.mesh: impl}, init="lazy"))
    clock.phase("init", lw.store.draw_pending)
    clock.wall["to step 1"] = sum(clock.wall[k] for k in ("import", "graph", "lowering", "init"))
    clock.cpu["to step 1"] = time.process_time() - clock.cpu["plan"]  # (a job plans inside its lowering)
    built_rss = rss_bytes()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg_kw["vocab_size"], (batch, cfg_kw["length"] + 1), generator=g)
    feeds = {lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]}
    losses = []
    for i in range(1, steps + 1):
        losses.append(float(clock.phase(f"step {i}", lambda: lw.run(fetches, feeds))[0]))
    params = sum(v.shape.size for v in lm.graph.trainable_variables)
    return {"wall": clock.wall, "cpu": clock.cpu, "built_rss": built_rss, "peak_rss": peak_rss_bytes(),
            "losses": losses, "params": params}


def _wc(rec: dict, col: str) -> str:
    return f"{rec['wall'][col]:.2f}/{rec['cpu'][col]:.2f}"


def run_ranks(cfg_kw: dict, args) -> list[str]:
    """Build (and run ``--steps`` steps of) the program on ``--ranks`` gloo ranks; the printed lines."""
    from meshtorch.testing.spmd import run_spmd
    job = (cfg_kw, args.batch_size * args.ranks, args.storage, args.remat, args.steps)
    res = run_spmd("build_time:rank_worker", job, nprocs=args.ranks, timeout_s=3600, dist_timeout_s=3600,
                   extra_path=[HERE], env={"MALLOC_MMAP_THRESHOLD_": "131072"})  # as largest_model.py's ranks
    res.check()
    cols = ["import", "graph", "plan", "lowering", "init", "to step 1"] + [f"step {i}" for i in
                                                                           range(1, args.steps + 1)]
    r0 = res.results[0]
    lines = [f"{r0['params'] / 1e6:.1f}M parameters; {args.ranks} gloo ranks, mesh data:{args.ranks}, layout "
             f"batch:data, storage {args.storage!r}, remat {args.remat!r}, AdamW; losses {r0['losses']}",
             f"{'rank':<6}" + "".join(f"{c:>15}" for c in cols) + f"{'built RSS':>11}{'peak RSS':>10}"]
    for r, rec in enumerate(res.results):
        lines.append(f"{r:<6}" + "".join(f"{_wc(rec, c):>15}" for c in cols)
                     + f"{rec['built_rss'] / GIB:>10.2f}G{rec['peak_rss'] / GIB:>9.2f}G")
    lines.append("seconds as wall/CPU, 'import' since each rank's process started, the others their own; 'to step 1' "
                 "= import + graph + lowering + init (a job's own path: the lowering plans again)")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="124m,1b", help="comma-separated: " + ", ".join(MODELS))
    for flag in OVERRIDES:
        ap.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=1,
                    help="sequences of the two timed steps (per rank with --ranks: the global batch is N x this, "
                    "largest_model.py's 4 on 4 ranks)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (torch.set_num_threads)")
    ap.add_argument("--repeats", type=int, default=1, help="measure each model this many times (medians printed)")
    ap.add_argument("--max-gib", type=float, default=3.0,
                    help="allocate a model's variables only below this many GiB; else extrapolate init")
    ap.add_argument("--ranks", type=int, default=None,
                    help="build on this many gloo ranks (mesh data:N, layout batch:data) instead of one process")
    ap.add_argument("--storage", default="d_model:data", help="with --ranks: the storage layout (FSDP)")
    ap.add_argument("--remat", default="block", help="with --ranks: activation checkpointing of the blocks")
    ap.add_argument("--steps", type=int, default=1, help="with --ranks: training steps timed after the build")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in names:
        if m not in MODELS:
            ap.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    if args.steps < 0:
        ap.error(f"--steps must be >= 0, got {args.steps}")
    for flag in ("batch_size", "threads", "repeats", "ranks", *OVERRIDES):
        v = getattr(args, flag)
        if v is not None and v < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.max_gib <= 0:
        ap.error(f"--max-gib must be > 0, got {args.max_gib}")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"{describe()}; {args.threads} intra-op thread(s); load average {load[0]:.1f} (shared host)")
    cols = ["graph", "plan", "lowering", "init", "build", "step 1", "step 2"]
    if args.ranks is not None:
        for m in names:
            cfg_kw = dict(MODELS[m])
            cfg_kw.update({OVERRIDES[k]: v for k, v in vars(args).items() if k in OVERRIDES and v is not None})
            print(f"{m}: {cfg_kw}", flush=True)
            for line in run_ranks(cfg_kw, args):
                print(line, flush=True)
        return
    print(f"{'model':<28}{'params':>8}{'var GiB':>9}  " + "".join(f"{c:>15}" for c in cols))
    for m in names:
        cfg_kw = dict(MODELS[m])
        cfg_kw.update({OVERRIDES[k]: v for k, v in vars(args).items() if k in OVERRIDES and v is not None})
        runs = []
        for _ in range(args.repeats):
            lm = _lm(cfg_kw, args.batch_size)
            nbytes = variable_bytes(lm)
            params = sum(v.shape.size for v in lm.graph.trainable_variables)
            del lm
            fits = nbytes <= args.max_gib * GIB
            clock, _ = measure(cfg_kw, args.batch_size, steps=fits)
            if not fits:
                clock.wall["init"], clock.cpu["init"], proxy = extrapolated_init(cfg_kw, args.max_gib * GIB / 2)
            for d in (clock.wall, clock.cpu):
                d["build"] = d["graph"] + d["lowering"] + d["init"]
            runs.append(clock)

        def cell(c, fits=fits):
            vals = sorted((r.wall.get(c), r.cpu.get(c)) for r in runs)
            w, cpu = vals[len(vals) // 2]
            if w is None:
                return f"{'not run':>15}"
            mark = "*" if not fits and c in ("init", "build") else ""
            return f"{f'{w:.2f}/{cpu:.2f}{mark}':>15}"

        label = f"{m} ({cfg_kw['num_layers']}x{cfg_kw['d_model']}, L{cfg_kw['length']})"
        print(f"{label:<28}{params / 1e6:>7.0f}M{nbytes / GIB:>9.2f}  " + "".join(cell(c) for c in cols))
        if not fits:
            print(f"   * init scaled from a {proxy / 1e6:.0f}M-parameter proxy (1 layer, vocabulary cut to fit "
                  f"--max-gib {args.max_gib:g} / 2), linear in variable elements; steps not run")
    print("seconds as wall/CPU (median of --repeats); build = graph + lowering + init (plan is part of lowering)")


if __name__ == "__main__":
    main()

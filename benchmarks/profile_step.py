"""Where one process's training step spends its time: meshtorch's LM vs the same model in plain PyTorch.

The GPT-2-small shape of ``benchmarks/scale_124m.py`` (vocab 50257, d_model 768, 12 heads x 64, d_ff 3072,
context 256; ``--layers`` blocks, ``--batch`` sequences), AdamW on both sides (meshtorch's fused kernel;
``torch.optim.AdamW(fused=True)`` for the peer), one CPU thread. Per side: the median step time of
``--steps`` steps (after one warm-up), the two sides' steps interleaved (A B A B ...), then one step under
``torch.profiler`` and the ``aten::`` ops with the largest self CPU time.

``--counts``: instead, the ``aten::`` calls of one step per op name (nested calls included, as
``tests/test_step_kernels.py`` counts them), meshtorch vs ``torch`` (this file's ``BlockLM``) and ``torch_lm``
(the test twin :class:`meshtorch.testing.torch_lm.TorchLM`), AdamW ``fused=True``; rows where the sides differ.

``--optimizer adafactor``: Adafactor on every side (meshtorch: Mesh TF's defaults, one multi-tensor update;
``torch.optim.Adafactor(foreach=True)`` for the ``torch`` sides); side ``meshtorch_per_variable``: one update op
per variable (the per-variable ops, for a before/after of the multi-tensor step).

Run: ``python benchmarks/profile_step.py [--layers 2] [--batch 1] [--steps 3] [--top 25] [--no-profile] [--counts]
[--optimizer adamw|adafactor]``
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from host import mm_times  # noqa: E402
from scale_124m import BlockLM  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.models.transformer import build_lm, flops_per_token, preset  # noqa: E402
from meshtorch.optim.in_backward import per_variable as one_op_per_variable  # noqa: E402


def config(layers: int, batch: int, **kw):
    base = dict(vocab_size=50257, d_model=768, num_heads=12, d_kv=64, d_ff=3072, num_layers=layers, length=256,
                batch_size=batch)
    base.update(kw)
    return preset("tiny", **base)


def data(cfg, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _dense_xent(logits, targets, vocab_dim, z_loss=0.0, name=None):
    """The loss as it was before ops/xent.py: a one-hot float tensor times log_softmax (Mesh TF's formula)."""
    soft = mtf.one_hot(targets, logits.shape.get_dim_by_name(vocab_dim.name), dtype=logits.dtype)
    return _SPARSE_OR_SOFT(logits, soft, vocab_dim, z_loss=z_loss, name=name)


_SPARSE_OR_SOFT = mtf.layers.softmax_cross_entropy_with_logits


def make_optimizer(name: str, per_variable: bool = False):
    """meshtorch's ``adamw`` (lr 1e-4, no weight decay) or ``adafactor`` (Mesh TF defaults); ``per_variable``: one
    update op per variable (:func:`meshtorch.optim.in_backward.per_variable`) instead of one multi-tensor op."""
    opt = mtf.optim.AdamWOptimizer(1e-4, weight_decay=0.0) if name == "adamw" else mtf.optim.AdafactorOptimizer()
    return one_op_per_variable(opt) if per_variable else opt


def meshtorch_step(cfg, dense_loss=False, optimizer="adamw", per_variable=False):
    """``dense_loss``: build the one-hot loss of before ops/xent.py (the "before" of this benchmark);
    ``optimizer``/``per_variable``: as :func:`make_optimizer`."""
    if dense_loss:
        mtf.layers.softmax_cross_entropy_with_logits = _dense_xent
    try:
        lm = build_lm(cfg, seed=0, optimizer=make_optimizer(optimizer, per_variable))
    finally:
        mtf.layers.softmax_cross_entropy_with_logits = _SPARSE_OR_SOFT
    lw = lm.lowering()
    fetches = [lm.loss] + lm.updates

    def step(s):
        x, y = data(cfg, s)
        return float(lw.run(fetches, feeds={lm.inputs: x, lm.targets: y})[0])
    return step


def torch_step(cfg, optim="fused", optimizer="adamw"):
    """``optimizer`` ``adafactor``: ``torch.optim.Adafactor(foreach=True)`` (PyTorch's variant of the update, for
    the kernel counts; its formulas differ from Mesh TF's) instead of AdamW (``optim``: fused or foreach)."""
    model = BlockLM(cfg)
    if optimizer == "adafactor":
        opt = torch.optim.Adafactor(model.parameters(), foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                                **({"fused": True} if optim == "fused" else {"foreach": True}))

    def step(s):
        x, y = data(cfg, s)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def torch_lm_step(cfg):
    """The test twin :class:`~meshtorch.testing.torch_lm.TorchLM` with ``torch.optim.AdamW(fused=True)``."""
    from meshtorch.testing.torch_lm import TorchLM
    model = TorchLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

    def step(s):
        x, y = data(cfg, s)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def aten_counts(fn, s) -> collections.Counter:
    """``aten::`` calls per op name (nested ones included) in one call of ``fn(s)`` under ``torch.profiler``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(s)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def count_table(sides) -> str:
    """Per side: total ``aten::`` calls in one step, then the op names whose counts differ between the sides."""
    counts = {}
    for name, fn in sides.items():
        fn(0)  # warm-up (optimizer state, caches)
        counts[name] = aten_counts(fn, 1)
    names = list(counts)
    out = [f"{'aten:: calls per step':<36}" + "".join(f"{n:>16}" for n in names),
           f"{'total':<36}" + "".join(f"{sum(c.values()):>16}" for c in counts.values())]
    ops = sorted({op for c in counts.values() for op in c}, key=lambda op: (-max(c[op] for c in counts.values()), op))
    for op in ops:
        row = [counts[n][op] for n in names]
        if len(set(row)) > 1:
            out.append(f"{op:<36}" + "".join(f"{v:>16}" for v in row))
    return "\n".join(out)


def gemm_shapes(cfg):
    """(m, k, n) of the step's matmuls: forward ``x @ W``, and the backward's ``dy @ W^T`` and ``x^T @ dy``,
    for q, k, v, o, wi, wo per layer and the logits (attention's score/value products are left out)."""
    t, d, f, v, hk = cfg.batch_size * cfg.length, cfg.d_model, cfg.d_ff, cfg.padded_vocab, cfg.num_heads * cfg.d_kv
    fwd = [(t, d, hk)] * 3 + [(t, hk, d), (t, d, f), (t, f, d)]
    shapes = []
    for m, k, n in fwd * cfg.num_layers + [(t, d, v)]:
        shapes += [(m, k, n), (m, n, k), (k, m, n)]
    return shapes


def gemm_rates(shapes, repeats=3):
    """FLOP/s of ``torch.mm`` per distinct shape (best of ``repeats``), and the time of all ``shapes``
    at those rates."""
    best = {}
    for shp in sorted(set(shapes)):
        m, k, n = shp
        best[shp] = 2 * m * k * n / min(mm_times(m, k, n, repeats))
    total_s = sum(2 * m * k * n / best[(m, k, n)] for m, k, n in shapes)
    return best, total_s


def timed(fn, s):
    t0 = time.perf_counter()
    fn(s)
    return time.perf_counter() - t0


def top_ops(fn, s, n):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(s)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows) / 1e6
    out = [f"    total self CPU {total:.2f} s"]
    for e in rows[:n]:
        out.append(f"    {e.key:<42}{e.count:>6}{e.self_cpu_time_total / 1e6:>9.3f} s")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--counts", action="store_true", help="print aten:: calls per step by op name and exit")
    ap.add_argument("--optimizer", choices=["adamw", "adafactor"], default="adamw",
                    help="the step's optimizer on every side (default adamw; adafactor: Mesh TF's defaults for "
                         "meshtorch, torch.optim.Adafactor(foreach=True) for the torch side)")
    ap.add_argument("--sides", default=None,
                    help="default meshtorch,meshtorch_dense,torch (with --counts: meshtorch,torch,torch_lm); "
                         "meshtorch (sparse loss), meshtorch_dense (the one-hot loss of before), torch "
                         "(AdamW fused=True), torch_foreach (AdamW foreach=True), torch_lm (the test twin TorchLM, "
                         "AdamW fused=True), meshtorch_per_variable (one optimizer update op per variable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = config(args.layers, args.batch)
    o = args.optimizer
    make = {"meshtorch": lambda: meshtorch_step(cfg, optimizer=o),
            "meshtorch_dense": lambda: meshtorch_step(cfg, True, optimizer=o),
            "meshtorch_per_variable": lambda: meshtorch_step(cfg, optimizer=o, per_variable=True),
            "torch": lambda: torch_step(cfg, optimizer=o), "torch_foreach": lambda: torch_step(cfg, "foreach", o),
            "torch_lm": lambda: torch_lm_step(cfg)}
    if args.sides is None:
        args.sides = "meshtorch,torch,torch_lm" if args.counts else "meshtorch,meshtorch_dense,torch"
    sides = {k: make[k]() for k in args.sides.split(",")}
    print(f"{args.layers} layers, batch {args.batch} x {cfg.length}, vocab {cfg.vocab_size}, {args.threads} thread(s), "
          f"torch {torch.__version__}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    if args.counts:
        print(count_table(sides))
        return
    for fn in sides.values():
        fn(0)  # warm-up
    times = {k: [] for k in sides}
    for s in range(1, args.steps + 1):
        for name, fn in sides.items():
            times[name].append(timed(fn, s))
    for name, t in times.items():
        print(f"{name:<10} step s median {statistics.median(t):.3f} (min {min(t):.3f}, max {max(t):.3f})")
    for a in (k for k in times if k.startswith("meshtorch")):
        for ref in (r for r in ("torch", "torch_lm") if r in times):
            per_step = [x / y for x, y in zip(times[a], times[ref], strict=True)]  # neighbours in time
            print(f"{a} / {ref}: {statistics.median(times[a]) / statistics.median(times[ref]):.3f} "
                  f"(min/min {min(times[a]) / min(times[ref]):.3f}; per-step ratios median "
                  f"{statistics.median(per_step):.3f}, min {min(per_step):.3f}, max {max(per_step):.3f})")
    model_flops = flops_per_token(cfg) * cfg.batch_size * cfg.length
    best, gemm_s = gemm_rates(gemm_shapes(cfg))
    peak = max(best.values())
    print(f"GEMM check: model FLOPs per step {model_flops / 1e9:.1f} G (6N + attention); best torch.mm rate on the "
          f"step's shapes {peak / 1e9:.1f} GFLOP/s; the step's matmuls at their measured per-shape rates "
          f"{gemm_s:.3f} s")
    for k, t in times.items():
        print(f"  {k}: {model_flops / min(t) / 1e9:.1f} GFLOP/s at its fastest step = "
              f"{model_flops / min(t) / peak:.0%} of the best mm rate; {gemm_s / min(t):.0%} of the "
              f"per-shape mm time")
    if not args.no_profile:
        for name, fn in sides.items():
            print(f"{name}: top ops by self CPU time")
            print(top_ops(fn, 99, args.top))


if __name__ == "__main__":
    main()

"""``meshtorch plan``'s flags read and checked, then planned (:func:`meshtorch.runtime.plan_lm.plan_lm`).

The parser is :mod:`meshtorch.cli.plan`; this module turns the parsed arguments into a model configuration, a
cost model and a memory limit, refuses bad flags before the model is built (UsageError / LayoutError naming
the flag), and prints why the best layout wins and where ``--layout`` ranks. Nothing below the runtime
layer reads argparse namespaces.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import torch

from meshtorch.core.errors import LayoutError, ShapeError, UsageError
from meshtorch.core.layout import LayoutRules, check_rules_strict
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering.stages import plan
from meshtorch.models.transformer import build_lm, preset
from meshtorch.ops.precision import PrecisionPolicy
from meshtorch.planning.cost import CostModel, estimate_time
from meshtorch.planning.memory import memory_report
from meshtorch.planning.pipeline import schedule_flag
from meshtorch.runtime import pipeline_train
from meshtorch.runtime.optimizers import make_optimizer
from meshtorch.runtime.plan_lm import (
    DEFAULT_LAYOUT,
    backend_options,
    parse_bytes,
    pipeline_fields,
    plan_lm,
    training_lm,
    why_line,
)

__all__ = ["backend_options", "check_args", "hardware_cost_model", "main_plan", "your_layout_line"]


def _config(args, vocab_multiple: int, layout: str | None = None):
    """The LMConfig of the flags; pipelined as ``layout`` asks (None: not pipelined, the base of a search)."""
    return preset(args.preset, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                  d_kv=args.d_kv, d_ff=args.d_ff, length=args.length, batch_size=args.batch_size,
                  vocab_size=args.vocab, num_experts=args.experts, vocab_multiple=vocab_multiple,
                  remat=getattr(args, "remat", None),
                  **pipeline_fields(args.mesh, layout or "", getattr(args, "microbatches", None),
                                    getattr(args, "pipeline_repeats", None),
                                    getattr(args, "pipeline_stages", None) if layout is not None else None,
                                    preset(args.preset, num_layers=args.layers).num_layers))


def _policy(args) -> PrecisionPolicy:
    """``--precision`` / ``--reduce-dtype`` (absent: float32). Raises UsageError naming the flag."""
    try:
        return PrecisionPolicy.named(getattr(args, "precision", None) or "fp32",
                                     getattr(args, "reduce_dtype", None) or "float32")
    except ValueError as e:
        raise UsageError(str(e)) from None


def _positive(flag: str, value) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"{flag} must be a finite number > 0, got {value}.")


def check_args(args) -> None:
    """Check ``meshtorch plan``'s flags before the model is built.

    Raises:
        UsageError: naming the flag (a size, a count or a rate that is not positive, a mesh size that is not a
            positive integer, an unreadable ``--memory-limit``). LayoutError: a ``--layout``/``--storage`` rule
            matching no dimension of the model or no axis of the mesh, naming it and listing both.
    """
    for flag in ("layers", "d_model", "heads", "d_kv", "d_ff", "length", "batch_size", "vocab", "top", "flop_rate",
                 "bandwidth", "microbatches", "pipeline_repeats", "pipeline_stages"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag, None))
    if args.experts is not None and args.experts < 0:
        raise UsageError(f"--experts must be >= 0, got {args.experts}.")
    if args.latency is not None and not (math.isfinite(args.latency) and args.latency >= 0):
        raise UsageError(f"--latency must be a finite number >= 0, got {args.latency}.")
    if args.memory_limit:
        parse_bytes(args.memory_limit)
    _check_accumulate(args)
    _policy(args)
    storage = getattr(args, "storage", "") or ""
    if args.search and storage not in ("", "auto"):
        raise UsageError("--storage with --search: give --storage auto (search storage rules too) or drop "
                         "--storage; explicit storage rules apply to the report of one --layout.")
    if storage == "auto" and not args.search:
        raise UsageError("--storage auto needs --search (it searches storage rules).")
    try:
        mesh = MeshSpec(args.mesh).shape
    except ShapeError as e:
        raise UsageError(f"--mesh {args.mesh!r}: {e} Mesh axis sizes must be positive integers.") from None
    layout = "" if args.search and args.layout == DEFAULT_LAYOUT else args.layout
    try:
        cfg = _config(args, 1, layout)
    except ValueError as e:  # LMConfig's pipeline checks, naming the field
        raise UsageError(f"--layout {args.layout!r} with --microbatches/--pipeline-repeats/--layers: {e}") from None
    if not cfg.pipelined and not args.search and ((getattr(args, "microbatches", None) or 1) > 1
                                                  or (getattr(args, "pipeline_repeats", None) or 1) > 1):
        raise UsageError("--microbatches/--pipeline-repeats need a pipeline: add the layout rule stage:<mesh axis> "
                         "(e.g. --mesh pipe:2 --layout stage:pipe) or --pipeline-stages > 1.")
    name = getattr(args, "pipeline_schedule", None)
    if name is not None and args.search:
        raise UsageError(f"--pipeline-schedule {name} plans one --layout; drop it with --search.")
    if name is not None:  # refused here, before the model is built, naming the flag
        schedule_flag(name, cfg.pipeline_stages, cfg.microbatches, cfg.pipeline_repeats)
    small = cfg.pipeline_stages * cfg.pipeline_repeats if cfg.pipelined else 1  # a pipeline needs S*R layers
    cfg = preset(args.preset, **{**cfg.to_dict(), "num_layers": small})
    names = set()
    for op in build_lm(cfg).graph.operations:
        for t in op.outputs:
            names.update(d.name for d in t.shape)
    if not (args.search and args.layout == DEFAULT_LAYOUT):  # train's default is only placed in a search
        check_rules_strict(args.layout, names, mesh, flag="--layout")
    if storage != "auto":
        check_rules_strict(storage, names, mesh, flag="--storage")


def _check_accumulate(args) -> None:
    """``--accumulate N``: a whole number >= 1 dividing the batch, for one ``--layout`` without a pipeline.

    Raises:
        UsageError: naming ``--accumulate``.
    """
    n = getattr(args, "accumulate", 1)
    if n == 1:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"--accumulate must be an integer >= 1 (microbatches per optimizer step), got {n!r}.")
    batch = preset(args.preset, batch_size=args.batch_size).batch_size
    if batch % n:
        raise UsageError(f"--accumulate {n} does not divide --batch-size {batch}; give a --batch-size that is a "
                         f"multiple of {n}.")
    if args.search or "stage" in dict(LayoutRules(args.layout).pairs) or getattr(args, "pipeline_stages", None):
        raise UsageError(f"--accumulate {n} plans one --layout without a pipeline; drop --search / the 'stage' rule "
                         "(a pipeline splits the batch into --microbatches itself).")


def _optimizer(args):
    """A factory of ``--optimizer``'s optimizer as ``meshtorch train`` builds it (None: AdamW)."""
    name = getattr(args, "optimizer", "adamw")
    flags = SimpleNamespace(optimizer=name, lr=6e-3, weight_decay=0.0, schedule="constant", steps=2, warmup_steps=1)
    return lambda: make_optimizer(flags)  # the state's size does not depend on the rates


def _train_lm(args, cfg):
    """The training graph ``meshtorch train`` would build for ``cfg`` with ``--optimizer``, ``--accumulate`` and
    ``--precision``."""
    return training_lm(cfg, _optimizer(args), getattr(args, "accumulate", 1), _policy(args))


def hardware_cost_model(args) -> tuple[CostModel, str]:
    """The cost model of ``--hardware`` with the ``--flop-rate``/``--bandwidth``/``--latency`` overrides, and
    the hardware's name. ``args.cost_model`` (a measured model, set by ``meshtorch plan`` from the calibration
    cache, :mod:`meshtorch.runtime.calibrate`) wins over the fixed constants of ``auto``/``gpu``/``cpu``
    (``auto``: GPU if CUDA is available, else CPU)."""
    measured = getattr(args, "cost_model", None)
    if measured is not None:
        base, hw = measured, measured.name or "calibrated"
    else:
        hw = args.hardware
        if hw in ("auto", "calibrated"):
            hw = "gpu" if torch.cuda.is_available() else "cpu"
        base = CostModel.cpu() if hw == "cpu" else CostModel()
        hw = f"{hw} (fixed constants, not measured: run 'meshtorch plan --calibrate' to measure this machine)"
    return replace(base, flop_rate=args.flop_rate or base.flop_rate, bandwidth=args.bandwidth or base.bandwidth,
                   latency=args.latency if args.latency is not None else base.latency), hw


def main_plan(args) -> list:
    """Print the plan (or the ranked layouts) for the parsed ``meshtorch plan`` arguments; returns
    ``[(layout, MemoryReport)]``.

    Raises:
        UsageError / LayoutError: from :func:`check_args`, before the model is built; LayoutError naming
            ``--layout`` if it is illegal for the model.
    """
    check_args(args)
    cost, hw = hardware_cost_model(args)
    storage = getattr(args, "storage", "") or ""
    limit = parse_bytes(args.memory_limit) if getattr(args, "memory_limit", None) else None
    if not args.search:  # an illegal layout is refused before anything is printed
        spec = MeshSpec(args.mesh, args.layout, storage=storage or None)
        lm = _train_lm(args, _config(args, spec.axis_size_for("vocab"), args.layout))
        try:
            plan(lm.graph, [lm.loss] + lm.updates, {lm.mesh: spec})
        except LayoutError as e:
            raise LayoutError(f"--layout {args.layout!r} is illegal for this model: {e}") from None
    try:
        ranked = plan_lm(lambda multiple: _config(args, multiple, None if args.search else args.layout), args.mesh,
                         args.layout, storage=storage, memory_limit=limit, search=args.search, top=args.top,
                         cost=cost, hardware=hw, microbatches=getattr(args, "microbatches", None),
                         schedule=getattr(args, "schedule", False), optimizer=_optimizer(args),
                         accumulate=getattr(args, "accumulate", 1), precision=_policy(args),
                         options=backend_options(getattr(args, "backend", "placement")),
                         pipeline_schedule=getattr(args, "pipeline_schedule", None))
    except ValueError as e:
        raise UsageError(f"--search: {e}") from None
    if args.search:
        print(why_line(ranked))
        print(your_layout_line(args, ranked, cost))
    elif getattr(args, "pipeline_schedule", None) and ranked[0][1].pipeline is not None:
        try:  # what the stage executor of meshtorch train --pipeline-schedule computes per rank
            print(pipeline_train.plan_line(args.pipeline_schedule, lm.config, args.mesh, args.layout, storage,
                                           ranked[0][1].flops_per_processor))
        except UsageError as e:
            print(f"  stage executor: not planned ({e})")
    return ranked


def your_layout_line(args, ranked, cost) -> str:
    """Where ``--layout`` (the user's, or train's default) ranks among ``ranked``."""
    mine = LayoutRules(args.layout)
    pos = next((i for i, (lay, _) in enumerate(ranked) if LayoutRules(lay) == mine), None)
    if pos is not None:
        t = ranked[pos][1].estimated_time
        return (f"--layout {args.layout!r} (yours, or train's default): rank {pos + 1} of {len(ranked)}, "
                f"{t['total_s'] * 1e3:.3f} ms")
    # not among the candidates tried: lower it and place it by its estimated time
    spec = MeshSpec(args.mesh, args.layout)
    lm = _train_lm(args, _config(args, spec.axis_size_for("vocab"), args.layout))
    try:
        program = plan(lm.graph, [lm.loss] + lm.updates, {lm.mesh: spec})
    except LayoutError as e:
        return f"--layout {args.layout!r} (yours, or train's default): illegal on this model ({e})"
    rep = memory_report(program)
    rep.estimated_time = estimate_time(rep, cost.for_dtype(_policy(args).compute_dtype))  # as plan_lm prices
    t = rep.estimated_time["total_s"]
    pos = sum(r.estimated_time["total_s"] < t for _, r in ranked)
    return (f"--layout {args.layout!r} (yours, or train's default): rank {pos + 1} of {len(ranked) + 1}, "
            f"{t * 1e3:.3f} ms ({rep.estimated_time['compute_s'] * 1e3:.3f} compute, "
            f"{rep.estimated_time['comm_s'] * 1e3:.3f} comm), {rep.total_bytes / 2 ** 20:.1f} MiB/proc")

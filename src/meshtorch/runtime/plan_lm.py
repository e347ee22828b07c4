"""Memory, FLOPs and communication of one LM training step, before running it: :func:`plan_lm`.

:func:`plan_lm` builds the LM training graph (AdamW), plans it (:func:`meshtorch.lowering.stages.plan`: no
backend, no variable storage, nothing runs) and prints the :func:`meshtorch.planning.memory_report`; with
``search`` it ranks every layout of the mesh with :func:`meshtorch.planning.search_layouts` and prints the
best ``top``. ``meshtorch plan`` (its parser :mod:`meshtorch.cli.plan`, its flags read by
:mod:`meshtorch.runtime.plan_command`) calls it.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from meshtorch.checkpoint import hf as hf_checkpoint
from meshtorch.core.errors import LayoutError
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.core.pipeline import resolve_pipeline_fields
from meshtorch.lowering.counters import _human
from meshtorch.lowering.stages import PlanOptions
from meshtorch.mesh.spmd import SpmdMeshImpl
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.transformer import REMAT_POLICIES, build_lm
from meshtorch.ops.precision import PrecisionPolicy
from meshtorch.optim.accumulate import build_training_graph
from meshtorch.optim.adam import AdamWOptimizer
from meshtorch.planning.budget import LEAN_GATHERS, MemoryLimitError, fit_memory_limit, plan_memory
from meshtorch.planning.cost import CostModel
from meshtorch.planning.pipeline import STAGE_DIM, pipeline_candidates, schedule_flag, schedule_table
from meshtorch.planning.search import layout_key, pipeline_layouts, search_layouts, trust_line

DEFAULT_MESH = "data:2,model:2"
DEFAULT_LAYOUT = "batch:data;heads:model;d_ff:model;vocab:model"
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30, "TIB": 2 ** 40}


def model_builder(cfg):
    """The graph builder of ``cfg``: :func:`~meshtorch.models.transformer.build_lm` for a native
    :class:`~meshtorch.models.transformer.LMConfig`, :func:`meshtorch.checkpoint.hf.build` for an imported model's
    :class:`~meshtorch.models.hf_config.HFModelConfig` (``meshtorch train --init-from``); both take
    ``optimizer=`` and ``precision=``."""
    return hf_checkpoint.build if isinstance(cfg, HFModelConfig) else build_lm


def training_lm(cfg, optimizer=None, accumulate: int = 1, precision=None):
    """The LM graph of one training run as ``meshtorch train`` builds it: ``cfg`` with ``optimizer()`` (a
    factory; None: AdamW), and with ``accumulate`` N > 1 the graph of one microbatch (``cfg.batch_size / N``
    rows) whose ``updates`` are the last microbatch's (the optimizer applied to the accumulated gradients,
    :func:`meshtorch.optim.accumulate.accumulated_updates`): its plan prices one microbatch's activations plus
    the float32 accumulators; ``precision``: the :class:`~meshtorch.ops.precision.PrecisionPolicy` (or its
    name) the model is built with."""
    opt = optimizer() if optimizer is not None else AdamWOptimizer(1e-3)
    return build_training_graph(model_builder(cfg), cfg, opt, accumulate, precision=precision)[0]


def backend_options(backend: str) -> PlanOptions | None:
    """The schedule ``--backend`` runs: ``placement`` (None: one process holds every processor, no buckets, as
    ``meshtorch train`` without torchrun); ``gloo``/``nccl``: one process per processor (in-place updates, as
    :mod:`meshtorch.lowering.donate` plans them) with the gradient buckets a default
    :class:`~meshtorch.Lowering` makes on :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` (25 MiB, a 1 MiB first; none
    for 16-bit reductions: :func:`~meshtorch.lowering.stages.default_buckets`, resolved when planned)."""
    if backend == "placement":
        return None
    return PlanOptions(bucket_bytes=SpmdMeshImpl.default_bucket_bytes, local=1, mesh_default=True)


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"512MB"``, ``"1e9"`` -> bytes.

    Raises:
        ValueError: naming the text, if it is not a number with an optional unit.
    """
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"--memory-limit: cannot read {text!r}; write e.g. 16GiB, 512MB or 1e9.")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def pipeline_fields(mesh_shape: str, layout: str, microbatches: int | None = None, repeats: int | None = None,
                    stages: int | None = None, num_layers: int | None = None) -> dict:
    """The LMConfig pipeline fields of the flags, as ``meshtorch train`` resolves them
    (:func:`meshtorch.core.pipeline.resolve_pipeline_fields` with the size of the mesh axis of the layout's
    ``stage:<axis>`` rule); ``{}`` (no pipeline) without a ``stage`` rule and ``stages``."""
    n = MeshSpec(mesh_shape, layout).axis_size_for(STAGE_DIM) if layout not in ("", "auto") else 1
    return resolve_pipeline_fields(n, stages, microbatches, repeats, num_layers)


def hardware_note(mesh_shape: str) -> str:
    """What the predicted times of a parallel (not ``serial``) cost model mean: each processor is a device of
    the cost model's speed, all working at once, the collectives on links of its bandwidth; the simulated
    mesh of ``meshtorch train`` (one process) runs the processors one after another on the host's cores, so
    its step takes about ``mesh size`` times the predicted compute, plus Python overhead (a calibrated
    ``--backend placement`` model predicts that step instead)."""
    n = 1
    for part in filter(None, mesh_shape.replace(";", ",").split(",")):
        n *= int(part.split(":")[1])
    return (f"times model {n} real processor(s) of the cost model's speed working in parallel (--hardware, "
            f"--flop-rate); the simulated mesh of `meshtorch train` (no torchrun) runs its {n} processor(s) one "
            f"after another in one process, so its step takes about {n}x the compute shown, plus Python overhead "
            "(meshtorch plan --calibrate --backend placement models that step)")


def why_line(ranked) -> str:
    """One line saying why the first layout of ``ranked`` (``[(layout, MemoryReport)]``) beats the second."""
    if len(ranked) < 2:
        return "why: it is the only legal layout."
    (a, ra), (b, rb) = ranked[0], ranked[1]
    ta, tb = ra.estimated_time, rb.estimated_time
    d_compute, d_comm = tb["compute_s"] - ta["compute_s"], tb["comm_s"] - ta["comm_s"]
    if abs(tb["total_s"] - ta["total_s"]) <= 1e-12:
        what = (f"the same estimated time, less memory per processor ({ra.total_bytes / 2 ** 20:.1f} vs "
                f"{rb.total_bytes / 2 ** 20:.1f} MiB)")
    elif d_compute >= d_comm:
        what = (f"less compute per processor ({ta['compute_s'] * 1e3:.3f} vs {tb['compute_s'] * 1e3:.3f} ms), "
                f"communication {ta['comm_s'] * 1e3:.3f} vs {tb['comm_s'] * 1e3:.3f} ms")
    else:
        what = (f"less communication ({ta['comm_s'] * 1e3:.3f} vs {tb['comm_s'] * 1e3:.3f} ms), compute "
                f"{ta['compute_s'] * 1e3:.3f} vs {tb['compute_s'] * 1e3:.3f} ms")
    return f"why: {a or '(replicated)'} beats {b or '(replicated)'} by {what}."


def _precision_words(precision) -> str:
    policy = PrecisionPolicy.of(precision)
    return "" if not policy.mixed else (f", {policy.name} (float32 masters, {policy.compute_dtype} compute, "
                                        f"gradients reduced in {policy.reduce_dtype})").replace("torch.", "")


def _fit(cfg, mesh_shape, layout, storage, memory_limit, cost, print_fn, train_lm=training_lm, options=None):
    """Over ``memory_limit``: the fastest ``--remat`` policy and storage rules that fit, printed (or why none
    does); returns its MemoryReport, or None."""
    def build(remat):
        lm = train_lm(replace(cfg, remat=remat))
        return lm.graph, lm.mesh, [lm.loss] + lm.updates
    remats = [cfg.remat] + [r for r in REMAT_POLICIES if r != cfg.remat]
    try:
        remat, st, rep = fit_memory_limit(build, remats, mesh_shape, layout, storage, memory_limit, cost, options)
    except MemoryLimitError as e:
        print_fn(f"over the memory limit: {e}")
        return None
    flags = f"--remat {remat}" + (f" --storage {st!r}" if st != storage else "")
    if rep.lean_gathers:  # no flag of its own: the mesh's MeshSpec fields
        flags += (" and without the kept forward gather and the prefetch of the weight gathers ("
                  + ", ".join(f"{k}={v!r}" for k, v in LEAN_GATHERS.items()) + " on the mesh)")
    print_fn(f"over the memory limit of {_human(memory_limit)} as asked; fits with {flags} (fastest that fits): "
             f"{_human(rep.total_bytes)} per processor, estimated {rep.estimated_time['total_s'] * 1e3:.3f} ms")
    print_fn(rep.summary())
    return rep


def plan_lm(config, mesh_shape: str, layout: str = DEFAULT_LAYOUT, storage: str = "", memory_limit: int | None = None,
            search: bool = False, top: int = 10, cost: CostModel | None = None, print_fn=print,
            hardware: str = "", microbatches: int | None = None, schedule: bool = False,
            pipelines: bool = True, optimizer=None, accumulate: int = 1, precision=None, options=None,
            pipeline_schedule: str | None = None) -> list:
    """What ``meshtorch plan`` prints for an LM AdamW training step: the memory report of one layout, or
    (``search``) the ranked layouts of the mesh.

    Args:
        config: an :class:`~meshtorch.models.transformer.LMConfig`, or ``fn(vocab_multiple) -> LMConfig``
            (the vocab is padded to a multiple of the mesh axis that splits it).
        mesh_shape, layout: mesh and compute rules (``layout`` unused with ``search``).
        storage: storage rules (FSDP / ZeRO-3, e.g. ``"d_model:data"``); with ``search``, ``"auto"``
            (or any ``memory_limit``) also searches storage rules
            (:func:`~meshtorch.planning.search.storage_candidates`), else only the given ones.
        memory_limit: bytes per processor. Without ``search``: a configuration over it is reported with
            the :class:`~meshtorch.planning.budget.MemoryLimitError` message (the limit, the prediction,
            a storage rule that fits). With ``search``: layouts over it are dropped.
        cost: the :class:`CostModel` (default ``CostModel()``); ``hardware``: its name, printed.
        microbatches: with ``search`` (and ``pipelines``), the microbatches of the pipelined candidates
            (:func:`~meshtorch.planning.pipeline.pipeline_candidates`; None: the largest divisor of the batch up to
            4 x the stages).
        schedule: print the pipeline schedule table (:func:`~meshtorch.planning.pipeline.schedule_table`) of a
            pipelined ``config`` (no ``search``): ``pipeline_schedule``'s table if given, else the layout's.
        pipeline_schedule: a name of :data:`~meshtorch.core.schedules.SCHEDULES` (no ``search``): the report's
            pipeline section gets that schedule's bubble and in-flight microbatches
            (:meth:`~meshtorch.planning.pipeline.PipelinePlan.with_schedule`).
        pipelines: with ``search``, also rank pipelined variants of the model: for every mesh axis whose size
            divides the layers, the layers stacked on ``stage`` split over that axis (``stage:<axis>`` plus the
            layouts of the other axes; ``report.pipeline`` says S, M and R).
        optimizer: a factory of the :mod:`meshtorch.optim` optimizer to plan (None: AdamW).
        accumulate: gradient accumulation over N microbatches of ``config.batch_size / N`` rows
            (:func:`training_lm`; ``meshtorch train --accumulate``).
        precision: the :class:`~meshtorch.ops.precision.PrecisionPolicy` (or its name) the model is built with:
            under bf16 activations, gathered weights and (with a bfloat16 ``reduce_dtype``) gradient reductions
            are priced at 2 bytes per element, masters and optimizer state at 4, and the FLOPs at ``cost``'s rate of
            the compute dtype (:meth:`~meshtorch.planning.cost.CostModel.for_dtype`; float32's where none was
            measured, which the header says).
        options: the :class:`~meshtorch.lowering.stages.PlanOptions` of the report of one layout and of the
            ``memory_limit`` fit (``meshtorch plan --backend gloo``: one process per processor, in-place
            updates, the SPMD mesh's gradient buckets, :func:`backend_options`); default the placement mesh's.
            ``search`` plans the non-pipelined candidates with it too, so their collectives are priced per call
            the executor makes (a gradient bucket once); pipelined candidates are planned as the placement
            mesh runs them.

    Returns:
        ``[(layout, MemoryReport)]`` (one entry without ``search``; ``report.storage`` holds the storage rules,
        ``report.pipeline`` the schedule of a pipelined layout).

    Raises:
        SystemExit: naming the layout, if it is illegal, or if no layout fits ``memory_limit`` in a search.
    """
    cost = (cost or CostModel()).for_dtype(PrecisionPolicy.of(precision).compute_dtype)  # FLOPs in the compute dtype
    spec = MeshSpec(mesh_shape, "" if search else layout)
    if search:  # the vocab must be divisible by whichever axis the search puts it on
        multiple = math.lcm(*[d.size for d in spec.shape]) if spec.shape.ndims else 1
    else:
        multiple = spec.axis_size_for("vocab")
    cfg = config(multiple) if callable(config) else config

    def train_lm(c):
        return training_lm(c, optimizer, accumulate, precision)
    lm = train_lm(cfg)
    n_params = sum(v.shape.size for v in lm.graph.trainable_variables)
    micro = f" ({accumulate} microbatches of {cfg.batch_size // accumulate})" if accumulate > 1 else ""
    opt_name = type(optimizer()).__name__.replace("Optimizer", "") if optimizer is not None else "AdamW"
    print_fn(f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads x d_kv {cfg.d_kv}, "
             f"d_ff {cfg.d_ff}, vocab {cfg.padded_vocab}, {n_params / 1e6:.2f}M parameters; batch {cfg.batch_size}"
             f"{micro} x length {cfg.length}; {opt_name} training step{_precision_words(precision)}; "
             f"mesh {mesh_shape!r}")
    hw = f" ({hardware})" if hardware else ""
    extra = f", {cost.kernel_overhead * 1e6:.1f} us per kernel call" if cost.kernel_overhead else ""
    how = ("processors simulated one after another in one process (placement mesh): step time = the sum over "
           "processors" if cost.serial else "processors run in parallel (one process per processor, or real "
           "hardware): step time = one processor's work plus the collectives")
    rate = f"{cost.compute_dtype} " + ("" if cost.measured_dtype else "(float32's rate, not measured) ")
    print_fn(f"cost model{hw}: {cost.flop_rate:.3g} {rate}FLOP/s, {cost.bandwidth:.3g} B/s, {cost.latency:.3g} s per "
             f"collective{extra}; {how} (dry run: nothing allocated or executed)")
    if not cost.serial:
        print_fn(hardware_note(mesh_shape))
    fetches = [lm.loss] + lm.updates
    if not search:
        st = "" if storage == "auto" else storage
        try:
            rep = plan_memory(lm.graph, lm.mesh, fetches, mesh_shape, layout, st, cost, options)
        except LayoutError as e:
            raise SystemExit(f"meshtorch plan: illegal layout {layout!r} / storage {st!r}: {e}") from None
        table = None
        if pipeline_schedule is not None and rep.pipeline is not None:
            p = rep.pipeline
            table = schedule_flag(pipeline_schedule, p.stages, p.microbatches, p.repeats)
            rep = replace(rep, pipeline=p.with_schedule(table))
        print_fn(rep.summary())
        if schedule and lm.pipeline is not None:
            print_fn(table.markdown() if table is not None else schedule_table(lm.pipeline))
        if memory_limit is not None and rep.total_bytes > memory_limit:
            rep = _fit(cfg, mesh_shape, layout, st, memory_limit, cost, print_fn, train_lm, options) or rep
        return [(layout, rep)]
    if storage == "auto" or (memory_limit is not None and not storage):
        storage_rules = "auto"
    else:
        storage_rules = [storage] if storage else None
    piped, failure, stage_sizes = [], None, set()
    for axis, pcfg in pipeline_candidates(cfg, mesh_shape, microbatches) if pipelines else []:
        if pcfg.pipeline_stages in stage_sizes:
            # a stage axis of the size of one searched: its layouts are that search's with the two axes swapped,
            # of the same times, and the ranking below keeps one of each such pair (the first searched)
            continue
        stage_sizes.add(pcfg.pipeline_stages)
        plm = train_lm(pcfg)
        pfetches = [plm.loss] + plm.updates
        try:
            piped += search_layouts(lambda plm=plm: plm, mesh_shape, pipeline_layouts(plm.graph, mesh_shape, axis),
                                    memory_limit_bytes=memory_limit, fetches_fn=lambda m, f=pfetches: f, cost=cost,
                                    storage_rules=storage_rules)
        except ValueError as e:
            failure = e
    remats = [cfg.remat] + ([r for r in REMAT_POLICIES if r != cfg.remat] if memory_limit is not None else [])
    for k, remat in enumerate(remats):  # a heavier --remat only when no layout fits the limit without it
        lm_r = lm if k == 0 else train_lm(replace(cfg, remat=remat))
        try:
            plain = search_layouts(lambda lm_r=lm_r: lm_r, mesh_shape, memory_limit_bytes=memory_limit,
                                   fetches_fn=lambda m, lm_r=lm_r: [lm_r.loss] + lm_r.updates, cost=cost,
                                   storage_rules=storage_rules, options=options)
        except ValueError as e:
            plain, failure = [], e
        if plain or piped:  # a pipeline that fits needs no heavier remat
            break
    if not plain and not piped:
        raise SystemExit(f"meshtorch plan: {failure} (tried --remat {', '.join(remats)})") from None
    if remat != cfg.remat and plain:
        print_fn(f"no layout fits {_human(memory_limit)} with --remat {cfg.remat}; with --remat {remat}:")
        for _, rep in plain:
            rep.remat = remat
    ranked = sorted(plain + piped, key=lambda r: (r[1].estimated_time["total_s"], r[1].total_bytes))
    sizes, seen, unique = {d.name: d.size for d in spec.shape}, set(), []
    for lay, r in ranked:  # the pipelined searches ran apart: drop their mesh-axis swaps here
        key = (layout_key(lay, r.storage, sizes), r.pipeline is not None)
        if key not in seen:
            seen.add(key)
            unique.append((lay, r))
    ranked = unique
    within = f" within {_human(memory_limit)}" if memory_limit is not None else ""
    print_fn(f"{len(ranked)} legal layouts{within}; best {top}:")
    print_fn(f"  {'rank':>4}  {'layout':<50}{'time ms':>10}{'compute':>10}{'comm':>10}"
             f"{'memory/proc':>13}{'comm/proc':>12}  storage; pipeline")
    for i, (lay, r) in enumerate(ranked[:top]):
        t = r.estimated_time
        comm = sum(b for _, b in r.communication().values())
        print_fn(f"  {i + 1:>4}  {lay or '(replicated)':<50}{t['total_s'] * 1e3:>10.3f}"
                 f"{t['compute_s'] * 1e3:>10.3f}{t['comm_s'] * 1e3:>10.3f}{r.total_bytes / 2 ** 20:>10.1f} MiB"
                 f"{comm / 2 ** 20:>8.2f} MiB  {r.storage or '-'}"
                 + (f"; {r.pipeline.describe()}" if r.pipeline else ""))
    print_fn(trust_line(ranked[:top], cost))
    return ranked

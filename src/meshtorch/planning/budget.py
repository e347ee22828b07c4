"""A per-processor memory budget checked before anything is allocated (:func:`check_memory_limit`).

The check plans the training step (:func:`meshtorch.lowering.stages.plan`: no backend, no variable
storage), so a configuration too large for the machine fails in seconds with a message that names the
limit, the predicted bytes per processor and a storage rule (FSDP / ZeRO-3) that would fit, instead of
running out of memory after allocating. ``meshtorch train`` / ``meshtorch plan`` and
``benchmarks/fsdp_memory.py`` call it. :func:`fit_memory_limit` goes further: over the limit, it tries the
variants of a graph (``meshtorch plan``: the LM's activation-checkpointing policies, ``--remat``) with the
given storage rules and with each storage candidate, and with the weight gathers of :data:`LEAN_GATHERS` (no
kept forward gather, no prefetch: the FSDP schedule of least memory), and returns the fastest configuration that
fits.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshtorch.core.errors import LayoutError, MeshtorchError
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering.counters import _human
from meshtorch.lowering.stages import PlanOptions, plan
from meshtorch.planning.cost import CostModel, estimate_time
from meshtorch.planning.memory import MemoryReport, memory_report
from meshtorch.planning.search import storage_candidates

__all__ = ["LEAN_GATHERS", "MemoryLimitError", "check_memory_limit", "fit_memory_limit", "plan_memory"]

#: The :class:`~meshtorch.core.mesh_spec.MeshSpec` fields of the FSDP weight-gather schedule of least memory: every
#: weight resharded after the forward pass (also the output projection, whose forward gather the default keeps
#: for the backward pass) and no gather issued ahead of its use (the default prefetches one). It costs one more
#: all-gather per kept weight and the overlap of the prefetch; it matters only under storage rules.
LEAN_GATHERS = {"reshard_after_forward": "always", "prefetch": 0}


class MemoryLimitError(MeshtorchError, ValueError):
    """The planned per-processor memory of a configuration exceeds the given limit.

    Attributes:
        limit: the limit in bytes; ``report``: the :class:`MemoryReport` over it; ``suggestion``:
        ``(storage rules, MemoryReport)`` of a storage rule that fits, or None.
    """

    def __init__(self, message: str, limit: int, report: MemoryReport, suggestion=None):
        super().__init__(message)
        self.limit, self.report, self.suggestion = limit, report, suggestion


def _join(storage: str, extra: str) -> str:
    return ";".join(r for r in (storage, extra) if r)


def plan_memory(graph, mesh, fetches, mesh_shape, layout: str = "", storage: str = "",
                cost: CostModel | None = None, options: PlanOptions | None = None,
                lean_gathers: bool = False) -> MemoryReport:
    """The :class:`MemoryReport` of one ``run(fetches)`` of ``graph`` on ``mesh_shape`` with compute rules
    ``layout`` and storage rules ``storage`` (dry run: nothing allocated), with its estimated time.
    ``options``: the schedule planned (:class:`~meshtorch.lowering.stages.PlanOptions`: buckets, one process
    per processor or one for all); default the placement mesh's. ``lean_gathers``: the weight gathers of
    :data:`LEAN_GATHERS` (else the MeshSpec defaults).

    Raises:
        LayoutError: naming the tensor and dimension, if the rules are illegal for the graph.
    """
    spec = MeshSpec(mesh_shape, layout, storage=storage, **(LEAN_GATHERS if lean_gathers else {}))
    rep = memory_report(plan(graph, fetches, {mesh: spec}, options))
    rep.layout, rep.storage, rep.lean_gathers = layout, storage, lean_gathers
    rep.estimated_time = estimate_time(rep, cost or CostModel())
    return rep


def _breakdown(r: MemoryReport) -> str:
    return (f"parameters {_human(r.parameter_bytes)}, gradients {_human(r.gradient_bytes)}, optimizer state "
            f"{_human(r.optimizer_state_bytes)}, peak activations {_human(r.peak_activation_bytes)}")


def check_memory_limit(graph, mesh, fetches, mesh_shape, layout: str = "", storage: str = "",
                       memory_limit: int | None = None, candidates: Sequence[str] | None = None,
                       cost: CostModel | None = None, options: PlanOptions | None = None,
                       lean_gathers: bool = False) -> MemoryReport:
    """Plan ``fetches`` (e.g. ``[loss] + updates``) and fail before training if over ``memory_limit``.

    Args:
        graph, mesh: the model's graph and its Mesh.
        mesh_shape, layout, storage: the mesh shape, compute rules and storage rules to be used.
        memory_limit: bytes per processor (None: no check, the report is returned).
        candidates: storage rules to suggest from (added to ``storage``); default
            :func:`~meshtorch.planning.search.storage_candidates` (``d_model:<axis>`` first).
        cost: the cost model ranking the storage rules that fit (default :class:`CostModel`).
        options, lean_gathers: the schedule planned (:func:`plan_memory`).

    Returns:
        The :class:`MemoryReport` of the configuration (it fits).

    Raises:
        MemoryLimitError: the predicted ``total_bytes`` per processor exceed ``memory_limit``; the
            message names the limit, the prediction (with its breakdown) and the fastest storage
            rule that fits (by estimated time), or says that none of the candidates does.
        LayoutError: the rules are illegal for the graph.
    """
    rep = plan_memory(graph, mesh, fetches, mesh_shape, layout, storage, cost, options, lean_gathers)
    if memory_limit is None or rep.total_bytes <= memory_limit:
        return rep
    cands = storage_candidates(graph, mesh_shape, layout) if candidates is None else list(candidates)
    fits, smallest = [], None
    named = {r.split(":")[0].strip() for r in storage.replace(",", ";").split(";") if r.strip()}
    for extra in cands:
        if extra.split(":")[0].strip() in named:  # the storage rules already place this dimension
            continue
        st = _join(storage, extra)
        try:
            r = plan_memory(graph, mesh, fetches, mesh_shape, layout, st, cost, options, lean_gathers)
        except LayoutError:
            continue
        if smallest is None or r.total_bytes < smallest[1].total_bytes:
            smallest = (st, r)
        if r.total_bytes <= memory_limit:
            fits.append((st, r))
    where = (f"mesh {str(mesh_shape)!r}, layout {layout!r}" + (f", storage {storage!r}" if storage else
                                                                ", no storage rules"))
    msg = (f"memory limit exceeded before training: predicted {_human(rep.total_bytes)} ({rep.total_bytes} bytes) "
           f"per processor ({_breakdown(rep)}) on {where}, over the limit of {_human(memory_limit)} "
           f"({memory_limit} bytes).")
    best = None
    if fits:
        best = min(fits, key=lambda sr: (sr[1].estimated_time["total_s"], sr[1].total_bytes))
        msg += (f" Storage rule {best[0]!r} would fit: {_human(best[1].total_bytes)} per processor "
                f"({_breakdown(best[1])}); pass storage={best[0]!r} (meshtorch: --storage {best[0]!r}).")
    elif smallest is not None:
        msg += (f" No single storage rule fits; the smallest, {smallest[0]!r}, needs {_human(smallest[1].total_bytes)} "
                "per processor: use more processors, a smaller batch, or split the model over more mesh axes.")
    else:
        msg += " No storage rule applies: use more processors, a smaller batch or a smaller model."
    raise MemoryLimitError(msg, memory_limit, rep, best)


def fit_memory_limit(build, options: Sequence, mesh_shape, layout: str = "", storage: str = "",
                     memory_limit: int | None = None, cost: CostModel | None = None,
                     plan_options: PlanOptions | None = None):
    """The fastest configuration within ``memory_limit``: a graph variant and storage rules.

    Each of ``options`` (e.g. activation-checkpointing policies ``("none", "selective", "block")``) names a
    variant of the graph; ``build(option)`` returns its ``(graph, mesh, fetches)``. The first option is
    the one asked for: if it fits with ``storage``, it is returned. Otherwise every option is planned with
    ``storage`` and, where that does not fit, with ``storage`` plus each storage candidate
    (:func:`check_memory_limit`'s suggestion); of the configurations that fit, the one with the smallest
    estimated time (then fewest bytes) wins, so recomputation is chosen only where it is cheaper than
    sharding or where nothing else fits (the planner's memory walk and FLOP count both see the
    recomputed steps). Where storage rules apply, each option is also planned with the weight gathers of
    :data:`LEAN_GATHERS` (no kept forward gather, no prefetch), which compete the same way: the report says
    so (``lean_gathers``). ``plan_options``: the schedule planned (:func:`plan_memory`).

    Returns:
        ``(option, storage rules, MemoryReport)``.

    Raises:
        MemoryLimitError: no option fits, with or without a storage rule; the message is the first
            option's (limit, prediction, breakdown) plus the smallest configuration found.
        LayoutError: the rules are illegal for the graph.
    """
    options = list(options)
    fits, first_error, smallest = [], None, None
    for i, opt in enumerate(options):
        graph, mesh, fetches = build(opt)
        for lean in (False, True):
            try:
                rep = check_memory_limit(graph, mesh, fetches, mesh_shape, layout, storage, memory_limit, cost=cost,
                                         options=plan_options, lean_gathers=lean)
                if i == 0 and not lean:
                    return opt, storage, rep
                fits.append((opt, storage, rep))
            except MemoryLimitError as e:
                first_error = first_error or e
                if smallest is None or e.report.total_bytes < smallest[2].total_bytes:
                    smallest = (opt, storage, e.report)
                if e.suggestion is not None:
                    fits.append((opt, e.suggestion[0], e.suggestion[1]))
    if fits:
        return min(fits, key=lambda f: (f[2].estimated_time["total_s"], f[2].total_bytes))
    raise MemoryLimitError(f"{first_error} With every option of {options}: none fits; the smallest without a "
                           f"storage rule is {smallest[0]!r}, {_human(smallest[2].total_bytes)} per processor.",
                           memory_limit, first_error.report)

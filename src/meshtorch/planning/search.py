"""Layout search: enumerate layout rules for a mesh, drop the illegal ones and those over a memory
limit, rank the rest by estimated time (:func:`search_layouts`).

Mesh TensorFlow's ``auto_mtf`` chooses layouts with an integer linear program over a memory
estimate; we do an exhaustive search over one-dimension-per-mesh-axis assignments with an
explicit time model instead (simple, and exact for the small meshes it allows).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace

from meshtorch.core.errors import LayoutError
from meshtorch.core.graph import Mesh
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering.counters import _human
from meshtorch.lowering.stages import PlanOptions, plan
from meshtorch.planning.cost import CostModel, estimate_time
from meshtorch.planning.memory import MemoryReport, memory_report


def graph_dimensions(graph) -> list[str]:
    """Names of every dimension of every tensor of ``graph``, in order of first appearance."""
    names: dict[str, None] = {}
    for op in graph.operations:
        for t in op.outputs:
            for d in t.shape:
                names.setdefault(d.name, None)
    return list(names)


def candidate_layouts(dim_names: Sequence[str], mesh_axes: Sequence[str], dim_sizes: dict | None = None,
                      axis_sizes: dict | None = None) -> list[str]:
    """All layout rules giving each mesh axis at most one dimension (each dimension at most one
    axis), in order of ``dim_names`` per axis (the all-replicated ``""`` last).

    With sizes (``dim_sizes``: name -> set of sizes; ``axis_sizes``: axis -> size), dims not
    divisible by an axis are skipped, and of the rules that differ only by swapping mesh axes of
    equal size (``batch:data;heads:model`` vs ``heads:data;batch:model`` on a 2x2 mesh) only the
    first is kept: the cost model cannot tell them apart.
    """
    out, seen = [], set()
    options = [[*dim_names, None] for _ in mesh_axes]
    for combo in itertools.product(*options):
        used = [d for d in combo if d is not None]
        if len(used) != len(set(used)):
            continue
        if axis_sizes:
            key = frozenset((d, axis_sizes[a]) for d, a in zip(combo, mesh_axes, strict=True) if d is not None)
            if key in seen:
                continue
            seen.add(key)
        if dim_sizes and axis_sizes and any(
                d is not None and any(s % axis_sizes[a] for s in dim_sizes.get(d, ()))
                for d, a in zip(combo, mesh_axes, strict=True)):
            continue
        out.append(";".join(f"{d}:{a}" for d, a in zip(combo, mesh_axes, strict=True) if d is not None))
    return out


def pipeline_layouts(graph, mesh_shape, axis: str, stage_dim: str = "stage") -> list[str]:
    """Layout rules of a pipelined ``graph`` that split ``stage_dim`` over mesh axis ``axis``: ``stage:<axis>``
    alone, then with each :func:`candidate_layouts` rule set of the other axes (dims not divisible skipped).

    Raises:
        ValueError: ``axis`` is not an axis of ``mesh_shape``, or the graph has no ``stage_dim``.
    """
    axis_sizes = {d.name: d.size for d in MeshSpec(mesh_shape).shape}
    if axis not in axis_sizes:
        raise ValueError(f"pipeline_layouts: mesh {mesh_shape!r} has no axis {axis!r}.")
    names = graph_dimensions(graph)
    if stage_dim not in names:
        raise ValueError(f"pipeline_layouts: the graph has no dimension {stage_dim!r} (not pipelined).")
    sizes: dict[str, set] = defaultdict(set)
    for op in graph.operations:
        for t in op.outputs:
            for d in t.shape:
                sizes[d.name].add(d.size)
    others = [a for a in axis_sizes if a != axis]
    rest = candidate_layouts([n for n in names if n != stage_dim], others, sizes,
                             {a: axis_sizes[a] for a in others}) if others else [""]
    return [";".join(filter(None, (f"{stage_dim}:{axis}", r))) for r in rest]


def storage_candidates(graph, mesh_shape, layout: str = "") -> list[str]:
    """Single storage rules worth trying for ``graph`` on ``mesh_shape`` (FSDP / ZeRO-3 candidates).

    One ``"dim:axis"`` rule for every dimension of a trainable variable and every mesh axis of size
    > 1 that divides it, skipping rules the compute ``layout`` already holds; ``d_model`` first (it is
    in every weight of a Transformer, so ``d_model:<data axis>`` shards all of them), then in the order
    the dims first appear in the variables. Levanter's parameter axis mapping vs compute mapping.
    """
    sizes = {d.name: d.size for d in MeshSpec(mesh_shape).shape if d.size > 1}
    compute = set(_rule_pairs(layout))
    dims: dict[str, set] = {}
    for v in graph.trainable_variables:
        for d in v.outputs[0].shape:
            dims.setdefault(d.name, set()).add(d.size)
    order = sorted(dims, key=lambda n: (n != "d_model", list(dims).index(n)))
    return [f"{d}:{a}" for d in order for a, n in sizes.items()
            if (d, a) not in compute and all(s % n == 0 for s in dims[d])]


def layout_key(rules: str, storage: str, axis_sizes: dict) -> frozenset:
    """What a layout and its storage rules are up to swapping mesh axes of one size (the cost model cannot tell
    ``batch:data;heads:model`` from ``heads:data;batch:model`` on a 2x2 mesh): per mesh axis, its size and the
    sets of compute and storage dims it splits. ``axis_sizes``: ``{mesh axis: size}``."""
    groups = defaultdict(lambda: (set(), set()))  # mesh axis -> (compute dims, storage dims)
    for which, text in ((0, rules), (1, storage)):
        for d, a in _rule_pairs(text):
            groups[a][which].add(d)
    return frozenset((axis_sizes.get(a, a), frozenset(c), frozenset(st)) for a, (c, st) in groups.items())


def _rule_pairs(rules: str) -> list[tuple[str, str]]:
    return [tuple(p.split(":")) for p in rules.replace(",", ";").split(";") if p.strip()]


def _rules_str(pairs, dim_names: Sequence[str], axes: Sequence[str]) -> str:
    """Canonical rule text: by mesh axis, then by the dims' order in the graph."""
    def pos(seq, x):
        return list(seq).index(x) if x in seq else len(seq)

    pairs = sorted(pairs, key=lambda p: (pos(axes, p[1]), pos(dim_names, p[0]), p))
    return ";".join(f"{d}:{a}" for d, a in pairs)


def _default_fetches(built):
    if isinstance(built, tuple):
        return built[2]
    fetches = [built.loss]
    fetches += list(getattr(built, "updates", []) or [])
    return fetches


def search_layouts(build_fn: Callable, mesh_shape, candidate_rules: Sequence[str] | None = None,
                   memory_limit_bytes: int | None = None, fetches_fn: Callable | None = None,
                   cost: CostModel | None = None, max_candidates: int = 256,
                   refine: int | None = None, storage_rules: Sequence[str] | None = None,
                   storage_top: int = 4, options: PlanOptions | None = None) -> list[tuple[str, MemoryReport]]:
    """Rank layout rules for a model on a mesh by estimated step time (best first).

    Args:
        build_fn: ``build_fn()`` returns the model: a tuple ``(graph, mesh, fetches)``, or an
            object with ``.graph``, ``.mesh`` and ``.loss`` (and optionally ``.updates``), such as
            :class:`~meshtorch.models.transformer.LMGraph`. Called once; every candidate lowers
            the same graph (dry run, no variable storage).
        mesh_shape: e.g. ``"data:2,model:2"`` (at most 3 axes for the default candidates).
        candidate_rules: layout-rule strings to try; default :func:`candidate_layouts` of the
            graph's dimension names over the mesh axes (the replicated layout included).
        memory_limit_bytes: drop layouts whose per-processor ``MemoryReport.total_bytes`` exceeds it.
        fetches_fn: ``fetches_fn(model) -> fetches`` (default: the tuple's third item, or
            ``[model.loss] + model.updates``).
        cost: the :class:`CostModel` (default ``CostModel()``).
        max_candidates: try at most this many candidates (in enumeration order).
        refine: then improve the best ``refine`` layouts greedily: add the one ``dim:axis`` rule
            (several dims may share an axis, e.g. ``heads:model;d_ff:model``) that lowers the
            estimated time most (or, over the memory limit, the memory), until none does. 0: off;
            default 3, or 0 when ``candidate_rules`` are given (only those are tried).
        storage_rules: storage rules to try as well (FSDP / ZeRO-3, see
            :meth:`meshtorch.mesh.base.MeshImpl`), e.g. ``["d_model:data"]``, or ``"auto"`` for
            :func:`storage_candidates` of the graph. Each is tried on the ``storage_top`` compute
            layouts of least estimated time and the ``storage_top`` of least activation memory
            (among those over ``memory_limit_bytes`` when it is given), so a layout over the limit
            can be brought under it by sharding its variables. Default None: variables are
            stored in their compute layout (no storage rules), as before.
        storage_top: how many compute layouts (by time, and by activation memory) get the storage candidates.
        options: the schedule each candidate is planned with (:class:`~meshtorch.lowering.stages.PlanOptions`;
            default None: the placement mesh's, one process, no buckets); an SPMD backend's (its gradient
            buckets) makes :func:`estimate_time` charge the latency per bucket call the executor makes.

    Returns:
        ``[(layout rules, MemoryReport)]`` of every legal layout tried that fits the limit (the
        storage rules of each are ``report.storage``, "" for none; one
        of each set equal up to swapping mesh axes of one size), sorted by
        ``report.estimated_time["total_s"]`` (ties:
        smaller ``total_bytes``). Illegal layouts (``LayoutError`` from the lowering: size not
        divisible, a dimension an op needs whole split, two dims of one tensor on one axis) are left out.

    Raises:
        ValueError: a default search on a mesh of more than 3 axes, or no legal candidate fits.
    """
    built = build_fn()
    graph, mesh = (built[0], built[1]) if isinstance(built, tuple) else (built.graph, built.mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"search_layouts: build_fn must give a Mesh, got {mesh!r}.")
    fetches = fetches_fn(built) if fetches_fn is not None else _default_fetches(built)
    cost = cost or CostModel()
    axis_sizes = {d.name: d.size for d in MeshSpec(mesh_shape).shape}
    default_candidates = candidate_rules is None
    if default_candidates:
        if len(axis_sizes) > 3:
            raise ValueError(f"search_layouts: the default exhaustive search allows at most 3 mesh axes, "
                             f"got {list(axis_sizes)}; pass candidate_rules.")
        sizes: dict[str, set] = defaultdict(set)
        for op in graph.operations:
            for t in op.outputs:
                for d in t.shape:
                    sizes[d.name].add(d.size)
        candidate_rules = candidate_layouts(graph_dimensions(graph), list(axis_sizes), sizes, axis_sizes)
    limit = memory_limit_bytes
    if refine is None:
        refine = 3 if default_candidates else 0
    scored: dict[tuple[str, str], MemoryReport | None] = {}
    planned: dict[frozenset, tuple[str, str]] = {}  # layout_key -> the (rules, storage) planned for it

    def score(rules: str, storage: str = "") -> MemoryReport | None:
        key = (rules, storage)
        if key not in scored:
            # the same layout as one planned before up to swapping mesh axes of one size is legal alike and has
            # the same memory and estimated time: it is not planned again (its twin, scored first, ranks first
            # among equals and is the one the results keep)
            twin = planned.setdefault(layout_key(rules, storage, axis_sizes), key)
            if twin != key:
                rep = scored[twin]
                scored[key] = None if rep is None else replace(rep, layout=rules, storage=storage)
                return scored[key]
            try:
                program = plan(graph, fetches, {mesh: MeshSpec(mesh_shape, rules, storage=storage)}, options)
            except LayoutError:
                scored[key] = None
                return None
            rep = memory_report(program)
            rep.layout, rep.storage = rules, storage
            rep.estimated_time = estimate_time(rep, cost)
            scored[key] = rep
        return scored[key]

    def rank(rep: MemoryReport):  # layouts over the limit rank after every layout within it
        over = limit is not None and rep.total_bytes > limit
        return (over, rep.total_bytes if over else 0, rep.estimated_time["total_s"], rep.total_bytes)

    for rules in list(candidate_rules)[:max_candidates]:
        score(rules)
    dim_names = graph_dimensions(graph)
    seeds = sorted((r for r in scored.values() if r is not None), key=rank)[:refine]
    for rep in seeds:  # greedy: add one more dim:axis rule while that lowers the rank
        while True:
            pairs = _rule_pairs(rep.layout)
            used = {d for d, _ in pairs}
            nbrs = [score(_rules_str(pairs + [(d, a)], dim_names, list(axis_sizes)))
                    for d in dim_names if d not in used for a in axis_sizes]
            nbrs = [r for r in nbrs if r is not None and rank(r) < rank(rep)]
            if not nbrs:
                break
            rep = min(nbrs, key=rank)
    if storage_rules is not None:
        if isinstance(storage_rules, str):
            if storage_rules != "auto":
                raise ValueError(f"search_layouts: storage_rules must be a list of rule strings or 'auto', "
                                 f"got {storage_rules!r}.")
        # a layout within the limit needs no storage rules: try them on the fastest layouts over it, and on
        # those with the least activation memory (storage rules shrink only the variables)
        over = [r for r in scored.values() if r is not None and (limit is None or r.total_bytes > limit)]
        by_time = sorted(over, key=lambda r: (r.estimated_time["total_s"], r.total_bytes))[:storage_top]
        by_act = sorted(over, key=lambda r: (r.peak_activation_bytes + r.constant_bytes, r.total_bytes))[:storage_top]
        fastest = list({id(r): r for r in by_time + by_act}.values())
        for rep in fastest:
            cands = storage_candidates(graph, mesh_shape, rep.layout) if storage_rules == "auto" else storage_rules
            for st in cands:
                score(rep.layout, st)
    results, seen = [], set()
    for (rules, storage), r in sorted(((k, r) for k, r in scored.items() if r is not None),
                                      key=lambda kr: rank(kr[1])):
        key = layout_key(rules, storage, axis_sizes)
        if key not in seen and (limit is None or r.total_bytes <= limit):
            seen.add(key)
            results.append((rules, r))
    if not results:
        raise ValueError(f"search_layouts: no legal layout on mesh {mesh_shape!r} fits "
                         f"{'the memory limit ' + _human(limit) if limit else 'the graph'}.")
    results.sort(key=lambda r: (r[1].estimated_time["total_s"], r[1].total_bytes))
    return results


def trust_line(ranked: Sequence[tuple[str, MemoryReport]], cost: CostModel) -> str:
    """One line saying how far the order of ``ranked`` (``[(layout, MemoryReport)]``, best first, each with its
    ``estimated_time``) can be trusted under ``cost``: the calibration's spread (``cost.spread``) and whether
    the host was busy, and which layouts are predicted within that spread of the first (their order is noise
    of the measurement, so measure them: ``meshtorch train --layout auto`` does); with constants not measured on
    this machine (``cost.spread`` None), that the order is a rough guide."""
    if cost.spread is None and cost.collectives:
        return ("trust: the calibration states no spread (measured by an older meshtorch): measure again with "
                "'meshtorch plan --calibrate' to see how far this order can be trusted.")
    if cost.spread is None:
        return ("trust: fixed constants, not measured on this machine: the order is a rough guide; measure this "
                "machine with 'meshtorch plan --calibrate' (docs/planning.md states measured ranking quality).")
    band = max(cost.spread, 0.0)
    best = ranked[0][1].estimated_time["total_s"] if ranked else 0.0
    close = [lay or "(replicated)" for lay, r in ranked[1:] if r.estimated_time["total_s"] <= best * (1 + band)]
    busy = " (the host was busy while it measured: run 'meshtorch plan --calibrate' on a quiet host)" \
        if cost.busy else ""
    head = f"trust: the calibration's constants spread {100 * band:.0f}% over its repetitions{busy}; "
    if not close:
        return head + "no other layout shown is predicted within that of the first."
    return (head + f"{len(close)} other layout(s) shown are predicted within {100 * band:.0f}% of the first "
            f"({', '.join(close[:3])}{', ...' if len(close) > 3 else ''}): their order is not reliable, measure "
            "them (meshtorch train --layout auto does).")

"""What ``meshtorch plan`` does (its parser: :mod:`meshtorch.cli.plan`): memory, FLOPs and communication
of one LM training step, before running it.

``meshtorch plan --mesh "data:2,model:2" --layout "batch:data;heads:model"`` builds the LM training
graph (AdamW), lowers it as a dry run (no variable storage is allocated, nothing runs) and prints
the :func:`meshtorch.planning.memory_report`; ``--search`` ranks every layout of the mesh with
:func:`meshtorch.planning.search_layouts` and prints the best ``--top``. :func:`plan_lm` is the same as a
function with ``storage`` (storage rules, FSDP) and ``memory_limit`` (bytes) arguments.
"""

from __future__ import annotations

import math
import re

from meshtorch.core.errors import LayoutError
from meshtorch.lowering.counters import _human
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.models.transformer import build_lm, preset
from meshtorch.optim.adam import AdamWOptimizer
from meshtorch.planning.budget import MemoryLimitError, check_memory_limit, plan_memory
from meshtorch.planning.cost import CostModel
from meshtorch.planning.search import search_layouts

DEFAULT_MESH = "data:2,model:2"
DEFAULT_LAYOUT = "batch:data;heads:model;d_ff:model;vocab:model"
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"512MB"``, ``"1e9"`` -> bytes.

    Raises:
        ValueError: naming the text, if it is not a number with an optional unit.
    """
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"--memory-limit: cannot read {text!r}; write e.g. 16GiB, 512MB or 1e9.")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _config(args, vocab_multiple: int):
    return preset(args.preset, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                  d_kv=args.d_kv, d_ff=args.d_ff, length=args.length, batch_size=args.batch_size,
                  vocab_size=args.vocab, num_experts=args.experts, vocab_multiple=vocab_multiple)


def main_plan(args) -> list:
    """Print the plan (or the ranked layouts) for the parsed ``meshtorch plan`` arguments; returns
    ``[(layout, MemoryReport)]``. Reads ``args.storage`` (storage rules, or ``"auto"`` to search them)
    and ``args.memory_limit`` (text such as ``16GiB``) when the parser defines them."""
    base = CostModel.cpu() if args.hardware == "cpu" else CostModel()
    cost = CostModel(args.flop_rate or base.flop_rate, args.bandwidth or base.bandwidth,
                     args.latency if args.latency is not None else base.latency)
    limit = parse_bytes(args.memory_limit) if getattr(args, "memory_limit", None) else None
    return plan_lm(lambda multiple: _config(args, multiple), args.mesh, args.layout,
                   storage=getattr(args, "storage", "") or "", memory_limit=limit, search=args.search, top=args.top,
                   cost=cost)


def plan_lm(config, mesh_shape: str, layout: str = DEFAULT_LAYOUT, storage: str = "", memory_limit: int | None = None,
            search: bool = False, top: int = 10, cost: CostModel | None = None, print_fn=print) -> list:
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
        cost: the :class:`CostModel` (default ``CostModel()``).

    Returns:
        ``[(layout, MemoryReport)]`` (one entry without ``search``; ``report.storage`` holds the storage rules).

    Raises:
        SystemExit: naming the layout, if it is illegal, or if no layout fits ``memory_limit`` in a search.
    """
    cost = cost or CostModel()
    impl = PlacementMeshImpl(mesh_shape, "" if search else layout)
    if search:  # the vocab must be divisible by whichever axis the search puts it on
        multiple = math.lcm(*[d.size for d in impl.shape]) if impl.shape.ndims else 1
    else:
        a = impl.tensor_dimension_to_mesh_axis("vocab")
        multiple = 1 if a is None else impl.shape[a].size
    cfg = config(multiple) if callable(config) else config
    lm = build_lm(cfg, optimizer=AdamWOptimizer(1e-3))
    n_params = sum(v.shape.size for v in lm.graph.trainable_variables)
    print_fn(f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads x d_kv {cfg.d_kv}, "
             f"d_ff {cfg.d_ff}, vocab {cfg.padded_vocab}, {n_params / 1e6:.2f}M parameters; batch {cfg.batch_size} "
             f"x length {cfg.length}; AdamW training step; mesh {mesh_shape!r}")
    print_fn(f"cost model: {cost.flop_rate:.3g} FLOP/s, {cost.bandwidth:.3g} B/s, {cost.latency:.3g} s per "
             "collective (dry run: nothing allocated or executed)")
    fetches = [lm.loss] + lm.updates
    if not search:
        st = "" if storage == "auto" else storage
        try:
            rep = plan_memory(lm.graph, lm.mesh, fetches, mesh_shape, layout, st, cost)
        except LayoutError as e:
            raise SystemExit(f"meshtorch plan: illegal layout {layout!r} / storage {st!r}: {e}") from None
        print_fn(rep.summary())
        if memory_limit is not None and rep.total_bytes > memory_limit:
            try:
                check_memory_limit(lm.graph, lm.mesh, fetches, mesh_shape, layout, st, memory_limit, cost=cost)
            except MemoryLimitError as e:
                print_fn(f"over the memory limit: {e}")
        return [(layout, rep)]
    if storage == "auto" or (memory_limit is not None and not storage):
        storage_rules = "auto"
    else:
        storage_rules = [storage] if storage else None
    try:
        ranked = search_layouts(lambda: lm, mesh_shape, memory_limit_bytes=memory_limit, fetches_fn=lambda m: fetches,
                                cost=cost, storage_rules=storage_rules)
    except ValueError as e:
        raise SystemExit(f"meshtorch plan: {e}") from None
    within = f" within {_human(memory_limit)}" if memory_limit is not None else ""
    print_fn(f"{len(ranked)} legal layouts{within}; best {top}:")
    print_fn(f"  {'rank':>4}  {'layout':<50}{'time ms':>10}{'compute':>10}{'comm':>10}"
             f"{'memory/proc':>13}{'comm/proc':>12}  storage")
    for i, (lay, r) in enumerate(ranked[:top]):
        t = r.estimated_time
        comm = sum(b for _, b in r.communication().values())
        print_fn(f"  {i + 1:>4}  {lay or '(replicated)':<50}{t['total_s'] * 1e3:>10.3f}"
                 f"{t['compute_s'] * 1e3:>10.3f}{t['comm_s'] * 1e3:>10.3f}{r.total_bytes / 2 ** 20:>10.1f} MiB"
                 f"{comm / 2 ** 20:>8.2f} MiB  {r.storage or '-'}")
    return ranked

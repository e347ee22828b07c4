"""What ``meshtorch plan`` does (its parser: :mod:`meshtorch.cli.plan`): memory, FLOPs and communication
of one LM training step, before running it.

``meshtorch plan --mesh "data:2,model:2" --layout "batch:data;heads:model"`` builds the LM training
graph (AdamW), lowers it as a dry run (no variable storage is allocated, nothing runs) and prints
the :func:`meshtorch.planning.memory_report`; ``--search`` ranks every layout of the mesh with
:func:`meshtorch.planning.search_layouts` and prints the best ``--top``.
"""

from __future__ import annotations

import math
import re

from meshtorch.core.errors import LayoutError
from meshtorch.lowering import Lowering
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.models.transformer import build_lm, preset
from meshtorch.optim.adam import AdamWOptimizer
from meshtorch.planning.cost import CostModel, estimate_time
from meshtorch.planning.memory import memory_report
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
    """Print the plan (or the ranked layouts); returns ``[(layout, MemoryReport)]``."""
    base = CostModel.cpu() if args.hardware == "cpu" else CostModel()
    cost = CostModel(args.flop_rate or base.flop_rate, args.bandwidth or base.bandwidth,
                     args.latency if args.latency is not None else base.latency)
    impl = PlacementMeshImpl(args.mesh, "" if args.search else args.layout)
    if args.search:  # the vocab must be divisible by whichever axis the search puts it on
        multiple = math.lcm(*[d.size for d in impl.shape]) if impl.shape.ndims else 1
    else:
        a = impl.tensor_dimension_to_mesh_axis("vocab")
        multiple = 1 if a is None else impl.shape[a].size
    cfg = _config(args, multiple)
    lm = build_lm(cfg, optimizer=AdamWOptimizer(1e-3))
    n_params = sum(v.shape.size for v in lm.graph.trainable_variables)
    print(f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads x d_kv {cfg.d_kv}, "
          f"d_ff {cfg.d_ff}, vocab {cfg.padded_vocab}, {n_params / 1e6:.2f}M parameters; batch {cfg.batch_size} "
          f"x length {cfg.length}; AdamW training step; mesh {args.mesh!r}")
    print(f"cost model: {cost.flop_rate:.3g} FLOP/s, {cost.bandwidth:.3g} B/s, {cost.latency:.3g} s per collective "
          "(dry run: nothing allocated or executed)")
    fetches = [lm.loss] + lm.updates
    if not args.search:
        try:
            lw = Lowering(lm.graph, {lm.mesh: impl}, materialize=False)
        except LayoutError as e:
            raise SystemExit(f"meshtorch plan: illegal layout {args.layout!r}: {e}") from None
        rep = memory_report(lw, fetches)
        rep.layout = args.layout
        rep.estimated_time = estimate_time(rep, cost)
        print(rep.summary())
        return [(args.layout, rep)]
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    try:
        ranked = search_layouts(lambda: lm, args.mesh, memory_limit_bytes=limit, fetches_fn=lambda m: fetches,
                                cost=cost)
    except ValueError as e:
        raise SystemExit(f"meshtorch plan: {e}") from None
    print(f"{len(ranked)} legal layouts{' within ' + args.memory_limit if limit else ''}; best {args.top}:")
    print(f"  {'rank':>4}  {'layout':<50}{'time ms':>10}{'compute':>10}{'comm':>10}{'memory/proc':>13}"
          f"{'comm/proc':>12}")
    for i, (lay, r) in enumerate(ranked[:args.top]):
        t = r.estimated_time
        comm = sum(b for _, b in r.communication().values())
        print(f"  {i + 1:>4}  {lay or '(replicated)':<50}{t['total_s'] * 1e3:>10.3f}{t['compute_s'] * 1e3:>10.3f}"
              f"{t['comm_s'] * 1e3:>10.3f}{r.total_bytes / 2 ** 20:>10.1f} MiB{comm / 2 ** 20:>8.2f} MiB")
    return ranked


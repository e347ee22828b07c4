"""A program's stages as values: ``plan`` -> :class:`~meshtorch.lowering.program.Program` -> ``bind`` -> Session.

:func:`plan` is pure: it reads the graph and the mesh specs (shapes, layout and storage rules), plans the
steps and the fetch set's schedule, and returns the :class:`~meshtorch.lowering.program.Program`; no backend,
no variable value, no tensor beyond plan-time constants already in the graph. The reports of
:mod:`meshtorch.planning` (memory, FLOPs, communication, pipeline) are functions of that program, so the
layout search plans hundreds of candidates without executing or allocating anything.
:func:`meshtorch.lowering.session.bind` is where execution starts: the program bound to backends and a
variable store is a :class:`~meshtorch.lowering.session.Session`. :class:`meshtorch.lowering.Lowering` is
the Mesh TF-style facade over the same stages. JAX's stages (``jit(f).trace(...).lower(...).compile()``)
follow the same split.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshtorch.core.graph import Graph, Operation, Tensor
from meshtorch.core.mesh_spec import MeshSpec, convert_to_mesh_spec
from meshtorch.lowering.collectives import kind_of
from meshtorch.lowering.planner import Planner
from meshtorch.lowering.plans import Plan, Processes, fetch_plan
from meshtorch.lowering.program import Program
from meshtorch.lowering.schedule import FIRST_BUCKET_BYTES

__all__ = ["PlanOptions", "default_buckets", "fetch_keys", "plan", "schedule"]


def _reduces_low_precision(graph: Graph, program: Program) -> bool:
    """Does ``program`` all-reduce a tensor of ``graph`` whose dtype is narrower than 32 bits?"""
    reduced = {st.collective.tensor for st in program.steps
               if st.collective is not None and kind_of(st.collective.kind)[0].fp32_default_buckets}
    return any(t.name in reduced and t.dtype.itemsize < 4 for op in graph.operations for t in op.outputs)


def default_buckets(graph: Graph, program: Program, bucket_bytes: int) -> tuple[int, int]:
    """``(bucket_bytes, first_bucket_bytes)`` of a :class:`~meshtorch.Lowering` told no ``bucket_bytes`` on meshes
    whose implementations' largest ``default_bucket_bytes`` is ``bucket_bytes`` (25 MiB on
    :class:`~meshtorch.SpmdMeshImpl`, 0 on the placement mesh): that size with DistributedDataParallel's 1 MiB first
    bucket (:data:`~meshtorch.lowering.schedule.FIRST_BUCKET_BYTES`, when smaller), or no buckets (0, 0) when
    ``program`` all-reduces a 16-bit tensor (a flat bucket makes gloo add its elements in another order, which
    bfloat16 rounding shows). The one rule both the executor and the planner's priced schedule
    (:attr:`PlanOptions.mesh_default`) follow."""
    if bucket_bytes and _reduces_low_precision(graph, program):
        return 0, 0
    return bucket_bytes, FIRST_BUCKET_BYTES if bucket_bytes > FIRST_BUCKET_BYTES else 0


@dataclass(frozen=True)
class PlanOptions:
    """How :func:`plan` schedules a fetch set (what a :class:`~meshtorch.lowering.session.Session` would run).

    Attributes:
        bucket_bytes: > 0 issues the SUM all-reduces in buckets of at most that many bytes per processor
            (see :class:`~meshtorch.lowering.Lowering`); 0 (default, the placement mesh's): one per value.
        first_bucket_bytes: > 0 closes the first all-reduce bucket at that size (DDP's 1 MiB first bucket).
        local: processors one process holds: None (default) all of them, one process simulating the mesh
            (a placement mesh); 1 one process per processor (SPMD). In-place updates need 1 (see
            :mod:`meshtorch.lowering.donate`), so memory estimates differ.
        mesh_default: ``bucket_bytes`` is a mesh implementation's ``default_bucket_bytes`` and the buckets are
            those a :class:`~meshtorch.Lowering` told no ``bucket_bytes`` makes of them: :func:`plan` replaces
            both byte counts with :func:`default_buckets` of the planned program (a 1 MiB first bucket; none
            when a 16-bit tensor is all-reduced).

    Raises:
        ValueError: a negative byte count or a ``local`` other than None or 1, naming the field.
    """

    bucket_bytes: int = 0
    first_bucket_bytes: int = 0
    local: int | None = None
    mesh_default: bool = False

    def __post_init__(self):
        for name in ("bucket_bytes", "first_bucket_bytes"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 0):
                raise ValueError(f"PlanOptions: {name} must be an int >= 0 (0: no buckets), got {v!r}.")
        if self.local not in (None, 1):
            raise ValueError(f"PlanOptions: local must be None (one process holds every processor) or 1 (SPMD), "
                             f"got {self.local!r}.")


def fetch_keys(planner: Planner, fetches) -> tuple:
    """The program keys of ``fetches`` (Tensors / Operations): ``("tensor", name)``, ``("assign", op name)``
    or None (an operation without outputs); a fetched partial sum gets its deferred all-reduce planned.

    Raises:
        TypeError: a fetch that is no Tensor or Operation. ValueError: a tensor not part of the plan
            (added to the graph after planning).
    """
    keys = []
    for f in fetches:
        if isinstance(f, Operation) and f in planner.assignments:
            keys.append(("assign", f.name))
            continue
        if isinstance(f, Operation):
            if not f.outputs:
                keys.append(None)
                continue
            f = f.outputs[0]
        if not isinstance(f, Tensor):
            raise TypeError(f"Cannot fetch {f!r}: give mtf Tensors or Operations.")
        if f not in planner._lowered:
            raise ValueError(f"Fetch {f.name!r} is not part of this lowering "
                             "(was it added to the graph after Lowering was built?).")
        planner.fetch(f)
        keys.append(("tensor", f.name))
    return tuple(keys)


def op_mesh_axes(planner: Planner, ops) -> dict[str, tuple[int, ...]]:
    """``{op name: sorted mesh axes splitting any input or output of the op}`` in the layouts the values are
    produced in (an einsum's work is divided by these axes' sizes)."""
    return {op.name: tuple(sorted({a for t in [*op.inputs, *op.outputs] for a in planner.tensor_layout(t)
                                   if a is not None})) for op in ops}


def _mesh_to_spec(graph: Graph, spec) -> dict:
    if isinstance(spec, dict):
        return {m: convert_to_mesh_spec(s) for m, s in spec.items()}
    meshes = list(dict.fromkeys(op.mesh for op in graph.operations))
    if len(meshes) != 1:
        raise ValueError(f"plan: the graph uses {len(meshes)} meshes ({[m.name for m in meshes]}); give "
                         "{Mesh: MeshSpec} instead of one spec.")
    return {meshes[0]: convert_to_mesh_spec(spec)}


def plan(graph: Graph, fetches, spec: MeshSpec | dict, options: PlanOptions | None = None) -> Program:
    """Plan one run of ``fetches`` of ``graph`` on ``spec``: the :class:`~meshtorch.lowering.program.Program`.

    Nothing is executed or allocated: no backend, no variable storage (the inverse of what a Session does).

    Args:
        graph: the Graph.
        fetches: a Tensor/Operation or a list of them, as ``Lowering.run`` takes (e.g. ``[loss] + updates``).
        spec: a :class:`~meshtorch.core.mesh_spec.MeshSpec` (or a mesh-shape string) for a graph on one mesh,
            or ``{Mesh: MeshSpec}``.
        options: :class:`PlanOptions` (default: the placement mesh's schedule: no buckets, one process).

    Returns:
        The program, with ``fetches``, ``options``, ``specs``, ``op_axes`` and ``pipeline`` set (read by the
        reports of :mod:`meshtorch.planning`; :func:`schedule` gives the fetch set's steps).

    Raises:
        LayoutError: naming the tensor and dimension, if the layout rules are illegal for the graph (every op's
            layouts are checked before any op is planned).
        TypeError / ValueError: a fetch that is not part of the graph; a graph on several meshes given one spec.
    """
    fetches = list(fetches) if isinstance(fetches, list | tuple) else [fetches]
    planner = Planner(graph, _mesh_to_spec(graph, spec), check_first=True)
    program = planner.program
    program.fetches = fetch_keys(planner, fetches)
    opts = options or PlanOptions()
    if opts.mesh_default:  # the buckets an executor on the mesh makes by default (the Lowering's rule)
        b, first = default_buckets(graph, program, opts.bucket_bytes)
        opts = replace(opts, bucket_bytes=b, first_bucket_bytes=first, mesh_default=False)
    program.options = opts
    program.specs = {m.name: s for m, s in planner.mesh_to_spec.items()}
    program.op_axes = op_mesh_axes(planner, graph.operations)
    program.pipeline = getattr(graph, "pipeline_schedule", None)
    return program


def schedule(program: Program, fetches: tuple | None = None, processes: dict | None = None) -> Plan:
    """The scheduled steps of one run of ``fetches`` (default: the fetch set ``program`` was planned for), as
    :mod:`meshtorch.lowering.plans` makes them: on ``processes`` (``{mesh name: backend}``) or, by default,
    on the program's specs as ``program.options`` says (:class:`~meshtorch.lowering.plans.Processes`).

    Raises:
        ValueError: a program not planned by :func:`plan` (no specs) and no ``processes``.
    """
    opts = program.options or PlanOptions()
    if processes is None:
        if not program.specs:
            raise ValueError("schedule: the program holds no mesh specs (not planned by meshtorch.lowering.stages"
                             ".plan); pass processes={mesh name: backend}.")
        processes = {name: Processes(s, opts.local) for name, s in program.specs.items()}
    return fetch_plan(program, program.fetches if fetches is None else fetches, processes, opts.bucket_bytes,
                      opts.first_bucket_bytes)

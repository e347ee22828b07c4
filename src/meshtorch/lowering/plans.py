"""A fetch set's plan: the steps one run of some fetches executes, scheduled, as data (no backend).

:func:`fetch_plan` selects the steps of a :class:`~meshtorch.lowering.program.Program` that the fetches need,
then runs the scheduling passes (:mod:`meshtorch.lowering.schedule`: gradient and gather buckets, FSDP
prefetch; :mod:`meshtorch.lowering.donate`: in-place updates). Those passes read, per mesh, what one
process sees of it: its shape, storage rules and prefetch depth (the :class:`~meshtorch.core.mesh_spec.MeshSpec`)
and which processors this process holds (``local_pnums()``). A bound backend answers both; before binding,
:class:`Processes` answers them from the spec alone, so a plan (and the reports of
:mod:`meshtorch.planning`) needs no backend. A :class:`~meshtorch.lowering.session.Session` binds the
plan's steps to its backends and runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshtorch.lowering.counters import Counters
from meshtorch.lowering.donate import donate_inputs, donate_reductions, updates_in_backward
from meshtorch.lowering.program import count, frees_after, select_steps
from meshtorch.lowering.schedule import bucket_gathers, bucket_reductions, prefetch_gathers


@dataclass
class Plan:
    """What one fetch set runs: the selected steps (run order) and their bound callables.

    Attributes:
        steps: the chosen :class:`~meshtorch.lowering.program.Step` records; ``frees[i]``: slots
            freed after step ``i``.
        placeholders / var_reads: ``[(name, slot)]`` the steps read.
        assignments: ``[(variable name, slot)]`` committed at the end of the run.
        fetch_slots: per fetch, ``(slot, tensor name)`` or ``(None, None)`` (assign ops).
        counters: the *planned* collectives and FLOPs of one run (loop bodies not counted).
        compiled: the plan runs as a ``torch.compile`` d function (mode ``"compile"``), whose collectives
            are counted from the plan (see :class:`~meshtorch.lowering.session.Session`).
    """

    steps: list
    frees: list
    placeholders: list
    var_reads: list
    assignments: list
    fetch_slots: list
    counters: Counters
    bound: list = field(default_factory=list)
    fn: object = None  # the generated straight-line function (codegen mode)
    compiled: bool = False  # fn is torch.compile'd
    given: tuple = ()  # slots whose laid-out values the run is given (their producers not run)
    stash: tuple = ()  # slots whose laid-out values the run returns besides the fetches


class Processes:
    """A mesh spec as one process sees it before any backend exists: the spec's fields and slice arithmetic,
    plus the processors the process holds (:meth:`local_pnums`) and their device.

    Args:
        spec: the :class:`~meshtorch.core.mesh_spec.MeshSpec`.
        local: how many processors one process holds: None (all of them: one process simulates the mesh, as
            :class:`~meshtorch.mesh.placement.PlacementMeshImpl`) or 1 (one process per processor, SPMD).
        device: the device plan-time constants are made on; default ``torch.device("meta")`` (shapes and
            dtypes only, nothing allocated).
    """

    def __init__(self, spec, local: int | None = None, device=None):
        if local not in (None, 1):
            raise ValueError(f"Processes: local must be None (all processors) or 1 (SPMD), got {local!r}.")
        self.spec, self.local = spec, local
        self._device = torch.device("meta") if device is None else torch.device(device)

    def __getattr__(self, name):
        return getattr(self.spec, name)

    def local_pnums(self) -> list[int]:
        """Processors whose slices this process holds (all, or processor 0 as a stand-in for one rank)."""
        return list(range(self.spec.size if self.local is None else 1))

    def device(self, pnum: int) -> torch.device:
        return self._device


def fetch_plan(program, fetches: tuple, processes: dict, bucket_bytes: int = 0, first_bucket_bytes: int = 0,
               given: tuple = (), stash: tuple = ()) -> Plan:
    """The :class:`Plan` of one run of ``fetches`` (``("tensor", name)``, ``("assign", op name)`` or None each).

    ``given``: slots the run is handed as laid-out values (an earlier run's ``stash``), so the steps that only
    produce them are pruned; ``stash``: slots the run keeps (never freed or written in place) and returns as
    laid-out values, as it does fetches. Together they hand a forward pass's saved activations to a later
    gradient run (:mod:`meshtorch.runtime.pipeline_exec`).

    Args:
        program: the :class:`~meshtorch.lowering.program.Program`.
        processes: ``{mesh name: what this process sees of the mesh}``: a backend
            (:class:`~meshtorch.mesh.base.MeshImpl`) or a :class:`Processes`.
        bucket_bytes, first_bucket_bytes: as :class:`~meshtorch.lowering.session.Session`'s.

    Raises:
        KeyError: a fetch that is not a fetchable tensor or assignment of the program.
    """
    p = program
    fetch_slots, assignments = [], []
    for f in fetches:
        if f is None:
            fetch_slots.append((None, None))
        elif f[0] == "assign":
            assignments.extend(p.assignments[f[1]])
            fetch_slots.append((None, None))
        else:
            fetch_slots.append((p.tensors[f[1]].slot, f[1]))
    needed = {s for s, _ in fetch_slots if s is not None} | {s for _, s in assignments} | set(stash)
    # results, new variable values, constants and given values are never freed (nor overwritten in place)
    keep = needed | set(p.constants) | set(given)
    steps, _ = select_steps(p.steps, needed, keep, given)
    needed |= {s for st in steps for s in st.inputs}
    needed -= set(given)
    c = count(steps)
    c.runs = 1
    # scheduling passes (schedule.py): FSDP gather buckets, prefetch as deep as the storage-ruled
    # meshes ask, DDP / FSDP gradient buckets
    prefetch = max([impl.prefetch for impl in processes.values() if impl.storage_rules.pairs], default=0)
    steps = bucket_reductions(prefetch_gathers(bucket_gathers(steps, bucket_bytes, p.slot_bytes), prefetch),
                              bucket_bytes, first_bucket_bytes)
    var_reads = [(n, t.slot) for n, t in p.variables.items() if t.slot in needed]
    variable_slots = {s for _, s in var_reads}
    layouts = {t.slot: t.layout for t in p.variables.values()}
    if p.in_backward:  # optimizer-in-backward: each update as soon as its gradient is final
        steps = updates_in_backward(steps, p.in_backward, variable_slots | set(p.constants), processes)
    # in-place updates, of the variables the run assigns only: a variable the run does not assign keeps its value
    written = {n for n, _ in assignments}
    steps = donate_inputs(steps, {s for n, s in var_reads if n in written}, keep, processes, layouts)
    steps = donate_reductions(steps, variable_slots, keep, processes)  # all-reduces in their input's buffer
    frees = frees_after(steps, keep)
    return Plan(steps, frees,
                [(n, t.slot) for n, t in p.placeholders.items() if t.slot in needed],
                var_reads, assignments, fetch_slots, c, given=tuple(given), stash=tuple(stash))

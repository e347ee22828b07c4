"""The variables of a process's pipeline stages seen as one lowering, for checkpoints (issue 32).

Under ``meshtorch train --pipeline-schedule 1f1b|interleaved-1f1b|zero-bubble`` no process builds the unpipelined
LM: each holds only its stages' programs (:func:`meshtorch.models.lm_stages.stage_programs`), whose variables
carry the unpipelined LM's names (weights, optimizer slots; each stage graph has its own ``global_step``, equal in
all of them). :class:`StageVariables` presents them to :func:`meshtorch.checkpoint.save` /
:func:`meshtorch.checkpoint.restore` as the lowering they expect (``variables``, ``mesh_to_impl``,
``tensor_layout``, ``set_variable_slices``, ...), so a checkpoint has the unpipelined run's format and names and
restores onto any mesh, layout or schedule (as PyTorch's distributed checkpoint saves each pipeline rank's state
dict into one checkpoint). Under torchrun each process writes and reads only its stages' slices: the stage's
mesh (one processor per process) is renumbered so that rank ``r``'s processors are ``r n .. r n + n - 1`` of an
``S n``-processor mesh (distinct file names, one leader), and ``global_step`` is written by rank 0 only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["StageVariables"]

STEP = "global_step"


class _RankMesh:
    """A stage lowering's MeshImpl with its processors renumbered ``p -> p + offset`` in an ``S n`` mesh of
    ``world`` processes, for the checkpoint's files and owners (the stage's own runs use the original)."""

    def __init__(self, impl, offset: int, total: int, leader: bool):
        self.impl, self.offset, self.size, self._leader = impl, offset, total, leader
        self.shape, self.layout_rules, self.storage_rules = impl.shape, impl.layout_rules, impl.storage_rules

    def local_pnums(self):
        return [p + self.offset for p in self.impl.local_pnums()]

    def owner_pnums(self, layout):
        return [p + self.offset for p in self.impl.owner_pnums(layout)]

    def slice_shape(self, shape, layout=None):
        return self.impl.slice_shape(shape, layout)

    def slice_begin(self, shape, pnum, layout=None):
        return self.impl.slice_begin(shape, pnum - self.offset, layout)

    def slice_bounds(self, shape, pnum, layout=None):
        return self.impl.slice_bounds(shape, pnum - self.offset, layout)

    def local_slices(self, x):
        return self.impl.local_slices(x)

    def is_leader(self):
        return self._leader

    def barrier(self):
        dist.barrier()


class _Key:
    """The mesh key of :attr:`StageVariables.mesh_to_impl` (the checkpoint reads its ``name``)."""

    def __init__(self, name: str):
        self.name = name


class StageVariables:
    """The variables of ``programs`` (this process's :class:`~meshtorch.models.lm_stages.StageProgram` list,
    None for the stages of other ranks) as one lowering for save/restore, evaluation checks and tests.

    ``variables`` lists each variable once (``global_step``: of the first stage held, and under torchrun on
    rank 0 only); :meth:`set_variable_value` / :meth:`set_variable_slices` write every stage that holds it.
    ``rank``/``world``: the torchrun process and process count (None: one process holds every stage)."""

    def __init__(self, programs: list, rank: int | None = None, world: int = 1):
        self.lowerings = [p.lowering for p in programs if p is not None]
        self.held: dict = {}  # name -> lowerings holding it
        for lw in self.lowerings:
            for n in lw.variable_names:
                self.held.setdefault(n, []).append(lw)
        self.graph = self.lowerings[0].graph  # its seed; the stage graphs share it
        self.distributed = rank is not None and world > 1
        self._impl, self._owner_of = {}, {}  # a stage lowering's impl -> its checkpoint view; output -> lowering
        self.mesh_to_impl, self._offset, self._vars = {}, {}, []  # _vars: (variable op, its stage lowering)
        for lw in self.lowerings:
            for mesh, impl in lw.mesh_to_impl.items():
                if self.distributed:
                    n = len(impl.local_pnums())
                    view = _RankMesh(impl, rank * n, world * n, rank == 0)
                else:
                    view = impl
                self._impl[id(impl)] = view
                self._offset[id(lw)] = getattr(view, "offset", 0)
                self.mesh_to_impl[_Key(mesh.name)] = view
            for var in lw.variables:
                self._owner_of[id(var.outputs[0])] = lw
                first = self.held[var.name][0] is lw
                if first and not (var.name == STEP and self.distributed and rank != 0):
                    self._vars.append((var, lw))

    @property
    def variables(self) -> dict:
        """``{variable op: its laid-out value}`` (as ``Lowering.variables``), each name once."""
        return {var: lw.variables[var] for var, lw in self._vars}

    @property
    def variable_names(self) -> list[str]:
        return [v.name for v, _ in self._vars]

    @property
    def session(self):
        return self.lowerings[0].session

    @property
    def counters(self):
        return self.lowerings[0].counters

    def mesh_impl(self, out):
        lw = self._owner_of[id(out)]
        return self._impl[id(lw.mesh_impl(out))]

    def tensor_layout(self, out):
        return self._owner_of[id(out)].tensor_layout(out)

    def _name(self, var_or_name) -> str:
        return var_or_name if isinstance(var_or_name, str) else var_or_name.name

    def variable_value(self, var_or_name) -> torch.Tensor:
        return self.held[self._name(var_or_name)][0].variable_value(self._name(var_or_name))

    def set_variable_value(self, var_or_name, value) -> None:
        for lw in self.held[self._name(var_or_name)]:
            lw.set_variable_value(self._name(var_or_name), value)

    def set_variable_slices(self, var_or_name, fn) -> None:
        name = self._name(var_or_name)
        for lw in self.held[name]:
            offset = self._offset[id(lw)]
            lw.set_variable_slices(name, lambda p, o=offset: fn(p + o))

    def share_step(self) -> None:
        """Under torchrun, after a restore: ``global_step`` (read by rank 0 only) from rank 0 into every stage."""
        if self.distributed and STEP in self.held:
            value = self.held[STEP][0].variable_value(STEP).contiguous()
            dist.broadcast(value, 0)
            self.set_variable_value(STEP, value)

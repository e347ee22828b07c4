"""The planner: a graph plus mesh shapes and layout rules -> a :class:`~meshtorch.lowering.program.Program`.

The planner walks the graph once. Each operation's ``lower(planner)`` asks for its inputs in the
layout it works on (:meth:`Planner.get`; :meth:`Planner.get_lazy` where the op is linear and can
take partial sums), emits steps (:meth:`Planner.slicewise` with a kernel, or collectives), and
records its outputs' slots and layouts (:meth:`Planner.set`). Whenever a value is needed in another
layout than the one it was produced in, :func:`~meshtorch.lowering.layout.plan_redistribute` plans the
transforms (a pure function of the spec, shape, dtype and the two layouts) and
:meth:`Planner.apply_transforms` emits them: the one place a layout change becomes steps. Nothing is
executed and no mesh implementation is bound: the planner reads each mesh's
:class:`~meshtorch.core.mesh_spec.MeshSpec` (shape, rules, slice arithmetic) only, so the program can
run on any implementation of the same spec.

Layout views: a tensor's compute layout follows the mesh's layout rules on its dimension names;
variables (and ops built inside :func:`meshtorch.core.graph.Graph.storage_scope`, such as optimizer
updates) see the *storage* layout, the compute rules overridden by the mesh's storage rules
(ZeRO-3 / FSDP). A variable read by compute ops is therefore all-gathered, and a partial-sum
gradient read by the update is reduce-scattered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from meshtorch.core.errors import LayoutError
from meshtorch.core.graph import Graph, Mesh, Operation, Tensor
from meshtorch.core.layout import TensorLayout
from meshtorch.core.mesh_spec import MeshSpec, convert_to_mesh_spec
from meshtorch.lowering.collectives import KINDS
from meshtorch.lowering.counters import Collective
from meshtorch.lowering.layout import Layout, Transform, narrow_kernel, plan_redistribute, slice_nbytes
from meshtorch.lowering.program import Program, Step, SubProgram, TensorSlot, count, select_steps
from meshtorch.ops._kernels import processor_coordinate


@dataclass
class _Lowered:
    slot: int
    layout: Layout
    source: tuple | None = None  # (tensor, kernel): this value is kernel(source) with the kernel linear
    home: list | None = None  # the step list (main program or a sub-program) that computes it


class Redistribution(NamedTuple):
    """One layout change the planner emitted: ``tensor``'s value moved by ``transforms`` into ``slot``."""

    tensor: str
    transforms: tuple[Transform, ...]
    slot: int


def mesh_record(spec) -> dict:
    """What a program records of a mesh (a :class:`~meshtorch.core.mesh_spec.MeshSpec` or a backend holding
    one): a session checks that its backend's spec matches."""
    return convert_to_mesh_spec(spec).record()


def storage_side(op: Operation | None) -> bool:
    """Does ``op`` see tensors in their storage layout (variables, assignments, optimizer updates)?"""
    return op is not None and bool(getattr(op, "storage_side", False))


def kept_forward_gathers(ops: Sequence[Operation]) -> frozenset:
    """Stored values (outputs of storage-side ops: variables) that reshard-after-forward does not gather
    again for the backward pass: those read by compute ops in the forward and the backward pass with no
    other stored value read by a compute op in between (in graph order), e.g. the output projection, whose
    last forward use (the logits) and first backward use (the logits' input gradient) enclose only the
    loss. Freeing such a copy frees no memory another gathered weight could use, so gathering it again
    would only cost communication; FSDP2 keeps its root unit's parameters for the same reason, and
    TorchTitan does not reshard the last block (``reshard_after_forward=False`` on it)."""
    reads: list[tuple[int, Tensor, bool]] = []  # (op index, stored value, read by a backward op)
    for i, op in enumerate(ops):
        if storage_side(op):
            continue
        for x in dict.fromkeys(op.inputs):
            if storage_side(x.operation):
                reads.append((i, x, bool(op.backward)))
    spans: dict[Tensor, list[int]] = {}  # value -> [last forward read, first backward read]
    for i, x, backward in reads:
        span = spans.setdefault(x, [-1, -1])
        if not backward:
            span[0] = i
        elif span[1] < 0:
            span[1] = i
    kept = set()
    for x, (last_fwd, first_bwd) in spans.items():
        if 0 <= last_fwd < first_bwd and not any(last_fwd < i < first_bwd and y is not x for i, y, _ in reads):
            kept.add(x)
    return frozenset(kept)


class Planner:
    """Plans ``graph`` for ``{Mesh: MeshSpec}``; the result is :attr:`program`.

    The planner reads only specs (mesh shape, layout and storage rules, slice arithmetic); a mesh
    implementation may be given instead of a spec and its ``spec`` is read. Ops ask for their mesh's
    spec with :meth:`mesh_spec`. ``check_first``: check every op's layouts before lowering any (what each
    op's lowering checks first anyway), so an illegal layout fails before the graph is planned; its error
    is then the first illegal view in graph order (without it, an earlier op's own lowering may fail first).

    Raises:
        LayoutError: naming the tensor and dimension, if the layout rules are illegal for some
            tensor of the graph (size not divisible, two dims on one mesh axis, a dim an op needs
            whole is split).
    """

    def __init__(self, graph: Graph, mesh_to_spec: dict[Mesh, MeshSpec], check_first: bool = False):
        self.graph = graph
        self.mesh_to_spec = {m: convert_to_mesh_spec(v) for m, v in mesh_to_spec.items()}
        self.steps: list[Step] = []
        self.slot_bytes: dict[int, int] = {}
        self._n_slots = 0
        self.constants: dict[int, tuple] = {}
        self._lowered: dict[Tensor, _Lowered] = {}
        self._forced: dict[tuple, int] = {}
        self._layouts: dict[tuple, TensorLayout] = {}
        self._placeholders: dict[Tensor, int] = {}
        self.var_reads: dict = {}  # Variable op -> slot
        self.assignments: dict = {}  # Assign op -> [(variable op, slot)]
        self.variable_ops: dict[str, Operation] = {}
        self._run_counter_slots: dict[Mesh, int] = {}
        self._current_op: Operation | None = None
        self._scopes: list[list[Step]] = []
        self._target: list[Step] = self.steps
        #: every redistribution emitted, in order (a run executes those its fetches need)
        self.redistributions: list[Redistribution] = []
        #: stored values whose forward gather the backward pass reuses (see :func:`kept_forward_gathers`)
        self.kept_gathers = (kept_forward_gathers(graph.operations)
                             if any(spec.storage_rules.pairs for spec in self.mesh_to_spec.values()) else frozenset())
        if check_first:  # every op's layouts before any op lowers: an illegal layout fails fast
            for op in graph.operations:
                self._check_op(op)
        for op in graph.operations:
            self._lower_op(op)
        self._current_op = None
        meshes = {m.name: spec.record() for m, spec in self.mesh_to_spec.items()}
        self.program = Program(
            meshes=meshes, steps=self.steps, constants=self.constants, placeholders={}, variables={},
            trainable=[v.name for v in self.var_reads if v.trainable], tensors={}, assignments={},
            slot_bytes=self.slot_bytes, n_slots=0)
        for t, s in self._placeholders.items():
            self.program.placeholders[t.name] = self._tensor_slot(t, s)
        for var, s in self.var_reads.items():
            self.program.variables[var.name] = self._tensor_slot(var.outputs[0], s)
            self.program.initializers[var.name] = var.initializer_kernel()
        for op, pairs in self.assignments.items():
            self.program.assignments[op.name] = [(v.name, s) for v, s in pairs]
        for t, lowered in self._lowered.items():
            if lowered.home is self.steps and not lowered.layout.partial:
                self.program.tensors[t.name] = self._tensor_slot(t, lowered.slot)
        self.program.n_slots = self._n_slots
        self.program.in_backward = frozenset(op.name for op in graph.operations if getattr(op, "in_backward", False))

    def _tensor_slot(self, t: Tensor, slot: int) -> TensorSlot:
        return TensorSlot(slot, t.mesh.name, [(d.name, d.size) for d in t.shape], t.dtype,
                          tuple(self.produced_layout(t).axes))

    def fetch(self, t: Tensor) -> TensorSlot:
        """The program slot of ``t``'s full value (emitting its deferred all-reduce if it is a partial sum)."""
        entry = self.program.tensors.get(t.name)
        if entry is None:
            self._current_op = None
            self._target = self.steps
            slot = self.get(t, self.produced_layout(t).axes)
            entry = self.program.tensors[t.name] = self._tensor_slot(t, slot)
            self.program.n_slots = self._n_slots
        return entry

    def _check_op(self, op: Operation):
        """Raise LayoutError if ``op``'s view of one of its inputs or outputs is illegal (ValueError: no spec for
        its mesh); the views are cached for the lowering."""
        self.mesh_spec(op)
        for t in list(op.inputs) + list(op.outputs):
            self.tensor_layout(t, op)

    def _lower_op(self, op: Operation):
        self._current_op = op
        self._check_op(op)
        op.lower(self)

    # ================================================================= layouts
    def mesh_spec(self, x) -> MeshSpec:
        """The :class:`~meshtorch.core.mesh_spec.MeshSpec` of ``x``'s mesh (``x``: a Mesh, tensor or operation).

        Raises:
            ValueError: if no spec was given for that mesh, naming it and ``x``.
        """
        mesh = x if isinstance(x, Mesh) else x.mesh
        try:
            return self.mesh_to_spec[mesh]
        except KeyError:
            raise ValueError(f"Lowering: no MeshImpl or MeshSpec given for mesh {mesh.name!r} "
                             f"(used by {getattr(x, 'name', x)!r}).") from None

    def _view(self, t: Tensor, storage: bool, unsplit=()) -> TensorLayout:
        key = (t, storage)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self.mesh_spec(t).tensor_layout(t.shape, t.name, unsplit, storage=storage)
            self._layouts[key] = lay
        return lay

    def tensor_layout(self, t: Tensor, op: Operation | None = None) -> TensorLayout:
        """Layout of ``t`` as the op being lowered sees it (validated; cached); outside an op's
        lowering, the layout ``t`` is produced (and stored) in."""
        viewer = op if op is not None else self._current_op
        if viewer is None:
            return TensorLayout(self.produced_layout(t).axes)
        if op is None:  # the op being lowered asks again: its views were checked (and cached) before it lowered
            lay = self._layouts.get((t, storage_side(viewer)))
            if lay is not None:
                return lay
        unsplit = tuple(op.unsplittable_dims) if op is not None else ()
        lay = self._view(t, storage_side(viewer), unsplit)
        if op is not None and op.unsplittable_dims:
            impl = self.mesh_spec(t)
            for d, a in zip(t.shape, lay, strict=True):
                if a is not None and d.name in op.unsplittable_dims:
                    raise LayoutError(
                        f"Operation {op.name!r} ({type(op).__name__}) needs dimension {d.name!r} of tensor "
                        f"{t.name!r} whole, but the layout splits it over mesh axis {impl.shape[a].name!r}. "
                        f"Remove the rule '{d.name}:{impl.shape[a].name}' or rename the dimension first.")
        return lay

    def produced_layout(self, t: Tensor) -> Layout:
        """The layout (with pending partial sums) ``t``'s value has where it is computed."""
        lowered = self._lowered.get(t)
        if lowered is not None:
            return lowered.layout
        return Layout(tuple(self._view(t, storage_side(t.operation))))

    def slice_shape(self, t: Tensor) -> list[int]:
        return self.mesh_spec(t).slice_shape(t.shape, self.tensor_layout(t))

    def tensor_mesh_axes(self, t: Tensor, dims=None) -> list[int]:
        """Mesh axes that split ``t`` (restricted to ``dims`` names if given)."""
        lay = self.tensor_layout(t)
        names = None if dims is None else {d if isinstance(d, str) else d.name for d in dims}
        return [a for d, a in zip(t.shape, lay, strict=True) if a is not None and (names is None or d.name in names)]

    # ================================================================= slots and constants
    def new_slot(self) -> int:
        self._n_slots += 1
        return self._n_slots - 1

    def _constant(self, kind: str, mesh: Mesh, data) -> int:
        s = self.new_slot()
        self.constants[s] = (kind, mesh.name, data)
        return s

    def pnum_constant(self, t: Tensor | Mesh | Operation, fn: Callable) -> int:
        """A slot holding ``fn(mesh_impl, pnum)`` on each processor; ``fn`` a kernel
        (see :mod:`meshtorch.ops._kernels`), evaluated when the program is bound to an implementation."""
        mesh = t if isinstance(t, Mesh) else t.mesh
        self.mesh_spec(mesh)
        return self._constant("pnum", mesh, fn)

    def import_constant(self, t: Tensor, full) -> int:
        """A slot holding ``t``'s value sliced from the full torch tensor ``full`` (cut when bound)."""
        s = self._constant("import", t.mesh, (full, tuple(self.tensor_layout(t))))
        self._record_bytes(s, t)
        return s

    def run_counter_slot(self, mesh: Mesh) -> int:
        """A slot refilled at every run with the number of runs completed before it (0, 1, 2, ...),
        the same on every processor. Random ops mix it into their keys so every run draws fresh
        values that are still a pure function of (graph seed, op key, run, index)."""
        slot = self._run_counter_slots.get(mesh)
        if slot is None:
            self.mesh_spec(mesh)
            slot = self._run_counter_slots[mesh] = self._constant("run_counter", mesh, None)
        return slot

    # ================================================================= values
    def set(self, t: Tensor, slot: int, pending=frozenset(), source=None):
        """Record that ``t``'s value lives in ``slot``, laid out as the current op sees ``t``.

        ``pending``: mesh axes over which it is a partial sum. ``source``: ``(tensor, kernel)`` when
        the value is ``kernel`` (linear, slicewise) of another partial-sum tensor; reducing it then
        reduces the source once and reapplies the kernel, so the source and its scaled copies share
        one all-reduce.
        """
        lay = Layout(tuple(self.tensor_layout(t)), frozenset(pending))
        self._lowered[t] = _Lowered(slot, lay, source if pending else None, self._target)
        self._record_bytes(slot, t)

    def _record_bytes(self, slot: int, t: Tensor):
        if slot not in self.slot_bytes:
            self.slot_bytes[slot] = slice_nbytes(self.slice_shape(t), t.dtype)

    def _lookup(self, t: Tensor) -> _Lowered:
        lowered = self._lowered.get(t)
        if lowered is None:
            raise RuntimeError(f"Tensor {t.name!r} was used before it was lowered.")
        home = lowered.home
        if home is not None and home is not self.steps and not any(home is s for s in self._scopes):
            raise ValueError(f"Tensor {t.name!r} is computed inside a while_loop condition or body and is not "
                             "visible here; use the loop's outputs (or an accumulator) instead.")
        return lowered

    def get_lazy(self, t: Tensor) -> tuple[int, frozenset]:
        """``(slot, pending mesh axes)``: for linear ops that can take a partial sum as it is."""
        lw = self._lookup(t)
        if tuple(lw.layout.axes) != tuple(self.tensor_layout(t)):
            return self.get(t), frozenset()
        return lw.slot, lw.layout.partial

    def get(self, t: Tensor, axes=None) -> int:
        """Slot of ``t``'s value, fully reduced, in the layout the current op sees (or mesh ``axes``
        per dim), redistributing it first if it was produced in another layout."""
        lowered = self._lookup(t)
        want = Layout(tuple(axes) if axes is not None else tuple(self.tensor_layout(t)))
        if lowered.layout == want:
            return lowered.slot
        key = (t, want, self._phase(t))
        if key not in self._forced:
            saved, self._current_op = self._current_op, t.operation  # attribute to the producer
            # emit where t was lowered: a tensor of an enclosing program needed inside a loop body
            # is redistributed once, before the loop, not every iteration
            saved_target = self._target
            self._target = lowered.home if lowered.home is not None else self.steps
            try:
                if lowered.source is not None and tuple(lowered.layout.axes) == want.axes:
                    src, fn = lowered.source
                    slot = self.slicewise(fn, self.get(src, self._lowered[src].layout.axes), mesh=t)
                else:
                    slot = self._redistribute(lowered.slot, t, lowered.layout, want)
                self._forced[key] = slot
                if slot not in self.slot_bytes:
                    impl = self.mesh_spec(t)
                    self.slot_bytes[slot] = slice_nbytes(impl.slice_shape(t.shape, TensorLayout(want.axes)), t.dtype)
            finally:
                self._current_op = saved
                self._target = saved_target
        return self._forced[key]

    def _phase(self, t: Tensor) -> bool:
        """True when the op being lowered is in the backward pass and ``t`` is a stored value (a variable)
        whose mesh reshards after the forward pass: its redistribution (the all-gather) is then emitted
        again for the backward pass instead of keeping the forward one alive (FSDP); a kept forward gather
        only where the mesh does not reshard ``"always"``."""
        op = self._current_op
        if op is None or not op.backward or not storage_side(t.operation):
            return False
        reshard = self.mesh_spec(t).reshard_after_forward
        return bool(reshard) and (reshard == "always" or t not in self.kept_gathers)

    def inputs(self, op: Operation, allow: bool = True, blocked=frozenset()) -> tuple[list[int], frozenset]:
        """Slots of ``op``'s inputs and the mesh axes over which its output stays a partial sum, as the
        op's declared strategy (``op.partial_sums``) says. ``allow=False`` or a pending axis in
        ``blocked`` (an axis the op itself splits or gathers over) reduces every input first."""
        mode = op.partial_sums
        lazy = [self.get_lazy(x) for x in op.inputs] if mode and allow else []
        if mode == "linear" and lazy:
            pend = {p for _, p in lazy}
            if len(pend) == 1 and not (next(iter(pend)) & frozenset(blocked)):
                return [s for s, _ in lazy], next(iter(pend))
        elif mode == "first" and lazy:
            slot, pend = lazy[0]
            if not pend & frozenset(blocked):
                return [slot] + [self.get(x) for x in op.inputs[1:]], pend
        elif mode not in (None, "linear", "first"):
            raise ValueError(f"{type(op).__name__}.partial_sums must be None, 'linear' or 'first', got {mode!r}.")
        return [self.get(x) for x in op.inputs], frozenset()

    # ================================================================= emitting steps
    def emit(self, kind: str, fn, inputs: Sequence[int], num_outputs: int = 1, params=None,
             collective: Collective | None = None, flops: int = 0, subprograms: Sequence = (), mesh=None):
        """Append a step; returns the output slot (or a tuple of slots)."""
        outs = tuple(self.new_slot() for _ in range(num_outputs))
        op = self._current_op.name if self._current_op is not None else "<fetch>"
        m = mesh if mesh is not None else self._current_op
        m = m if isinstance(m, Mesh) else m.mesh
        self._target.append(Step(kind, op, tuple(inputs), outs, m.name, fn, dict(params or {}), collective, flops,
                                 tuple(subprograms)))
        return outs[0] if num_outputs == 1 else outs

    def slicewise(self, fn: Callable, *slots: int, mesh=None, num_outputs: int = 1, flops: int = 0):
        """Emit ``fn`` (a kernel) applied to each processor's slices of the given slots."""
        return self.emit("slicewise", fn, slots, num_outputs, flops=flops, mesh=mesh)

    def call(self, fn: Callable, *slots: int, num_outputs: int = 1, subprograms: Sequence = (), mesh=None):
        """Emit ``fn(context, *values)`` (a kernel needing the executor's context, e.g. a loop)."""
        return self.emit("call", fn, slots, num_outputs, subprograms=subprograms, mesh=mesh)

    def collective(self, kind: str, slot: int, t: Tensor, over, local_shape, **params) -> int:
        """Emit collective ``kind`` of ``t``'s slices (each of ``local_shape``) over mesh axes ``over``.

        ``params`` are the MeshImpl primitive's arguments. The record's bytes are
        ``slice_nbytes(local_shape, t.dtype)``: the one place bytes are counted.

        Raises:
            ValueError: ``kind`` is not declared in :mod:`meshtorch.lowering.collectives`.
        """
        return self._emit_collective(kind, slot, t, over, slice_nbytes(local_shape, t.dtype), params)

    def _emit_collective(self, kind: str, slot: int, t: Tensor, over, nbytes: int, params: dict) -> int:
        if kind not in KINDS:
            raise ValueError(f"Planner.collective: unknown collective kind {kind!r}; declared: {sorted(KINDS)} "
                             "(meshtorch.lowering.collectives).")
        impl = self.mesh_spec(t)
        op = self._current_op.name if self._current_op is not None else "<fetch>"
        c = Collective(kind, tuple(impl.shape[a].name for a in over), op, t.name, nbytes, impl.size,
                       params.get("reduction", ""))
        return self.emit(kind, None, [slot], params=params, collective=c, mesh=t.mesh)

    def apply_transforms(self, slot: int, t: Tensor, transforms: Sequence[Transform]) -> int:
        """Emit the steps of ``transforms`` (:func:`~meshtorch.lowering.layout.plan_redistribute`) on ``t``'s
        value in ``slot``; returns the slot of the result. Each collective's record counts its transform's
        ``nbytes``; a local slice is a slicewise :func:`~meshtorch.lowering.layout.narrow_kernel` with the
        processor's coordinate on the mesh axis. The list is kept in :attr:`redistributions`."""
        for tr in transforms:
            if tr.collective is None:  # a local slice: no communication
                coords = self.pnum_constant(t, functools.partial(processor_coordinate, mesh_axis=tr.mesh_axes[0]))
                slot = self.slicewise(functools.partial(narrow_kernel, **dict(tr.params)), slot, coords, mesh=t)
            else:
                slot = self._emit_collective(tr.kind, slot, t, tr.mesh_axes, tr.nbytes, dict(tr.params))
        self.redistributions.append(Redistribution(t.name, tuple(transforms), slot))
        return slot

    def _redistribute(self, slot: int, t: Tensor, src: Layout, dst: Layout) -> int:
        return self.apply_transforms(slot, t, plan_redistribute(self.mesh_spec(t), t.shape, t.dtype, src, dst,
                                                                name=t.name))

    def allreduce(self, slot: int, mesh_axes, reduction: str, t: Tensor, local_shape=None) -> int:
        """All-reduce ``t``'s slices over ``mesh_axes`` (indices) with SUM, MAX or MIN."""
        mesh_axes = tuple(mesh_axes)
        if not mesh_axes:
            return slot
        local = self.slice_shape(t) if local_shape is None else local_shape
        return self.collective("allreduce", slot, t, mesh_axes, local, mesh_axes=mesh_axes, reduction=reduction)

    def all_gather(self, slot: int, mesh_axis: int, concat_axis: int, t: Tensor, local_shape=None) -> int:
        """All-gather ``t``'s slices (each of ``local_shape``, default ``t``'s slice shape) along ``concat_axis``."""
        local = self.slice_shape(t) if local_shape is None else local_shape
        return self.collective("allgather", slot, t, [mesh_axis], local, mesh_axis=mesh_axis, concat_axis=concat_axis)

    def alltoall(self, slot: int, mesh_axis: int, split_axis: int, concat_axis: int, t: Tensor,
                 local_shape=None) -> int:
        """All-to-all along ``mesh_axis``: split ``split_axis``, concatenate ``concat_axis``."""
        local = self.slice_shape(t) if local_shape is None else local_shape
        return self.collective("alltoall", slot, t, [mesh_axis], local, mesh_axis=mesh_axis, split_axis=split_axis,
                               concat_axis=concat_axis)

    def reduce_scatter(self, slot: int, mesh_axis: int, scatter_axis: int, t: Tensor, local_shape=None) -> int:
        """Sum over ``mesh_axis``'s groups; member ``c`` keeps piece ``c`` of tensor axis ``scatter_axis``."""
        local = self.slice_shape(t) if local_shape is None else local_shape
        return self.collective("reduce_scatter", slot, t, [mesh_axis], local, mesh_axis=mesh_axis,
                               scatter_axis=scatter_axis)

    def collective_permute(self, slot: int, mesh_axis: int, source_pcoord, t: Tensor, local_shape=None) -> int:
        """Coordinate ``c`` on ``mesh_axis`` gets the slice of ``source_pcoord[c]`` (None: zeros): XLA's
        CollectivePermute (JAX ``lax.ppermute``) written per target, Mesh TF's ``receive``."""
        local = self.slice_shape(t) if local_shape is None else local_shape
        return self.collective("collective_permute", slot, t, [mesh_axis], local, mesh_axis=mesh_axis,
                               source_pcoord=tuple(source_pcoord))

    def broadcast(self, slot: int, mesh_axis: int, root: int, t: Tensor, local_shape=None) -> int:
        """Every member of ``mesh_axis``'s groups gets the slice of the member at coordinate ``root``."""
        local = self.slice_shape(t) if local_shape is None else local_shape
        return self.collective("broadcast", slot, t, [mesh_axis], local, mesh_axis=mesh_axis, root=root)

    def redistribute(self, slot: int, t: Tensor, src_axes, dst_axes, src_partial=(), dst_partial=()) -> int:
        """Move ``slot`` (``t`` laid out with mesh axes ``src_axes`` per dim, a partial sum over
        ``src_partial``) to ``dst_axes``, still partial over ``dst_partial`` (a subset)."""
        return self._redistribute(slot, t, Layout(tuple(src_axes), frozenset(src_partial)),
                                  Layout(tuple(dst_axes), frozenset(dst_partial)))

    # ---- sub-programs (loop bodies and conditions)
    def lower_subprogram(self, ops: Sequence[Operation], inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                         lazy: Sequence[bool] | None = None) -> SubProgram:
        """Lower ``ops`` (in order) into their own step list instead of the current one.

        ``inputs`` are tensors the caller supplies at every execution (each gets a fresh slot);
        tensors of the enclosing program that the ops read become the sub-program's
        ``external_slots``. A redistribution of an enclosing-program tensor is emitted in the
        enclosing program (once), never in the sub-program. ``outputs`` are fully reduced, except
        those flagged in ``lazy``, which stay partial sums (their axes in ``SubProgram.pending``).
        Steps no output needs are dropped; slots are freed after their last use within one execution.
        """
        lazy = list(lazy) if lazy is not None else [False] * len(outputs)
        saved_target, saved_op = self._target, self._current_op
        steps: list[Step] = []
        self._scopes.append(steps)
        self._target = steps
        try:
            in_slots = []
            for t in inputs:
                self.tensor_layout(t)
                in_slots.append(self.new_slot())
                self.set(t, in_slots[-1])
            for op in ops:
                self._lower_op(op)
            self._current_op = saved_op
            out_slots, pending = [], []
            for t, is_lazy in zip(outputs, lazy, strict=True):
                slot, pend = self.get_lazy(t) if is_lazy else (self.get(t), frozenset())
                out_slots.append(slot)
                pending.append(pend)
        finally:
            self._scopes.pop()
            self._target, self._current_op = saved_target, saved_op
        chosen, frees = select_steps(steps, set(out_slots), keep=set(out_slots) | set(self.constants))
        produced = {o for st in chosen for o in st.outputs} | set(in_slots)
        reads = [s for st in chosen for s in st.inputs] + out_slots
        external = tuple(dict.fromkeys(s for s in reads if s not in produced))
        frees = [tuple(f for f in fr if f in produced) for fr in frees]
        return SubProgram(chosen, frees, tuple(in_slots), external, tuple(out_slots), tuple(pending), count(chosen))

    # ---- bookkeeping used by the placeholder / variable / assign ops
    def register_placeholder(self, t: Tensor) -> int:
        s = self.new_slot()
        self._placeholders[t] = s
        return s

    def register_variable(self, var, initial_value=None) -> int:
        """Declare ``var`` (a Variable op); returns the slot its reads come from. Its storage is kept
        by a :class:`~meshtorch.lowering.variables.VariableStore`, not by the program."""
        if var.name in self.variable_ops:
            raise ValueError(f"Two variables named {var.name!r} in one graph.")
        self.variable_ops[var.name] = var
        s = self.new_slot()
        self.var_reads[var] = s
        return s

    def register_assignment(self, assign_op, var, slot: int):
        self.assignments.setdefault(assign_op, []).append((var, slot))

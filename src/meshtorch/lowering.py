"""Lowering: a named-dimension graph -> a program of per-processor steps, and running it.

``Lowering(graph, {mesh: mesh_impl})`` walks the graph once. Each operation's ``lower()`` emits
*steps* (a function of input slots producing output slots) through this object; collectives are
steps too and carry a :class:`~meshtorch.counters.Collective` record. The program is data: it
can be printed (``lowering.program_str()``), counted before running (``plan_counters``) and run
many times with no further planning (``run``).

Run semantics (stricter than Mesh TF): within one ``run`` every read of a variable sees its value
from before the run, and assignments take effect together at the end, so results never depend on
the order the steps happen to execute in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from meshtorch.core.dims import Shape
from meshtorch.core.errors import FeedError, LayoutError
from meshtorch.core.graph import Graph, Mesh, Operation, Tensor
from meshtorch.core.layout import TensorLayout
from meshtorch.counters import Collective, Counters
from meshtorch.mesh.base import MeshImpl


@dataclass
class Step:
    """One instruction of the program: ``outputs = fn(*inputs)`` over laid-out values."""

    fn: Callable
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    op: str
    kind: str = "compute"
    collective: Collective | None = None
    flops: int = 0


@dataclass
class _Program:
    steps: list  # (fn, inputs, outputs, frees)
    placeholders: list  # (tensor, slot)
    var_reads: list  # (variable op, slot)
    assignments: list  # (variable op, slot)
    fetch_slots: list  # (slot or None, tensor or None)
    counters: Counters = field(default_factory=Counters)


@dataclass
class _Lowered:
    slot: int
    pending: frozenset = frozenset()  # mesh axes of a deferred all-reduce (lazy sum)
    source: tuple | None = None  # (tensor, fn): this value is fn(source) with fn linear


class Lowering:
    """Plan a graph for the given meshes; then ``run`` it.

    Args:
        graph: the Graph (operations added after this call are not part of the program).
        mesh_to_impl: ``{Mesh: MeshImpl}``.

    Raises:
        LayoutError: naming the tensor and dimension, if the layout rules are illegal for some
            tensor of the graph (size not divisible, two dims on one mesh axis, a dim an op needs
            whole is split).
    """

    def __init__(self, graph: Graph, mesh_to_impl: dict[Mesh, MeshImpl]):
        self.graph = graph
        self.mesh_to_impl = dict(mesh_to_impl)
        self.steps: list[Step] = []
        self._n_slots = 0
        self._constants: dict[int, object] = {}
        self._lowered: dict[Tensor, _Lowered] = {}
        self._forced: dict[Tensor, int] = {}
        self._layouts: dict[Tensor, TensorLayout] = {}
        self._placeholders: dict[Tensor, int] = {}
        self._var_reads: dict = {}  # Variable op -> slot
        self._assignments: dict = {}  # Assign op -> [(variable op, slot)]
        self.variables: dict = {}  # Variable op -> laid-out value (persistent storage)
        self._variables_by_name: dict = {}
        self._programs: dict = {}
        self.counters = Counters()
        self._current_op: Operation | None = None
        self._n_lowered_steps = 0
        for op in graph.operations:
            self._current_op = op
            impl = self.mesh_impl(op)
            for t in list(op.inputs) + list(op.outputs):
                self.tensor_layout(t, op)
            op.lower(self)
            del impl
        self._current_op = None
        self._n_lowered_steps = len(self.steps)

    # ================================================================= used by op.lower()
    def mesh_impl(self, x) -> MeshImpl:
        mesh = x if isinstance(x, Mesh) else x.mesh
        try:
            return self.mesh_to_impl[mesh]
        except KeyError:
            raise ValueError(f"Lowering: no MeshImpl given for mesh {mesh.name!r} "
                             f"(used by {getattr(x, 'name', x)!r}).") from None

    def tensor_layout(self, t: Tensor, op: Operation | None = None) -> TensorLayout:
        """Layout of ``t`` under its mesh's rules (validated; cached)."""
        lay = self._layouts.get(t)
        if lay is None:
            unsplit = tuple(op.unsplittable_dims) if op is not None else ()
            lay = self.mesh_impl(t).tensor_layout(t.shape, t.name, unsplit)
            self._layouts[t] = lay
        elif op is not None and op.unsplittable_dims:
            impl = self.mesh_impl(t)
            for d, a in zip(t.shape, lay, strict=True):
                if a is not None and d.name in op.unsplittable_dims:
                    raise LayoutError(
                        f"Operation {op.name!r} ({type(op).__name__}) needs dimension {d.name!r} of tensor "
                        f"{t.name!r} whole, but the layout splits it over mesh axis {impl.shape[a].name!r}. "
                        f"Remove the rule '{d.name}:{impl.shape[a].name}' or rename the dimension first.")
        return lay

    def slice_shape(self, t: Tensor) -> list[int]:
        return self.mesh_impl(t).slice_shape(t.shape, self.tensor_layout(t))

    def tensor_mesh_axes(self, t: Tensor, dims=None) -> list[int]:
        """Mesh axes that split ``t`` (restricted to ``dims`` names if given)."""
        lay = self.tensor_layout(t)
        names = None if dims is None else {d if isinstance(d, str) else d.name for d in dims}
        return [a for d, a in zip(t.shape, lay, strict=True) if a is not None and (names is None or d.name in names)]

    def new_slot(self) -> int:
        self._n_slots += 1
        return self._n_slots - 1

    def constant(self, value) -> int:
        """A slot pre-filled with a laid-out value (computed once, at plan time)."""
        s = self.new_slot()
        self._constants[s] = value
        return s

    def laid_out_constant(self, t: Tensor | Mesh, fn: Callable[[int], object]) -> int:
        """A slot holding ``fn(pnum)`` on each processor (plan-time constant)."""
        return self.constant(self.mesh_impl(t).laid_out_constant(fn))

    def set(self, t: Tensor, slot: int, pending=frozenset(), source=None):
        """Record that ``t``'s laid-out value lives in ``slot``.

        ``pending``: mesh axes of a deferred all-reduce. ``source``: ``(tensor, fn)`` when the
        value is ``fn`` (linear, slicewise) of another lazy tensor; forcing then all-reduces the
        source once and reapplies ``fn``, so the source and its scaled copies share one all-reduce.
        """
        self._lowered[t] = _Lowered(slot, frozenset(pending), source if pending else None)

    def get_lazy(self, t: Tensor) -> tuple[int, frozenset]:
        """``(slot, pending_mesh_axes)``: the value may still be a partial sum over those axes."""
        try:
            lw = self._lowered[t]
        except KeyError:
            raise RuntimeError(f"Tensor {t.name!r} was used before it was lowered.") from None
        return lw.slot, lw.pending

    def get(self, t: Tensor) -> int:
        """Slot of ``t``'s laid-out value, emitting the deferred all-reduce first if one is pending."""
        lowered = self._lowered.get(t)
        if lowered is None:
            raise RuntimeError(f"Tensor {t.name!r} was used before it was lowered.")
        if not lowered.pending:
            return lowered.slot
        if t not in self._forced:
            saved, self._current_op = self._current_op, t.operation  # attribute to the producer
            try:
                if lowered.source is not None:
                    src, fn = lowered.source
                    self._forced[t] = self.slicewise(fn, self.get(src), mesh=t)
                else:
                    self._forced[t] = self.allreduce(lowered.slot, sorted(lowered.pending), "SUM", t)
            finally:
                self._current_op = saved
        return self._forced[t]

    def emit(self, fn: Callable, inputs: Sequence[int], num_outputs: int = 1, kind: str = "compute",
             collective: Collective | None = None, flops: int = 0):
        """Append a step; returns the output slot (or a tuple of slots)."""
        outs = tuple(self.new_slot() for _ in range(num_outputs))
        op = self._current_op.name if self._current_op is not None else "<fetch>"
        self.steps.append(Step(fn, tuple(inputs), outs, op, kind, collective, flops))
        return outs[0] if num_outputs == 1 else outs

    def slicewise(self, fn: Callable, *slots: int, mesh=None, num_outputs: int = 1, flops: int = 0):
        """Emit ``fn`` applied to each processor's slices of the given slots."""
        impl = self.mesh_impl(mesh if mesh is not None else self._current_op)
        sw = impl.slicewise
        if num_outputs == 1:
            def step(*vals):
                return sw(fn, *vals)
        else:
            def step(*vals):
                return sw(fn, *vals, num_outputs=num_outputs)
        return self.emit(step, slots, num_outputs, flops=flops)

    def _collective(self, kind, slot, t: Tensor, mesh_axes, reduction="", nbytes=None):
        impl = self.mesh_impl(t)
        if nbytes is None:
            nbytes = int(np.prod(self.slice_shape(t), dtype=np.int64)) * _itemsize(t.dtype)
        op = self._current_op.name if self._current_op is not None else "<fetch>"
        return Collective(kind, tuple(impl.shape[a].name for a in mesh_axes), op, t.name, nbytes, impl.size,
                          reduction)

    def allreduce(self, slot: int, mesh_axes, reduction: str, t: Tensor) -> int:
        """Emit an all-reduce of ``t``'s slices over ``mesh_axes`` (indices)."""
        mesh_axes = tuple(mesh_axes)
        if not mesh_axes:
            return slot
        impl = self.mesh_impl(t)
        c = self._collective("allreduce", slot, t, mesh_axes, reduction)
        return self.emit(lambda x: impl.allreduce(x, mesh_axes, reduction), [slot], kind="allreduce", collective=c)

    def allconcat(self, slot: int, mesh_axis: int, concat_axis: int, t: Tensor, nbytes=None) -> int:
        """Emit an all-gather of ``t`` (laid out as now) along tensor axis ``concat_axis``."""
        impl = self.mesh_impl(t)
        c = self._collective("allgather", slot, t, [mesh_axis], nbytes=nbytes)
        return self.emit(lambda x: impl.allconcat(x, mesh_axis, concat_axis), [slot], kind="allgather",
                         collective=c)

    def alltoall(self, slot: int, mesh_axis: int, split_axis: int, concat_axis: int, t: Tensor,
                 nbytes=None) -> int:
        """Emit an all-to-all of ``t`` along ``mesh_axis`` (split ``split_axis``, concat ``concat_axis``)."""
        impl = self.mesh_impl(t)
        c = self._collective("alltoall", slot, t, [mesh_axis], nbytes=nbytes)
        return self.emit(lambda x: impl.alltoall(x, mesh_axis, split_axis, concat_axis), [slot],
                         kind="alltoall", collective=c)

    def receive(self, slot: int, mesh_axis: int, source_pcoord, t: Tensor, nbytes=None) -> int:
        impl = self.mesh_impl(t)
        c = self._collective("receive", slot, t, [mesh_axis], nbytes=nbytes)
        src = list(source_pcoord)
        return self.emit(lambda x: impl.receive(x, mesh_axis, src), [slot], kind="receive", collective=c)

    # ---- bookkeeping used by the placeholder / variable / assign ops
    def register_placeholder(self, t: Tensor) -> int:
        s = self.new_slot()
        self._placeholders[t] = s
        return s

    def register_variable(self, var, initial_value) -> int:
        """Create storage for ``var`` (a Variable op) and return the slot its reads come from."""
        if var.name in self._variables_by_name:
            raise ValueError(f"Two variables named {var.name!r} in one graph.")
        self.variables[var] = initial_value
        self._variables_by_name[var.name] = var
        s = self.new_slot()
        self._var_reads[var] = s
        return s

    def register_assignment(self, assign_op, var, slot: int):
        self._assignments.setdefault(assign_op, []).append((var, slot))

    # ================================================================= running
    def _plan(self, fetches: list):
        result_slots = []
        assignments = []
        self._current_op = None
        for f in fetches:
            if isinstance(f, Operation) and f in self._assignments:
                assignments.extend(self._assignments[f])
                result_slots.append((None, None))
                continue
            if isinstance(f, Operation):
                if not f.outputs:
                    result_slots.append((None, None))
                    continue
                f = f.outputs[0]
            if not isinstance(f, Tensor):
                raise TypeError(f"Cannot fetch {f!r}: give mtf Tensors or Operations.")
            if f not in self._lowered:
                raise ValueError(f"Fetch {f.name!r} is not part of this lowering "
                                 "(was it added to the graph after Lowering was built?).")
            result_slots.append((self.get(f), f))
        needed = {s for s, _ in result_slots if s is not None} | {s for _, s in assignments}
        chosen = []
        for st in reversed(self.steps):
            if any(o in needed for o in st.outputs):
                chosen.append(st)
                needed.update(st.inputs)
        chosen.reverse()
        chosen = _hoist_collectives(chosen)
        # free each slot after its last use (never fetched/assigned/constant slots)
        keep = {s for s, _ in result_slots if s is not None} | {s for _, s in assignments}
        last_use: dict[int, int] = {}
        for i, st in enumerate(chosen):
            for s in st.inputs:
                last_use[s] = i
        frees = [[] for _ in chosen]
        for s, i in last_use.items():
            if s not in keep and s not in self._constants:
                frees[i].append(s)
        steps = [(st.fn, st.inputs, st.outputs, tuple(frees[i])) for i, st in enumerate(chosen)]
        counters = Counters()
        counters.runs = 1
        for st in chosen:
            if st.collective is not None:
                counters.records[st.collective] += 1
            counters.einsum_flops += st.flops
        return _Program(
            steps=steps,
            placeholders=[(t, s) for t, s in self._placeholders.items() if s in needed],
            var_reads=[(v, s) for v, s in self._var_reads.items() if s in needed],
            assignments=assignments,
            fetch_slots=result_slots,
            counters=counters,
        )

    def _program(self, fetches):
        key = tuple(id(f) for f in fetches)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._plan(list(fetches))
            self._programs[key] = prog
        return prog

    def plan_counters(self, fetches) -> Counters:
        """Communication and FLOPs that one ``run(fetches)`` will cost, computed without running."""
        fetches = list(fetches) if isinstance(fetches, list | tuple) else [fetches]
        c = Counters()
        c.add(self._program(fetches).counters)
        return c

    def run(self, fetches, feeds: dict | None = None, feed_slices: bool = False, return_slices: bool = False):
        """Execute the steps ``fetches`` need; return full ``torch.Tensor``s (None for assign ops).

        Args:
            fetches: a Tensor/Operation or a list of them. Fetched assign operations are executed
                and their assignments committed at the end of the run.
            feeds: ``{placeholder Tensor: torch.Tensor or numpy array}`` with the placeholder's
                full shape (dimension order as declared).
            feed_slices: feeds hold this process's *slices* instead of full tensors: one slice
                (slice shape, see :meth:`local_slice_bounds`) when the process holds one processor
                (SPMD, or a 1-processor mesh), else a list with one slice per
                ``mesh_impl.local_pnums()`` entry. No process then needs the whole batch.
            return_slices: return each fetched tensor as this process's slice(s) (same convention
                as ``feed_slices``) instead of the full tensor (which costs an all-gather on SPMD).

        Raises:
            FeedError: naming the placeholder, if one the fetches need is missing or has the wrong
                (full or slice) shape.
        """
        single = not isinstance(fetches, list | tuple)
        fetches = [fetches] if single else list(fetches)
        prog = self._program(fetches)
        env = [None] * self._n_slots
        for s, v in self._constants.items():
            env[s] = v
        feeds = feeds or {}
        for t, s in prog.placeholders:
            if t not in feeds:
                raise FeedError(f"Placeholder {t.name!r} {t.shape} is needed by the fetches but was not fed; "
                                f"pass feeds={{{t.name}: tensor}}.")
            if feed_slices:
                env[s] = self._import_slices(t, feeds[t])
            else:
                env[s] = self.mesh_impl(t).import_full(self._check_feed(t, feeds[t]), self.tensor_layout(t))
        for var, s in prog.var_reads:
            env[s] = self.variables[var]
        for fn, ins, outs, frees in prog.steps:
            if len(outs) == 1:
                env[outs[0]] = fn(*[env[i] for i in ins])
            else:
                for o, v in zip(outs, fn(*[env[i] for i in ins]), strict=True):
                    env[o] = v
            for f in frees:
                env[f] = None
        results = []
        for s, t in prog.fetch_slots:
            if s is None:
                results.append(None)
            elif return_slices:
                local = self.mesh_impl(t).local_slices(env[s])
                results.append(local[0] if len(local) == 1 else local)
            else:
                results.append(self.mesh_impl(t).export_full(env[s], self.tensor_layout(t)))
        for var, s in prog.assignments:
            self.variables[var] = self.mesh_impl(var.outputs[0]).materialize(env[s])
        self.counters.add(prog.counters)
        return results[0] if single else results

    def local_slice_bounds(self, t: Tensor) -> list[tuple[slice, ...]]:
        """Index ranges (one ``slice`` per dim of ``t``) of the slices this process holds, one per
        ``mesh_impl(t).local_pnums()`` entry: what to feed with ``run(..., feed_slices=True)``."""
        impl = self.mesh_impl(t)
        lay = self.tensor_layout(t)
        return [impl.slice_bounds(t.shape, p, lay) for p in impl.local_pnums()]

    def _import_slices(self, t: Tensor, value):
        impl = self.mesh_impl(t)
        n = len(impl.local_pnums())
        values = list(value) if isinstance(value, list | tuple) else [value]
        if len(values) != n:
            raise FeedError(f"Placeholder {t.name!r}: feed_slices=True needs {n} local slice(s) (one per "
                            f"processor this process holds), got {len(values)}.")
        want = tuple(self.slice_shape(t))
        out = []
        for p, v in zip(impl.local_pnums(), values, strict=True):
            v = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
            if tuple(v.shape) != want:
                raise FeedError(f"Placeholder {t.name!r} {t.shape} has slice shape {list(want)} on processor {p} "
                                f"(layout {self.tensor_layout(t)}), but was fed a slice of shape {list(v.shape)}.")
            out.append(v.to(device=impl.device(p), dtype=t.dtype))
        return impl.from_local_slices(out)

    def _check_feed(self, t: Tensor, value) -> torch.Tensor:
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        elif not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        want = tuple(t.shape.to_integer_list())
        if tuple(value.shape) != want:
            raise FeedError(f"Placeholder {t.name!r} expects shape {t.shape} (sizes {list(want)}), "
                            f"but was fed a tensor of shape {list(value.shape)}.")
        return value.to(t.dtype)

    # ================================================================= variables
    def _variable(self, var_or_name):
        if isinstance(var_or_name, str):
            try:
                return self._variables_by_name[var_or_name]
            except KeyError:
                raise KeyError(f"No variable named {var_or_name!r}; known: {sorted(self._variables_by_name)}") from None
        if isinstance(var_or_name, Tensor):
            var_or_name = var_or_name.operation
        if var_or_name not in self.variables:
            raise KeyError(f"{var_or_name!r} is not a variable of this lowering.")
        return var_or_name

    def variable_value(self, var_or_name) -> torch.Tensor:
        """The full value of a variable (by Variable op, its output tensor, or name)."""
        var = self._variable(var_or_name)
        out = var.outputs[0]
        return self.mesh_impl(out).export_full(self.variables[var], self.tensor_layout(out))

    def set_variable_value(self, var_or_name, value):
        """Overwrite a variable with a full tensor of its shape (cast to its dtype).

        Raises:
            FeedError: naming the variable, if the shape differs.
        """
        var = self._variable(var_or_name)
        out = var.outputs[0]
        value = self._check_feed(out, value).clone()
        self.variables[var] = self.mesh_impl(out).import_full(value, self.tensor_layout(out))

    @property
    def variable_names(self) -> list[str]:
        return list(self._variables_by_name)

    # ================================================================= inspection
    def program_str(self, fetches=None) -> str:
        """The program as text: one line per step (kind, op, slots, collective)."""
        steps = self.steps
        lines = []
        for i, st in enumerate(steps):
            extra = ""
            if st.collective is not None:
                c = st.collective
                extra = f" over {','.join(c.mesh_axes)} {c.bytes_per_processor} B/processor"
            lines.append(f"{i:4d} {st.kind:<10} {st.op:<28} {list(st.inputs)} -> {list(st.outputs)}{extra}")
        return "\n".join(lines)


def _hoist_collectives(steps: list) -> list:
    """Move each collective to just after the step producing its input.

    The order stays valid (a collective's inputs exist where it lands; its outputs are used no earlier
    than before) and is a deterministic function of the program, so every SPMD process issues the
    same collectives in the same order. A lazy all-reduce is emitted where its sum is first *needed*
    (e.g. by the optimizer update), so without this the gradient sums of all layers would start only
    after the whole backward pass; hoisted, an asynchronous all-reduce overlaps the remaining backward
    computation (as DDP's buckets do).
    """
    out: list = []
    for st in steps:
        if st.collective is None:
            out.append(st)
            continue
        made = {o: i for i, prev in enumerate(out) for o in prev.outputs}
        out.insert(max([-1] + [made.get(s, -1) for s in st.inputs]) + 1, st)
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shape_of(t: Tensor) -> Shape:
    return t.shape

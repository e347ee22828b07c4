"""Lowering: a named-dimension graph -> a program of per-processor steps, and running it.

``Lowering(graph, {mesh: mesh_impl})`` walks the graph once. Each operation's ``lower()`` emits
*steps* (a function of input slots producing output slots) through this object; collectives are
steps too and carry a :class:`~meshtorch.counters.Collective` record. The program is data: it
can be printed (``lowering.program_str()``), counted before running (``plan_counters``) and run
many times with no further planning (``run``).

Run semantics (stricter than Mesh TF): within one ``run`` every read of a variable sees its value
from before the run, and assignments take effect together at the end, so results never depend on
the order the steps happen to execute in. Random ops draw fresh values on every run: run number
``lowering.run_count`` (0 for the first) is part of their key (see ``run_counter_slot``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from meshtorch.core.errors import FeedError, LayoutError
from meshtorch.core.graph import Graph, Mesh, Operation, Tensor
from meshtorch.core.layout import TensorLayout
from meshtorch.counters import Collective, Counters
from meshtorch.mesh.base import MeshImpl
from meshtorch.program import Step, SubProgram, _Program, run_steps, select_steps  # noqa: F401


@dataclass
class _Lowered:
    slot: int
    pending: frozenset = frozenset()  # mesh axes of a deferred all-reduce (lazy sum)
    source: tuple | None = None  # (tensor, fn): this value is fn(source) with fn linear
    home: list | None = None  # the step list (main program or a sub-program) that computes it


class Lowering:
    """Plan a graph for the given meshes; then ``run`` it.

    Args:
        graph: the Graph (operations added after this call are not part of the program).
        mesh_to_impl: ``{Mesh: MeshImpl}``.
        autostack, log_file: Mesh TF's; accepted and unused (see ``memory_report`` for sizes).
        materialize: ``False`` plans without computing variables' initial values (a dry run:
            ``lowering.variables[v]`` is ``None``, the program, ``plan_counters`` and
            :mod:`meshtorch.planning` reports are the same; ``run`` raises RuntimeError).

    ``slot_bytes[slot]`` is the per-processor byte size of the value in ``slot`` for every slot
    a tensor was ``set`` to (and every forced all-reduce), from ``slice_shape`` and dtype.

    Raises:
        LayoutError: naming the tensor and dimension, if the layout rules are illegal for some
            tensor of the graph (size not divisible, two dims on one mesh axis, a dim an op needs
            whole is split).
    """

    def __init__(self, graph: Graph, mesh_to_impl: dict[Mesh, MeshImpl], autostack: bool = True, log_file=None,
                 materialize: bool = True):
        self.graph = graph
        self.materialize = materialize
        self.slot_bytes: dict[int, int] = {}  # slot -> per-processor bytes (for memory planning)
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
        #: number of completed ``run`` calls; random ops mix it into their keys (fresh draws each run)
        self.run_count = 0
        self._run_counter_slots: dict[Mesh, int] = {}
        self._scopes: list[list[Step]] = []  # step lists of the sub-programs being lowered (innermost last)
        self._target: list[Step] = self.steps  # where emit() appends
        for op in graph.operations:
            self._lower_op(op)
        self._current_op = None
        self._n_lowered_steps = len(self.steps)

    def _lower_op(self, op: Operation):
        self._current_op = op
        self.mesh_impl(op)
        for t in list(op.inputs) + list(op.outputs):
            self.tensor_layout(t, op)
        op.lower(self)

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

    def run_counter_slot(self, mesh: Mesh) -> int:
        """A slot refilled at every ``run`` with the run counter, laid out on ``mesh``.

        Each processor's value is the Python int :attr:`run_count` (runs completed before this
        one: 0, 1, 2, ...), the same on every processor. Random ops (``meshtorch.ops.random``)
        mix it into their keys so that every run draws fresh values (e.g. dropout masks per
        training step) that are still a pure function of (graph seed, op key, run, index).
        """
        slot = self._run_counter_slots.get(mesh)
        if slot is None:
            self.mesh_impl(mesh)  # validates that the mesh has an implementation
            slot = self._run_counter_slots[mesh] = self.new_slot()
        return slot

    def set(self, t: Tensor, slot: int, pending=frozenset(), source=None):
        """Record that ``t``'s laid-out value lives in ``slot``.

        ``pending``: mesh axes of a deferred all-reduce. ``source``: ``(tensor, fn)`` when the
        value is ``fn`` (linear, slicewise) of another lazy tensor; forcing then all-reduces the
        source once and reapplies ``fn``, so the source and its scaled copies share one all-reduce.
        """
        self._lowered[t] = _Lowered(slot, frozenset(pending), source if pending else None, self._target)
        self._record_bytes(slot, t)

    def _record_bytes(self, slot: int, t: Tensor):
        if slot not in self.slot_bytes:
            self.slot_bytes[slot] = int(np.prod(self.slice_shape(t), dtype=np.int64)) * _itemsize(t.dtype)

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
        """``(slot, pending_mesh_axes)``: the value may still be a partial sum over those axes."""
        lw = self._lookup(t)
        return lw.slot, lw.pending

    def get(self, t: Tensor) -> int:
        """Slot of ``t``'s laid-out value, emitting the deferred all-reduce first if one is pending."""
        lowered = self._lookup(t)
        if not lowered.pending:
            return lowered.slot
        if t not in self._forced:
            saved, self._current_op = self._current_op, t.operation  # attribute to the producer
            # emit the all-reduce where t was lowered: a tensor of an enclosing program forced
            # inside a loop body is all-reduced once, before the loop, not every iteration
            saved_target = self._target
            self._target = lowered.home if lowered.home is not None else self.steps
            try:
                if lowered.source is not None:
                    src, fn = lowered.source
                    self._forced[t] = self.slicewise(fn, self.get(src), mesh=t)
                else:
                    self._forced[t] = self.allreduce(lowered.slot, sorted(lowered.pending), "SUM", t)
                self._record_bytes(self._forced[t], t)
            finally:
                self._current_op = saved
                self._target = saved_target
        return self._forced[t]

    def emit(self, fn: Callable, inputs: Sequence[int], num_outputs: int = 1, kind: str = "compute",
             collective: Collective | None = None, flops: int = 0, subprograms: Sequence = ()):
        """Append a step; returns the output slot (or a tuple of slots).

        ``subprograms``: ``(label, SubProgram)`` pairs the step runs, listed by ``program_str``.
        """
        outs = tuple(self.new_slot() for _ in range(num_outputs))
        op = self._current_op.name if self._current_op is not None else "<fetch>"
        self._target.append(Step(fn, tuple(inputs), outs, op, kind, collective, flops, tuple(subprograms)))
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

    # ---- sub-programs (loop bodies and conditions)
    def lower_subprogram(self, ops: Sequence[Operation], inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                         lazy: Sequence[bool] | None = None) -> SubProgram:
        """Lower ``ops`` (in order) into their own step list instead of the current one.

        ``inputs`` are tensors the caller supplies at every execution (each gets a fresh slot);
        tensors of the enclosing program that the ops read become the sub-program's
        ``external_slots``. A pending all-reduce of an enclosing-program tensor is emitted in the
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
        chosen, frees = select_steps(steps, set(out_slots), keep=set(out_slots) | set(self._constants))
        produced = {o for st in chosen for o in st.outputs} | set(in_slots)
        reads = [s for st in chosen for s in st.inputs] + out_slots
        external = tuple(dict.fromkeys(s for s in reads if s not in produced))
        counters = Counters()
        for st in chosen:
            if st.collective is not None:
                counters.records[st.collective] += 1
            counters.einsum_flops += st.flops
        frees = [tuple(f for f in fr if f in produced) for fr in frees]
        return SubProgram([(st.fn, st.inputs, st.outputs, frees[i]) for i, st in enumerate(chosen)],
                          tuple(in_slots), external, tuple(out_slots), tuple(pending), counters, chosen)

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
        # free each slot after its last use (never fetched/assigned/constant slots)
        keep = set(needed) | set(self._constants)
        chosen, frees = select_steps(self.steps, needed, keep)
        needed |= {s for st in chosen for s in st.inputs}
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
            listing=chosen,
        )

    def _program(self, fetches):
        key = tuple(id(f) for f in fetches)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._plan(list(fetches))
            self._programs[key] = prog
        return prog

    def plan_counters(self, fetches, loop_iterations: int | dict | None = None) -> Counters:
        """Communication and FLOPs that one ``run(fetches)`` will cost, computed without running.

        Args:
            fetches: as for :meth:`run`.
            loop_iterations: the trip counts of the ``while_loop`` s the fetches run, which cannot be
                known before running: one int for every loop, or ``{loop op name: int}`` (loops not
                named run 0 times). A loop of ``n`` iterations counts its body ``n`` times and its
                condition ``n + 1`` times, as :meth:`run` does; a nested loop's count is per
                iteration of the enclosing loop. Default None: loop bodies and conditions count
                zero times.

        Returns:
            :class:`~meshtorch.counters.Counters` (``runs`` = 1).

        Raises:
            ValueError: a negative trip count, or a name in ``loop_iterations`` that is no while loop
                of this program (the message lists the loops there are).
        """
        fetches = list(fetches) if isinstance(fetches, list | tuple) else [fetches]
        prog = self._program(fetches)
        c = Counters()
        c.add(prog.counters)
        if loop_iterations is None:
            return c
        seen = []

        def walk(steps, times):
            for st in steps:
                if st.kind != "while_loop":
                    continue
                seen.append(st.op)
                n = loop_iterations if isinstance(loop_iterations, int) else loop_iterations.get(st.op, 0)
                if int(n) != n or n < 0:
                    raise ValueError(f"plan_counters: while_loop {st.op!r} needs a trip count >= 0, got {n!r}.")
                subs = dict(st.subprograms)
                for label, k in (("cond", n + 1), ("body", n)):
                    c.add(subs[label].counters, times * k)
                    walk(subs[label].listing, times * k)

        walk(prog.listing, 1)
        if isinstance(loop_iterations, dict):
            unknown = sorted(set(loop_iterations) - set(seen))
            if unknown:
                raise ValueError(f"plan_counters: loop_iterations names {unknown}, which are not while loops of "
                                 f"this program; its while loops are {sorted(set(seen))}.")
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
            RuntimeError: on a dry-run lowering (``materialize=False``).
        """
        if not self.materialize:
            raise RuntimeError("Lowering(..., materialize=False) is a dry run for planning: its variables have "
                               "no storage, so it cannot run; build a Lowering with materialize=True to run.")
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
        count = self.run_count
        for mesh, s in self._run_counter_slots.items():
            env[s] = self.mesh_impl(mesh).laid_out_constant(lambda p: count)
        run_steps(prog.steps, env)
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
        self.run_count += 1
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

    def set_variable_slices(self, var_or_name, fn: Callable[[int], torch.Tensor]):
        """Overwrite a variable slice by slice: processor ``pnum`` gets ``fn(pnum)``.

        ``fn(pnum)`` must return that processor's slice (dims in the variable's order, sizes
        ``mesh_impl.slice_shape``); it is cast to the variable's dtype and moved to the processor's
        device. Only the processors this process holds are asked (all of them on a placement mesh,
        the local one under SPMD), so no process ever needs the full tensor. Used by
        :func:`meshtorch.restore`.

        Raises:
            FeedError: naming the variable and processor, if a slice has the wrong shape.
        """
        var = self._variable(var_or_name)
        out = var.outputs[0]
        impl = self.mesh_impl(out)
        want = impl.slice_shape(out.shape, self.tensor_layout(out))

        def make(p):
            t = fn(p)
            if list(t.shape) != want:
                raise FeedError(f"set_variable_slices: variable {var.name!r} {out.shape} needs slices of sizes "
                                f"{want} on processor {p}, got {list(t.shape)}.")
            return t.to(device=impl.device(p), dtype=out.dtype)

        self.variables[var] = impl.laid_out_constant(make)

    @property
    def variable_names(self) -> list[str]:
        return list(self._variables_by_name)

    # ================================================================= inspection
    def program_str(self, fetches=None) -> str:
        """The program as text: one line per step (kind, op, slots, collective)."""
        lines = []

        def show(steps, indent):
            for i, st in enumerate(steps):
                extra = ""
                if st.collective is not None:
                    c = st.collective
                    extra = f" over {','.join(c.mesh_axes)} {c.bytes_per_processor} B/processor"
                lines.append(f"{indent}{i:4d} {st.kind:<10} {st.op:<28} {list(st.inputs)} -> {list(st.outputs)}{extra}")
                for label, sub in st.subprograms:
                    lines.append(f"{indent}     {label}: inputs {list(sub.input_slots)} external "
                                 f"{list(sub.external_slots)} -> {list(sub.output_slots)}")
                    show(sub.listing, indent + "     | ")

        show(self.steps, "")
        return "\n".join(lines)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


"""Lowering: a named-dimension graph -> a program of per-processor steps, and running it.

``Lowering(graph, {mesh: mesh_impl})`` is Mesh TensorFlow's facade over four parts (the same stages as
values: :func:`~meshtorch.lowering.stages.plan` -> ``Program`` -> :func:`~meshtorch.lowering.session.bind`
-> ``Session``):

* :class:`~meshtorch.lowering.planner.Planner`: graph + mesh shapes + layout rules -> program;
* :class:`~meshtorch.lowering.program.Program`: the program as data (typed steps; printable,
  serialisable with ``to_json``, re-targetable to another implementation of the same mesh);
* :class:`~meshtorch.lowering.session.Session`: the program bound to mesh implementations: run,
  feeds, fetches, counters, run counter;
* :class:`~meshtorch.lowering.variables.VariableStore`: the variables' laid-out values, used by
  checkpoints, interchange and planning.

Run semantics (stricter than Mesh TF): within one ``run`` every read of a variable sees its value
from before the run, and assignments take effect together at the end. Random ops draw fresh
values on every run: ``lowering.run_count`` is part of their key.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch

from meshtorch.core.graph import Graph, Mesh, Operation, Tensor
from meshtorch.core.layout import TensorLayout
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering.counters import Collective, Counters
from meshtorch.lowering.planner import Planner
from meshtorch.lowering.program import Program, Step, SubProgram, program_str, select_steps
from meshtorch.lowering.session import Session, bind, check_compile_backend
from meshtorch.lowering.stages import PlanOptions, fetch_keys, plan
from meshtorch.lowering.stages import default_buckets as default_bucket_rule
from meshtorch.lowering.variables import VariableStore
from meshtorch.mesh.base import MeshImpl
from meshtorch.mesh.factory import placement_mesh_impl

__all__ = ["Lowering", "Program", "Session", "Step", "SubProgram", "VariableStore", "Collective", "Counters",
           "Planner", "PlanOptions", "plan", "bind"]


def _backend(x) -> MeshImpl:
    """A mesh implementation as given, or a :class:`PlacementMeshImpl` running a :class:`MeshSpec`.

    Raises:
        TypeError: for anything else, naming its type.
    """
    if isinstance(x, MeshImpl):
        return x
    if isinstance(x, MeshSpec):
        return placement_mesh_impl(x)
    raise TypeError(f"Lowering: expected a MeshImpl or a MeshSpec per mesh, got {type(x).__name__}.")


class _VariablesByOp(MutableMapping):
    """``{Variable op: laid-out value}`` over the variable store (Mesh TF-era access)."""

    def __init__(self, store: VariableStore, ops: dict):
        self.store, self.ops = store, ops

    def __getitem__(self, var):
        self.store.draw_pending([var.name])
        return self.store.values[var.name]

    def __setitem__(self, var, value):
        self.store.pending.pop(var.name, None)
        self.store.values[var.name] = value

    def __delitem__(self, var):
        raise TypeError("variables cannot be removed from a lowering")

    def __iter__(self):
        return iter(self.ops[n] for n in self.store.names)

    def __len__(self):
        return len(self.store.names)

    def __contains__(self, var):
        return getattr(var, "name", None) in self.ops and self.ops[var.name] is var


class Lowering:
    """Plan a graph for the given meshes; then ``run`` it.

    Args:
        graph: the Graph (operations added after this call are not part of the program).
        mesh_to_impl: ``{Mesh: MeshImpl}`` (Mesh TF's argument), or ``{Mesh: MeshSpec}``: a spec runs on a
            :class:`~meshtorch.mesh.placement.PlacementMeshImpl` (the mesh simulated in this process).
        autostack, log_file: Mesh TF's; accepted and unused (see ``memory_report`` for sizes).
        materialize: ``False`` plans without computing variables' initial values (a dry run:
            ``lowering.variables[v]`` is ``None``; the program, ``plan_counters`` and
            :mod:`meshtorch.planning` reports are the same; ``run`` raises RuntimeError).
        mode: how runs execute: ``"codegen"`` (one generated Python function per fetch set),
            ``"interpret"`` (a loop over the steps) or ``"compile"`` (that function through
            ``torch.compile``); see :class:`~meshtorch.lowering.session.Session`.
        bucket_bytes: > 0 issues the SUM all-reduces of a run (data-parallel gradient sums) in buckets
            of at most that many bytes per processor, one collective call each (DDP's buckets); the
            counters and results are the same. Default (None): the largest ``default_bucket_bytes`` of the
            mesh implementations (25 MiB on :class:`~meshtorch.SpmdMeshImpl`, DDP's default; 0 on the
            placement mesh), or 0 when the program all-reduces a low-precision (16-bit) tensor: a flat
            bucket makes gloo add its elements in another order, which bfloat16 rounding shows. As
            DistributedDataParallel with its default ``bucket_cap_mb``, the default also closes the first
            all-reduce bucket once it holds 1 MiB (``_DEFAULT_FIRST_BUCKET_BYTES``), so the last layers'
            gradient sum starts while the backward pass goes on; a given ``bucket_bytes`` has no
            smaller first bucket (DDP's rule too).
        init: ``"random"`` draws every variable's initial value now (each process its own slices, in
            chunks: the transient stays small whatever the model's size); ``"lazy"`` draws a variable
            only when a run (or ``variable_value``) first needs it, so variables a checkpoint restore or
            a state-dict import sets first (``set_variable_value`` / ``set_variable_slices``) are never
            drawn. The values are the same either way.
        compile_backend: ``torch.compile``'s ``backend`` in mode ``"compile"`` (default ``"inductor"``;
            ``"aot_eager"``: the same captured graph without generated kernels).

    Attributes:
        program: the :class:`Program`; ``session``: the :class:`Session`; ``store``: the
            :class:`VariableStore`; ``planner``: the :class:`Planner`.

    Raises:
        LayoutError: naming the tensor and dimension, if the layout rules are illegal for some
            tensor of the graph (size not divisible, two dims on one mesh axis, a dim an op needs
            whole is split).
        ValueError: an unknown ``mode``, ``init`` or ``compile_backend``, or a negative ``bucket_bytes``, before
            planning.
    """

    def __init__(self, graph: Graph, mesh_to_impl: dict, autostack: bool = True, log_file=None,
                 materialize: bool = True, mode: str = "codegen", bucket_bytes: int | None = None,
                 init: str = "random", compile_backend: str = "inductor"):
        if mode not in ("codegen", "interpret", "compile"):
            raise ValueError(f"Lowering: mode must be 'codegen', 'interpret' or 'compile', got {mode!r}.")
        check_compile_backend(compile_backend)
        impls_by_mesh = {m: _backend(v) for m, v in mesh_to_impl.items()}
        default_buckets = bucket_bytes is None
        if default_buckets:
            bucket_bytes = max([int(i.default_bucket_bytes) for i in impls_by_mesh.values()], default=0)
        if not (isinstance(bucket_bytes, int) and bucket_bytes >= 0):
            raise ValueError(f"Lowering: bucket_bytes must be an int >= 0 (0: no buckets), got {bucket_bytes!r}.")
        if init not in ("random", "lazy"):
            raise ValueError(f"Lowering: init must be 'random' or 'lazy', got {init!r}.")
        self.graph = graph
        self.materialize = materialize
        self.planner = Planner(graph, {m: i.spec for m, i in impls_by_mesh.items()})
        self.program = self.planner.program
        self._mesh_to_impl = impls_by_mesh
        first_bucket_bytes = 0
        if default_buckets:
            bucket_bytes, first_bucket_bytes = default_bucket_rule(graph, self.program, bucket_bytes)
        impls = {m.name: i for m, i in impls_by_mesh.items()}
        self.store = VariableStore(self.program, impls, initialize=False)
        if materialize:
            self.store.initialize(lazy=init == "lazy")
        self.session = Session(self.program, impls, self.store, mode, bucket_bytes, first_bucket_bytes,
                               compile_backend)
        self.variables = _VariablesByOp(self.store, self.planner.variable_ops)

    @property
    def mesh_to_impl(self) -> dict:
        """``{Mesh: MeshImpl}`` (the backends the program runs on). Assigning backends with the same specs
        re-binds the session and the variable store to them (variable values are kept as they are)."""
        return dict(self._mesh_to_impl)

    @mesh_to_impl.setter
    def mesh_to_impl(self, mesh_to_impl: dict):
        self._mesh_to_impl = {m: _backend(v) for m, v in mesh_to_impl.items()}
        impls = {m.name: i for m, i in self._mesh_to_impl.items()}
        self.store.impls = impls
        old = self.session
        self.session = Session(self.program, impls, self.store, old.mode, old.bucket_bytes, old.first_bucket_bytes,
                               old.compile_backend)
        self.session.counters, self.session.run_count = old.counters, old.run_count

    @property
    def mesh_to_spec(self) -> dict:
        """``{Mesh: MeshSpec}``: what the program was planned for."""
        return dict(self.planner.mesh_to_spec)

    # ---- Mesh TF-era attributes
    @property
    def steps(self) -> list[Step]:
        return self.program.steps

    @property
    def slot_bytes(self) -> dict:
        return self.program.slot_bytes

    @property
    def counters(self) -> Counters:
        """The collectives the runs so far *executed* (as the mesh implementations recorded them in the
        flight recorder, :mod:`meshtorch.mesh.recorder`; counted per op in the planned format) and their
        einsum FLOPs; :meth:`plan_counters` gives the *planned* ones, ``plan_counters(f).diff(counters)``
        where they differ. Runs of a ``torch.compile`` d plan count their plan (see
        :class:`~meshtorch.lowering.session.Session`)."""
        return self.session.counters

    @property
    def run_count(self) -> int:
        """Runs completed (random ops key on it); set it to replay a run's random draws."""
        return self.session.run_count

    @run_count.setter
    def run_count(self, value: int):
        self.session.run_count = int(value)

    def mesh_impl(self, x) -> MeshImpl:
        """The backend of ``x``'s mesh (``x``: a Mesh, tensor or operation)."""
        self.planner.mesh_spec(x)  # a clear error for a mesh the lowering was not given
        return self._mesh_to_impl[x if isinstance(x, Mesh) else x.mesh]

    def mesh_spec(self, x) -> MeshSpec:
        """The :class:`~meshtorch.core.mesh_spec.MeshSpec` of ``x``'s mesh."""
        return self.planner.mesh_spec(x)

    def tensor_layout(self, t: Tensor) -> TensorLayout:
        """The layout ``t``'s value is produced (and, for a variable, stored) in."""
        return self.planner.tensor_layout(t)

    def slice_shape(self, t: Tensor) -> list[int]:
        """Per-processor slice sizes of ``t`` in the layout it is produced (stored) in."""
        return self.mesh_impl(t).slice_shape(t.shape, self.tensor_layout(t))

    # ---- running
    def _fetch_keys(self, fetches: list) -> tuple:
        return fetch_keys(self.planner, fetches)

    def plan(self, fetches, given=(), stash=()):
        """The session's :class:`~meshtorch.lowering.session.Plan` for ``fetches`` (Tensors/Operations), given
        the slots ``given`` and keeping the slots ``stash`` (see :meth:`run_stashed`)."""
        fetches = list(fetches) if isinstance(fetches, list | tuple) else [fetches]
        return self.session.plan(self._fetch_keys(fetches), tuple(given), tuple(stash))

    def stash_slots(self, first, later, given=()) -> tuple:
        """The slots a run of ``later`` (Tensors/Operations) reads from the steps a run of ``first`` computes
        (both given the slots ``given``): what ``first`` must stash so that ``later``, given them
        (:meth:`run_stashed`), runs none of ``first``'s steps. For a forward output and its gradients these are
        the activations autodiff saved (the transpose's inputs from the forward pass), so the backward does not
        recompute the forward; for an input gradient and the weight gradients, the activation gradients."""
        first = list(first) if isinstance(first, list | tuple) else [first]
        later = list(later) if isinstance(later, list | tuple) else [later]
        prog = self.program

        def steps(fetches):
            slots = {prog.tensors[k[1]].slot if k[0] == "tensor" else None for k in self._fetch_keys(fetches) if k}
            slots |= {s for k in self._fetch_keys(fetches) if k and k[0] == "assign" for _, s in
                      prog.assignments[k[1]]}
            return select_steps(prog.steps, slots - {None}, set(), given)[0]

        done = {id(st) for st in steps(first)}
        later_steps = steps(later)
        shared = {o for st in later_steps if id(st) in done for o in st.outputs}
        return tuple(sorted({s for st in later_steps if id(st) not in done for s in st.inputs} & shared))

    def run_stashed(self, fetches: list, feeds: dict | None = None, given: dict | None = None,
                    stash: tuple = ()) -> tuple[list, dict]:
        """:meth:`run` ``fetches`` (a list) handing laid-out values between runs: ``given`` (``{slot: laid-out
        value}``, a dict an earlier ``run_stashed`` of this lowering returned) replaces the steps producing
        those slots; ``stash`` (slots, e.g. :meth:`stash_slots`) are kept and returned. Returns ``(results,
        {slot: laid-out value})``. The values are this process's, never exported or copied."""
        if not self.materialize:
            raise RuntimeError("Lowering(..., materialize=False) is a dry run: it cannot run.")
        named = {t.name: v for t, v in (feeds or {}).items()}
        out = self.session.run(self._fetch_keys(list(fetches)), named, given=given, stash=tuple(stash))
        return (out[:-1], out[-1]) if stash else (out, {})

    def to_json(self, fetches=()) -> str:
        """The program as JSON, with ``fetches`` (Tensors to be fetched by name) made fetchable first.

        Raises:
            NotDataError: naming the op whose kernel is a closure.
        """
        self._fetch_keys(list(fetches))
        return self.program.to_json()

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
        named = {t.name: v for t, v in (feeds or {}).items()}
        out = self.session.run(self._fetch_keys(fetches), named, feed_slices, return_slices)
        return out[0] if single else out

    def plan_counters(self, fetches, loop_iterations: int | dict | None = None, given=()) -> Counters:
        """Communication and FLOPs that one ``run(fetches)`` will cost, computed without running.

        Args:
            fetches: as for :meth:`run`.
            loop_iterations: the trip counts of the ``while_loop`` s the fetches run, which cannot be
                known before running: one int for every loop, or ``{loop op name: int}`` (loops not
                named run 0 times). A loop of ``n`` iterations counts its body ``n`` times and its
                condition ``n + 1`` times, as :meth:`run` does; a nested loop's count is per
                iteration of the enclosing loop. Default None: loop bodies and conditions count
                zero times.
            given: slots the run is given (:meth:`run_stashed`): their producing steps are not counted.

        Returns:
            :class:`~meshtorch.lowering.counters.Counters` (``runs`` = 1).

        Raises:
            ValueError: a negative trip count, or a name in ``loop_iterations`` that is no while loop
                of this program (the message lists the loops there are).
        """
        plan = self.plan(fetches, given)
        c = Counters()
        c.add(plan.counters)
        if loop_iterations is None:
            return c
        seen = []

        def walk(steps, times):
            for st in steps:
                if not st.subprograms:
                    continue
                seen.append(st.op)
                n = loop_iterations if isinstance(loop_iterations, int) else loop_iterations.get(st.op, 0)
                if int(n) != n or n < 0:
                    raise ValueError(f"plan_counters: while_loop {st.op!r} needs a trip count >= 0, got {n!r}.")
                subs = dict(st.subprograms)
                for label, k in (("cond", n + 1), ("body", n)):
                    c.add(subs[label].counters, times * k)
                    walk(subs[label].steps, times * k)

        walk(plan.steps, 1)
        if isinstance(loop_iterations, dict):
            unknown = sorted(set(loop_iterations) - set(seen))
            if unknown:
                raise ValueError(f"plan_counters: loop_iterations names {unknown}, which are not while loops of "
                                 f"this program; its while loops are {sorted(set(seen))}.")
        return c

    def local_slice_bounds(self, t: Tensor) -> list[tuple[slice, ...]]:
        """Index ranges (one ``slice`` per dim of ``t``) of the slices this process holds, one per
        ``mesh_impl(t).local_pnums()`` entry: what to feed with ``run(..., feed_slices=True)``."""
        impl = self.mesh_impl(t)
        lay = self.tensor_layout(t)
        return [impl.slice_bounds(t.shape, p, lay) for p in impl.local_pnums()]

    # ---- variables
    def _variable(self, var_or_name) -> Operation:
        if isinstance(var_or_name, str):
            try:
                return self.planner.variable_ops[var_or_name]
            except KeyError:
                raise KeyError(f"No variable named {var_or_name!r}; known: "
                               f"{sorted(self.planner.variable_ops)}") from None
        if isinstance(var_or_name, Tensor):
            var_or_name = var_or_name.operation
        if var_or_name not in self.variables:
            raise KeyError(f"{var_or_name!r} is not a variable of this lowering.")
        return var_or_name

    def variable_value(self, var_or_name) -> torch.Tensor:
        """The full value of a variable (by Variable op, its output tensor, or name)."""
        return self.store.value(self._variable(var_or_name).name)

    def set_variable_value(self, var_or_name, value):
        """Overwrite a variable with a full tensor of its shape (cast to its dtype).

        Raises:
            FeedError: naming the variable, if the shape differs.
        """
        self.store.set_value(self._variable(var_or_name).name, value)

    def set_variable_slices(self, var_or_name, fn: Callable[[int], torch.Tensor]):
        """Overwrite a variable slice by slice: processor ``pnum`` gets ``fn(pnum)``.

        ``fn(pnum)`` must return that processor's slice (dims in the variable's order, sizes
        ``mesh_impl.slice_shape`` of its storage layout); it is cast to the variable's dtype and moved
        to the processor's device. Only the processors this process holds are asked (all of them on
        a placement mesh, the local one under SPMD), so no process ever needs the full tensor. Used
        by :func:`meshtorch.restore`.

        Raises:
            FeedError: naming the variable and processor, if a slice has the wrong shape.
        """
        self.store.set_slices(self._variable(var_or_name).name, fn)

    @property
    def variable_names(self) -> list[str]:
        return self.store.names

    # ---- inspection
    def program_str(self, fetches=None) -> str:
        """The program as text: one line per step (kind, op, slots, collective); with ``fetches``, only
        the steps one ``run(fetches)`` executes, in its order."""
        return program_str(self.program.steps if fetches is None else self.plan(fetches).steps)


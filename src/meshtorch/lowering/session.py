"""A session: a program bound to mesh implementations and a variable store, run many times.

Run semantics (stricter than Mesh TF): within one run every read of a variable sees its value from
before the run, and assignments take effect together at the end, so results never depend on the
order the steps happen to execute in. Assignments are written in place into the variables' storage
(:meth:`~meshtorch.lowering.variables.VariableStore.commit`: a variable's slices keep their storage
from run to run); fetched results that alias a written variable are copies. Random ops draw fresh
values on every run: the number of completed runs (:attr:`Session.run_count`) is part of their key.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from meshtorch.core.errors import FeedError
from meshtorch.core.layout import TensorLayout
from meshtorch.lowering import codegen, executor
from meshtorch.lowering.counters import Counters
from meshtorch.lowering.planner import mesh_record
from meshtorch.lowering.plans import Plan, fetch_plan
from meshtorch.lowering.program import Program
from meshtorch.lowering.variables import VariableStore, check_full, spec_shape
from meshtorch.mesh.recorder import CollectiveRecord, flight_recorder


def check_backends(program: Program, impls: dict) -> None:
    """Raise ValueError, naming the mesh, unless ``impls`` has a backend of the planned spec for each mesh."""
    for name, m in program.meshes.items():
        impl = impls.get(name)
        if impl is None:
            raise ValueError(f"Session: no MeshImpl given for mesh {name!r} of the program.")
        mine = mesh_record(impl)
        if mine != m:
            raise ValueError(f"Session: mesh {name!r} was planned as {m}, but the implementation has {mine}; "
                             "plan again for this mesh, or build the implementation with the planned shape "
                             "and rules.")


def check_compile_backend(name) -> None:
    """Refuse a ``torch.compile`` backend name that dynamo does not register (ValueError naming the known ones)."""
    if name == "inductor":  # torch's default, always registered (listing imports dynamo: seconds)
        return
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(f"compile backend must be one torch._dynamo.list_backends names, e.g. 'inductor' or "
                         f"'aot_eager'; got {name!r} (known: {', '.join(known)}).")


class Session:
    """Runs ``program`` on ``{mesh name: MeshImpl}`` with the variables in ``store``.

    ``bucket_bytes`` > 0 merges SUM all-reduces over the same mesh axes, reduce-scatters over the same
    mesh axis, and consecutive weight all-gathers into buckets of at most that many bytes per
    processor, one collective call each (DDP's and FSDP's buckets; :mod:`meshtorch.lowering.schedule`);
    ``first_bucket_bytes`` > 0 closes the first all-reduce bucket at that size (DDP's 1 MiB first bucket).
    With storage rules, weight gathers are issued ``impl.prefetch`` gathers ahead (FSDP's prefetch).

    ``mode``: ``"codegen"`` (default) runs each plan as one generated straight-line Python function
    (:mod:`meshtorch.lowering.codegen`); ``"interpret"`` loops over the bound steps
    (:func:`~meshtorch.lowering.executor.run_steps`); both give bitwise-equal results.
    ``"compile"`` hands the generated function to ``torch.compile`` (inductor fuses the kernels; an
    SPMD mesh's collectives become functional collectives, nodes of the same graph, see
    :meth:`~meshtorch.mesh.base.MeshImpl.traceable`; only ``collective_permute`` breaks the graph): the first
    run of each fetch set compiles (tens of seconds on a CPU), :attr:`compile_seconds` records it;
    results agree to float rounding. A plan
    with random ops (dropout) is not compiled (``compile_seconds`` None): their key includes the run
    number, which ``torch.compile`` would specialise on.

    :attr:`counters` (``lowering.counters``) are the *executed* collectives: the mesh implementations
    record each collective call they make in the flight recorder (:mod:`meshtorch.mesh.recorder`), and
    each run's records are counted (:meth:`~meshtorch.lowering.counters.Counters.from_records`; FLOPs
    are the plan's). A ``torch.compile`` d plan is the exception: once compiled, the graph runs without
    calling the implementation's Python methods, so nothing can time or observe its individual
    collectives; each run of a compiled plan adds one record per collective *of its plan* to the flight
    recorder (``source="plan"``, no time; a while loop's iterations add their planned counters), so
    for compiled runs ``counters`` equal ``plan_counters`` by construction. Compare executed with
    planned collectives in an uncompiled mode (``"codegen"``, ``"interpret"``). With the flight recorder
    off (``flight_recorder().enabled = False``) uncompiled runs count no collectives.

    ``compile_backend``: ``torch.compile``'s ``backend`` for mode ``"compile"`` (default ``"inductor"``;
    ``"aot_eager"`` traces the same one-graph step through dynamo and AOTAutograd without generating
    kernels: a check of the capture that compiles in seconds).

    Raises:
        ValueError: an unknown ``mode`` or ``compile_backend`` (one ``torch._dynamo.list_backends``
            does not name), or an implementation whose mesh shape or rules differ from the program's.

    """

    def __init__(self, program: Program, impls: dict, store: VariableStore, mode: str = "codegen",
                 bucket_bytes: int = 0, first_bucket_bytes: int = 0, compile_backend: str = "inductor"):
        if mode not in ("codegen", "interpret", "compile"):
            raise ValueError(f"Session: mode must be 'codegen', 'interpret' or 'compile', got {mode!r}.")
        check_compile_backend(compile_backend)
        self.mode = mode
        #: ``torch.compile``'s ``backend`` in mode ``"compile"``
        self.compile_backend = compile_backend
        #: gradient bucket size in bytes per processor (0: one all-reduce call per value; see schedule.py)
        self.bucket_bytes = int(bucket_bytes)
        #: > 0: the first all-reduce bucket closes once it holds this many bytes (DDP's first bucket)
        self.first_bucket_bytes = int(first_bucket_bytes)
        #: seconds spent compiling, per fetch set (mode "compile"): the first run of each
        self.compile_seconds: dict = {}
        check_backends(program, impls)
        self.program = program
        self.impls = impls
        self.store = store
        #: the executed collectives (flight-recorder records of every run, counted) and the plans' FLOPs
        self.counters = Counters()
        #: the planned counters of the loop iterations of the current run (while loops add them)
        self._loops = Counters()
        #: number of completed runs; random ops mix it into their keys (fresh draws each run)
        self.run_count = 0
        self._constants: dict | None = None
        self._plans: dict = {}
        #: ``[(slot, mesh name)]`` of the run-counter constants, refilled at every run
        self._run_counters = [(s, mesh) for s, (kind, mesh, _) in program.constants.items() if kind == "run_counter"]

    @property
    def constant_values(self) -> dict:
        """``{slot: laid-out value}`` of the program's constants on these implementations (run
        counters excluded), evaluated on first use."""
        if self._constants is None:
            self._constants = executor.evaluate_constants(self.program, self.impls)
        return self._constants

    def plan(self, fetches: tuple, given: tuple = (), stash: tuple = ()) -> Plan:
        """The :class:`Plan` of ``fetches``: ``("tensor", name)``, ``("assign", op name)`` or ``None``; ``given``
        and ``stash``: slots as :func:`~meshtorch.lowering.plans.fetch_plan` takes them."""
        key = fetches if not (given or stash) else (fetches, tuple(sorted(given)), tuple(stash))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(fetches, given, stash)
        return plan

    def _make_plan(self, fetches, given: tuple = (), stash: tuple = ()) -> Plan:
        return fetch_plan(self.program, fetches, self.impls, self.bucket_bytes, self.first_bucket_bytes,
                          tuple(sorted(given)), tuple(stash))

    def run(self, fetches: tuple, feeds: dict, feed_slices: bool = False, return_slices: bool = False,
            given: dict | None = None, stash: tuple = ()) -> list:
        """Execute ``fetches`` (see :meth:`plan`) with ``feeds`` = ``{placeholder name: value}``.

        Returns the full tensors (or this process's slices with ``return_slices``), None for
        assign fetches; commits the assignments. With ``stash`` (slots) the results are followed by one
        ``{slot: laid-out value}`` dict of those slots; ``given`` = ``{slot: laid-out value}`` (such a dict from
        an earlier run of this session) stands in for the steps producing those slots.

        Raises:
            FeedError: naming the placeholder, if one the fetches need is missing or misshapen.
        """
        given = given or {}
        plan = self.plan(fetches, tuple(given), tuple(stash))
        if self.mode == "interpret" and not plan.bound and plan.steps:
            plan.bound = executor.bind(plan.steps, plan.frees, self.impls, self._loops)
        first_compile = False
        if self.mode != "interpret" and plan.fn is None:
            produced = {o for st in plan.steps for o in st.outputs}
            reads = {s for st in plan.steps for s in st.inputs} - produced
            writes = ({s for s, _ in plan.fetch_slots if s is not None} | {s for _, s in plan.assignments}
                      | set(plan.stash))
            counters_read = {s for s, _ in self._run_counters} & reads
            compiled = self.mode == "compile" and not counters_read
            # compiled: collectives as functional collectives, so one graph holds the whole step
            impls = {m: impl.traceable() for m, impl in self.impls.items()} if compiled else self.impls
            for impl in impls.values() if compiled else ():
                impl.precompute_groups()  # no cache key added while tracing: no recompilation on run 2
            plan.fn = codegen.generate(plan.steps, plan.frees, impls, self._loops, reads, writes, tagged=not compiled)
            plan.compiled = compiled
            if compiled:
                plan.fn = torch.compile(plan.fn, dynamic=False, backend=self.compile_backend)
                plan.compiled = first_compile = True
            elif self.mode == "compile":
                # random ops key on the run number, a Python int torch.compile would specialise on (one
                # recompilation per run): such plans run as the generated function, uncompiled
                self.compile_seconds[fetches] = None
        env = [None] * self.program.n_slots
        for s, v in self.constant_values.items():
            env[s] = v
        for s, v in given.items():
            env[s] = v
        p = self.program
        for name, s in plan.placeholders:
            spec = p.placeholders[name]
            if name not in feeds:
                raise FeedError(f"Placeholder {name!r} {spec_shape(spec)} is needed by the fetches but was not fed; "
                                f"pass feeds={{{name}: tensor}}.")
            env[s] = self.import_slices(name, feeds[name]) if feed_slices else self.impls[spec.mesh].import_full(
                check_full(name, spec, _as_torch(feeds[name])), TensorLayout(spec.layout))
        if self.store.pending:
            self.store.draw_pending([name for name, _ in plan.var_reads])
        if self.store.untouched:
            self.store.populate([name for name, _ in plan.var_reads])
        for name, s in plan.var_reads:
            env[s] = self.store.values[name]
            if env[s] is None:
                self.store.check_has_values([name])
            if plan.compiled:  # once per variable: its replicas become separate tensors, as updates make them
                env[s] = self.store.values[name] = _unaliased(env[s])
        count_now = self.run_count
        for s, mesh in self._run_counters:
            env[s] = self.impls[mesh].laid_out_constant(lambda _p: count_now)
        recorder = flight_recorder()
        executed, outer = [], recorder.sink
        recorder.sink = executed  # this run's collective calls, counted below
        self._loops.reset()
        try:
            if self.mode == "interpret":
                executor.run_steps(plan.bound, env)
            elif first_compile:
                t0 = time.perf_counter()
                plan.fn(env)
                self.compile_seconds[fetches] = time.perf_counter() - t0
            else:
                plan.fn(env)
            if plan.compiled:
                self._record_planned(plan, recorder)
        finally:
            recorder.sink = outer
        if outer is not None:
            outer.extend(executed)
        results = []
        for s, name in plan.fetch_slots:
            if s is None:
                results.append(None)
                continue
            spec = p.tensors[name]
            impl = self.impls[spec.mesh]
            if return_slices:
                local = impl.local_slices(env[s])
                results.append(local[0] if len(local) == 1 else local)
            else:
                results.append(impl.export_full(env[s], TensorLayout(spec.layout)))
        if plan.assignments:  # written in place into the variables' storage (VariableStore.commit)
            results = self.store.commit([(name, env[s]) for name, s in plan.assignments], results)
        self.counters.add(Counters.from_records(executed, plan.counters.einsum_flops + self._loops.einsum_flops, 1))
        if plan.compiled:  # the loops' planned collectives: a compiled run's are not recorded
            for c, n in self._loops.records.items():
                self.counters.records[c] += n
            self.counters.runs_from_plan += 1
        self.run_count += 1
        if stash:
            results.append({s: env[s] for s in plan.stash})
        return results

    def _record_planned(self, plan: Plan, recorder) -> None:
        """A compiled run's collectives, from its plan, into the flight recorder (``source="plan"``, untimed)."""
        now = time.perf_counter()
        for st in plan.steps:
            impl = self.impls[st.mesh]
            rank = getattr(impl, "recorder_rank", 0)
            for c in st.planned:
                recorder.add(CollectiveRecord(0, c.kind, c.mesh_axes, (c.bytes_per_processor,), None, "",
                                              c.reduction, c.num_processors, rank, now, None, False, (c,), "plan"))

    def import_slices(self, name: str, value):
        """A placeholder's laid-out value from this process's slices (one per local processor)."""
        spec = self.program.placeholders[name]
        impl = self.impls[spec.mesh]
        n = len(impl.local_pnums())
        values = list(value) if isinstance(value, list | tuple) else [value]
        if len(values) != n:
            raise FeedError(f"Placeholder {name!r}: feed_slices=True needs {n} local slice(s) (one per "
                            f"processor this process holds), got {len(values)}.")
        layout = TensorLayout(spec.layout)
        want = tuple(impl.slice_shape(spec_shape(spec), layout))
        out = []
        for p, v in zip(impl.local_pnums(), values, strict=True):
            v = _as_torch(v)
            if tuple(v.shape) != want:
                raise FeedError(f"Placeholder {name!r} {spec_shape(spec)} has slice shape {list(want)} on processor "
                                f"{p} (layout {layout}), but was fed a slice of shape {list(v.shape)}.")
            out.append(v.to(device=impl.device(p), dtype=spec.dtype))
        return impl.from_local_slices(out)


def _unaliased(x):
    """A laid-out value (a list of slices) whose entries are distinct tensors: a slice shared by several
    processors (``share_replicas``) is copied. ``torch.compile`` guards on which inputs are the same
    object (or views of one): initial values share replicas and updated ones do not, so without this the
    second run would recompile."""
    if not isinstance(x, list) or len({id(t) for t in x}) == len(x):
        return x
    seen, out = set(), []
    for t in x:
        out.append(t.clone() if id(t) in seen else t)
        seen.add(id(t))
    return out


def _as_torch(value) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))


def bind(program: Program, backends: dict, store: VariableStore | None = None, mode: str = "codegen",
         bucket_bytes: int | None = None, first_bucket_bytes: int | None = None, init: str = "random") -> Session:
    """Where execution starts: ``program`` (from :func:`meshtorch.lowering.stages.plan`) bound to backends.

    Args:
        program: the :class:`~meshtorch.lowering.program.Program`.
        backends: ``{mesh name: MeshImpl}`` whose specs match the program's (``program.meshes``).
        store: the variables' :class:`~meshtorch.lowering.variables.VariableStore`; default a new one on
            ``backends``, drawn as ``init`` says (``"random"``: now; ``"lazy"``: when first read).
        mode: as :class:`Session`'s.
        bucket_bytes, first_bucket_bytes: default: the program's ``options`` (as planned; 0 without them).

    Returns:
        The :class:`Session` (``session.run(fetch keys, feeds)``; ``program.fetches`` are the planned keys).

    Raises:
        ValueError: a backend whose mesh shape or rules differ from the program's, naming the mesh; an
            unknown ``mode`` or ``init``.
    """
    if init not in ("random", "lazy"):
        raise ValueError(f"bind: init must be 'random' or 'lazy', got {init!r}.")
    opts = program.options
    if bucket_bytes is None:
        bucket_bytes = getattr(opts, "bucket_bytes", 0)
    if first_bucket_bytes is None:
        first_bucket_bytes = getattr(opts, "first_bucket_bytes", 0)
    check_backends(program, backends)  # before a store is laid out on them
    if store is None:
        store = VariableStore(program, backends, initialize=False)
        store.initialize(lazy=init == "lazy")
    return Session(program, backends, store, mode, bucket_bytes, first_bucket_bytes)

"""The lowered program as data: typed steps, sub-programs, selection and ordering, JSON.

A :class:`Program` is what the planner makes of a graph for given mesh shapes and layout rules:
a flat list of :class:`Step` records over integer *slots* (each slot holds one laid-out value),
plus the slots of placeholders, variable reads, constants and fetchable tensors. A step is
``(kind, op, inputs, outputs, kernel, params)``: ``kind`` is ``"slicewise"`` (a kernel applied
to each processor's slices), a collective (``"allreduce"``, ``"allgather"``, ``"alltoall"``,
``"reduce_scatter"``, ``"collective_permute"``), or ``"call"`` (a kernel that needs the executor's context,
e.g. a while loop running its sub-programs). Nothing in a program refers to a mesh
implementation: an executor (:mod:`meshtorch.lowering.executor`) binds it to one, so the same
program runs on a placement mesh and on torchrun ranks. ``Program.to_json`` / ``from_json``
serialise it (kernels by ``module:qualname``, parameters as plain data).

Selection (:func:`select_steps`) keeps the steps a set of fetches needs and frees each slot after
its last use; collectives are hoisted to just after the step producing their input
(:func:`hoist_collectives`), a deterministic order every SPMD process shares.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from meshtorch.lowering.collectives import KINDS
from meshtorch.lowering.counters import Collective, Counters
from meshtorch.lowering.kernels import NotDataError, from_data, to_data

#: the collective step kinds (declared in :mod:`meshtorch.lowering.collectives`)
COLLECTIVE_KINDS = tuple(KINDS)


@dataclass
class Step:
    """One instruction: ``outputs = kernel(*inputs)`` on every processor, or a collective.

    Attributes:
        kind: ``"slicewise"``, ``"call"`` or one of :data:`COLLECTIVE_KINDS`.
        op: name of the graph operation that emitted it.
        inputs / outputs: slots.
        mesh: name of the mesh it runs on.
        fn: the kernel (``slicewise``: applied to each processor's slices; ``call``: called as
            ``fn(context, *values)``), None for collectives.
        params: plain-data arguments of a collective (mesh axes, tensor axes, reduction).
        collective: its :class:`~meshtorch.lowering.counters.Collective` record, for collectives.
        flops: global multiply-add FLOPs (einsums), for planning.
        subprograms: ``(label, SubProgram)`` pairs a ``call`` step runs (a while loop's cond and body).
        members: a bucket step's (:mod:`~meshtorch.lowering.schedule`) merged Collective records, one per
            input, in input order (the planned side of the flight recorder's tags).
    """

    kind: str
    op: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    mesh: str
    fn: Callable | None = None
    params: dict = field(default_factory=dict)
    collective: Collective | None = None
    flops: int = 0
    subprograms: tuple = ()
    members: tuple = ()

    @property
    def planned(self) -> tuple:
        """The planned Collective records of a collective step (one, or a bucket's members); ``()`` else."""
        return self.members or ((self.collective,) if self.collective is not None else ())

    def to_data(self) -> dict:
        """JSON-compatible record. Raises NotDataError naming the op if its kernel is a closure."""
        try:
            fn = to_data(self.fn)
            params = to_data(self.params)
        except NotDataError as e:
            raise NotDataError(f"step of op {self.op!r} ({self.kind}): {e}") from None
        c = self.collective
        return {"kind": self.kind, "op": self.op, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "mesh": self.mesh, "fn": fn, "params": params, "flops": self.flops,
                "collective": None if c is None else [c.kind, list(c.mesh_axes), c.op, c.tensor,
                                                       c.bytes_per_processor, c.num_processors, c.reduction],
                "subprograms": [[label, sub.to_data()] for label, sub in self.subprograms]}

    @staticmethod
    def from_data(d: dict) -> Step:
        c = d["collective"]
        return Step(d["kind"], d["op"], tuple(d["inputs"]), tuple(d["outputs"]), d["mesh"], from_data(d["fn"]),
                    from_data(d["params"]), None if c is None else Collective(c[0], tuple(c[1]), *c[2:]),
                    d["flops"], tuple((label, SubProgram.from_data(s)) for label, s in d["subprograms"]))


@dataclass
class SubProgram:
    """A step list lowered apart from the main program (a loop body, a loop condition).

    The executor runs it, possibly many times, as ``(input values, external values) -> output
    values``. ``external_slots`` are the enclosing program's slots its steps read (captured
    tensors, constants, variable reads): the step that runs the sub-program lists them among its
    inputs, so that the enclosing program computes them first and keeps them alive.
    ``counters``: collectives and FLOPs of one execution; ``pending[i]``: the mesh axes over which
    output ``i`` is still a partial sum (only outputs requested lazy).
    """

    steps: list  # Step records, in execution order
    frees: list  # per step, the slots to free after it
    input_slots: tuple
    external_slots: tuple
    output_slots: tuple
    pending: tuple
    counters: Counters

    @property
    def listing(self) -> list:
        return self.steps

    def to_data(self) -> dict:
        return {"steps": [s.to_data() for s in self.steps], "frees": [list(f) for f in self.frees],
                "input_slots": list(self.input_slots), "external_slots": list(self.external_slots),
                "output_slots": list(self.output_slots), "pending": [sorted(p) for p in self.pending]}

    @staticmethod
    def from_data(d: dict) -> SubProgram:
        steps = [Step.from_data(s) for s in d["steps"]]
        return SubProgram(steps, [tuple(f) for f in d["frees"]], tuple(d["input_slots"]),
                          tuple(d["external_slots"]), tuple(d["output_slots"]),
                          tuple(frozenset(p) for p in d["pending"]), count(steps))


def count(steps) -> Counters:
    """Collectives and FLOPs of executing ``steps`` once (not their sub-programs)."""
    c = Counters()
    for st in steps:
        if st.collective is not None:
            c.records[st.collective] += 1
        c.einsum_flops += st.flops
    return c


@dataclass
class TensorSlot:
    """Where a tensor's laid-out value lives: slot, mesh, named shape, dtype and layout."""

    slot: int
    mesh: str
    shape: list  # [(dim name, size)]
    dtype: object
    layout: tuple  # mesh axis per dim (None: not split)

    def to_data(self):
        return to_data([self.slot, self.mesh, [list(d) for d in self.shape], self.dtype, tuple(self.layout)])

    @staticmethod
    def from_data(d):
        slot, mesh, shape, dtype, layout = from_data(d)
        return TensorSlot(slot, mesh, [tuple(x) for x in shape], dtype, tuple(layout))


@dataclass
class Program:
    """A planned graph: steps plus the slots of its inputs, variables, constants and results.

    Attributes:
        meshes: ``{mesh name: {"shape": str, "layout": str, "storage": str}}`` it was planned for.
        steps: the main step list (every step any fetch may need; :meth:`select` picks some).
        constants: ``{slot: (kind, mesh, data)}``: ``("pnum", mesh, kernel)`` is ``kernel(impl, pnum)``
            per processor; ``("import", mesh, (tensor, layout))`` is a full tensor sliced by layout;
            ``("run_counter", mesh, None)`` holds the number of completed runs.
        placeholders / variables / tensors: ``{name: TensorSlot}``; ``tensors`` are the fetchable
            values (fully reduced); a variable's slot is where its reads come from.
        trainable: names of trainable variables.
        assignments: ``{assign op name: [(variable name, slot of its new value)]}``.
        slot_bytes: per-processor bytes of the slots whose size is known at plan time.
        n_slots: number of slots.
        initializers: ``{variable name: kernel}``: ``kernel(begin, sizes, device)`` draws one slice of the
            variable's initial value (``Variable.initializer_kernel``); None when it could not be read
            back from JSON (an initializer that is not plain data), then the value must be set.
        fetches: the fetch set :func:`~meshtorch.lowering.stages.plan` planned (``("tensor", name)``,
            ``("assign", op name)`` or None each); ``()`` for a program planned without one.
        options: the :class:`~meshtorch.lowering.stages.PlanOptions` it was planned with (None: not planned
            by :func:`~meshtorch.lowering.stages.plan`).
        specs: ``{mesh name: MeshSpec}`` it was planned for (``meshes`` holds their records).
        op_axes: ``{op name: mesh axis indices splitting any of its inputs or outputs}`` (what divides its
            FLOPs per processor), filled by :func:`~meshtorch.lowering.stages.plan`.
        pipeline: the graph's :class:`~meshtorch.core.pipeline.PipelineSchedule`, or None.
        in_backward: names of the update ops to run as soon as their gradient is final (optimizer-in-backward,
            :func:`meshtorch.lowering.donate.updates_in_backward`); a program read back from JSON has none (its
            updates run at the end: the same values, more memory).

    The five before ``in_backward`` are plan-time facts for the reports (:mod:`meshtorch.planning`); ``to_json``
    leaves them out.
    """

    meshes: dict
    steps: list
    constants: dict
    placeholders: dict
    variables: dict
    trainable: list
    tensors: dict
    assignments: dict
    slot_bytes: dict
    n_slots: int
    initializers: dict = field(default_factory=dict)
    fetches: tuple = ()
    options: object = None
    specs: dict = field(default_factory=dict)
    op_axes: dict = field(default_factory=dict)
    pipeline: object = None
    in_backward: frozenset = frozenset()

    def to_json(self) -> str:
        """The program as JSON text.

        Raises:
            NotDataError: naming the op, if a step's kernel is a closure (e.g. a lambda given to
                ``mtf.slicewise``) and so cannot be written down.
        """
        consts = {}
        for s, (kind, mesh, data) in self.constants.items():
            try:
                consts[str(s)] = [kind, mesh, to_data(data)]
            except NotDataError as e:
                raise NotDataError(f"constant in slot {s}: {e}") from None
        d = {"format": "meshtorch-program", "version": 1, "meshes": self.meshes,
             "steps": [s.to_data() for s in self.steps], "constants": consts,
             "placeholders": {k: v.to_data() for k, v in self.placeholders.items()},
             "variables": {k: v.to_data() for k, v in self.variables.items()}, "trainable": list(self.trainable),
             "tensors": {k: v.to_data() for k, v in self.tensors.items()},
             "assignments": {k: [list(x) for x in v] for k, v in self.assignments.items()},
             "slot_bytes": {str(k): v for k, v in self.slot_bytes.items()}, "n_slots": self.n_slots,
             "initializers": {k: _data_or_none(v) for k, v in self.initializers.items()}}
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> Program:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: if ``text`` is not a serialised meshtorch program.
        """
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != "meshtorch-program":
            raise ValueError("Program.from_json: not a meshtorch program (missing format 'meshtorch-program').")

        def slots(m):
            return {k: TensorSlot.from_data(v) for k, v in m.items()}
        consts = {int(s): (kind, mesh, from_data(data)) for s, (kind, mesh, data) in d["constants"].items()}
        return Program(d["meshes"], [Step.from_data(s) for s in d["steps"]], consts, slots(d["placeholders"]),
                       slots(d["variables"]), list(d["trainable"]), slots(d["tensors"]),
                       {k: [tuple(x) for x in v] for k, v in d["assignments"].items()},
                       {int(k): v for k, v in d["slot_bytes"].items()}, d["n_slots"],
                       {k: None if v is None else from_data(v) for k, v in d.get("initializers", {}).items()})

    def __str__(self) -> str:
        return program_str(self.steps)


def _data_or_none(kernel):
    """``to_data(kernel)``, or None for a kernel that is not plain data (its variable then needs a value)."""
    try:
        return None if kernel is None else to_data(kernel)
    except NotDataError:
        return None


def program_str(steps) -> str:
    """One line per step (index, kind, op, slots, collective), sub-programs indented."""
    lines = []

    def show(steps, indent):
        for i, st in enumerate(steps):
            extra = ""
            if st.collective is not None:
                c = st.collective
                extra = f" over {','.join(c.mesh_axes)} {c.bytes_per_processor} B/processor"
            kind = "compute" if st.kind == "slicewise" else ("while_loop" if st.subprograms else st.kind)
            lines.append(f"{indent}{i:4d} {kind:<10} {st.op:<28} {list(st.inputs)} -> {list(st.outputs)}{extra}")
            for label, sub in st.subprograms:
                lines.append(f"{indent}     {label}: inputs {list(sub.input_slots)} external "
                             f"{list(sub.external_slots)} -> {list(sub.output_slots)}")
                show(sub.steps, indent + "     | ")

    show(steps, "")
    return "\n".join(lines)


def select_steps(steps, needed: set, keep: set, given=frozenset()):
    """The steps ``needed`` slots depend on (in order, reductions hoisted by :func:`hoist_collectives`),
    and per step the slots to free after it. Slots in ``given`` arrive with the run's inputs (fed laid-out
    values, TF's feed-any-tensor): the steps producing them are not selected for their sake."""
    needed = set(needed) - set(given)
    chosen = []
    for st in reversed(steps):
        if any(o in needed for o in st.outputs):
            chosen.append(st)
            needed.update(s for s in st.inputs if s not in given)
    chosen.reverse()
    chosen = hoist_collectives(chosen)
    return chosen, frees_after(chosen, keep)


def frees_after(chosen: list, keep: set) -> list:
    """Per step of ``chosen``, the slots (not in ``keep``) whose last use it is."""
    last_use: dict[int, int] = {}
    for i, st in enumerate(chosen):
        for s in st.inputs:
            last_use[s] = i
    frees = [[] for _ in chosen]
    for s, i in last_use.items():
        if s not in keep:
            frees[i].append(s)
    return [tuple(f) for f in frees]


def hoist_collectives(steps: list) -> list:
    """Move each reduction (the kinds declared ``hoisted``: all-reduce, reduce-scatter) to just after the
    step producing its input. Gathers stay where their consumer needs them: hoisting an FSDP weight's
    all-gather to the start of the program would hold every gathered weight at once.

    The order stays valid (a collective's inputs exist where it lands; its outputs are used no earlier
    than before) and is a deterministic function of the program, so every SPMD process issues the
    same collectives in the same order. A lazy all-reduce is emitted where its sum is first *needed*
    (e.g. by the optimizer update), so without this the gradient sums of all layers would start only
    after the whole backward pass; hoisted, an asynchronous all-reduce overlaps the remaining backward
    computation (as DDP's buckets do).
    """
    out: list = []
    for st in steps:
        c = KINDS.get(st.kind)
        if c is None or not c.hoisted:
            out.append(st)
            continue
        made = {o: i for i, prev in enumerate(out) for o in prev.outputs}
        out.insert(max([-1] + [made.get(s, -1) for s in st.inputs]) + 1, st)
    return out


"""The lowered program as data: steps, their selection and ordering, and execution.

A program is a list of :class:`Step` records ``outputs = fn(*inputs)`` over integer slots; the
:class:`~meshtorch.lowering.Lowering` builds it once, and running it is a loop over plain tuples
(:func:`run_steps`). Selection (:func:`select_steps`) keeps the steps a set of fetches needs and
frees each slot after its last use; collectives are hoisted to just after the step producing
their input (:func:`hoist_collectives`), a deterministic order every SPMD process shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from meshtorch.counters import Collective, Counters


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
    subprograms: tuple = ()  # (label, SubProgram) pairs this step runs (a while loop's cond and body)


@dataclass
class _Program:
    steps: list  # (fn, inputs, outputs, frees)
    placeholders: list  # (tensor, slot)
    var_reads: list  # (variable op, slot)
    assignments: list  # (variable op, slot)
    fetch_slots: list  # (slot or None, tensor or None)
    counters: Counters = field(default_factory=Counters)
    listing: list = field(default_factory=list)  # the chosen Step records (loops' sub-programs for planning)


def run_steps(steps, env) -> None:
    """Execute ``(fn, inputs, outputs, frees)`` steps on ``env`` (a list or dict: slot -> laid-out value)."""
    for fn, ins, outs, frees in steps:
        if len(outs) == 1:
            env[outs[0]] = fn(*[env[i] for i in ins])
        else:
            for o, v in zip(outs, fn(*[env[i] for i in ins]), strict=True):
                env[o] = v
        for f in frees:
            env[f] = None


@dataclass
class SubProgram:
    """A step list lowered apart from the main program (a loop body, a loop condition).

    Built by :meth:`Lowering.lower_subprogram`; an op's step calls it, possibly many times, as
    ``sub(input_values, external_values) -> output_values`` (laid-out values). ``external_slots``
    are the slots of the enclosing program the steps read (captured tensors, constants, variable
    reads); the op that runs the sub-program must list them among its step's inputs so that the
    enclosing program computes them first and keeps them alive. ``counters`` are the collectives
    and FLOPs of one execution; ``pending[i]`` the lazy all-reduce axes of output ``i`` (only for
    outputs requested lazy).
    """

    steps: list  # (fn, inputs, outputs, frees), as in the main program
    input_slots: tuple
    external_slots: tuple
    output_slots: tuple
    pending: tuple
    counters: Counters
    listing: list = field(default_factory=list)  # the Step records, for program_str

    def __call__(self, inputs, externals) -> list:
        env = dict(zip(self.external_slots, externals, strict=True))
        env.update(zip(self.input_slots, inputs, strict=True))
        run_steps(self.steps, env)
        return [env[s] for s in self.output_slots]


def select_steps(steps, needed: set, keep: set):
    """The steps ``needed`` slots depend on (in order), and per step the slots to free after it."""
    needed = set(needed)
    chosen = []
    for st in reversed(steps):
        if any(o in needed for o in st.outputs):
            chosen.append(st)
            needed.update(st.inputs)
    chosen.reverse()
    chosen = hoist_collectives(chosen)
    last_use: dict[int, int] = {}
    for i, st in enumerate(chosen):
        for s in st.inputs:
            last_use[s] = i
    frees = [[] for _ in chosen]
    for s, i in last_use.items():
        if s not in keep:
            frees[i].append(s)
    return chosen, frees


def hoist_collectives(steps: list) -> list:
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

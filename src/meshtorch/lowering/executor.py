"""Executing a program on a mesh implementation.

The executor is the only place where a program's steps meet a :class:`~meshtorch.mesh.base.MeshImpl`:
:func:`bind` turns each typed :class:`~meshtorch.lowering.program.Step` into a Python callable
over laid-out values (``impl.slicewise(kernel, ...)``, ``impl.allreduce(...)``, ...), once per
program and fetch set, and :func:`run_steps` runs the bound list. Constants are evaluated per
implementation by :func:`evaluate_constants`. The same program therefore runs on a
:class:`~meshtorch.mesh.placement.PlacementMeshImpl` (every processor's slice in one process) and
on :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` ranks (one slice per process).

A collective step's call is tagged in the flight recorder (:mod:`meshtorch.mesh.recorder`) with the
step's planned :class:`~meshtorch.lowering.counters.Collective` records, so that the records of what
the implementation executed can be counted per op (``lowering.counters``) and compared with the plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshtorch.core.layout import TensorLayout
from meshtorch.lowering.collectives import kind_of
from meshtorch.lowering.counters import Counters
from meshtorch.lowering.program import SubProgram


@dataclass
class CallContext:
    """What a ``call`` step's kernel receives first: the mesh implementation, its bound
    sub-programs (``{label: fn(input values, external values) -> output values}``) with their
    records, and ``counters``, where a loop adds the *planned* counters of each iteration it executes
    (the session keeps their FLOPs, and their collectives only for a compiled run, whose collectives
    the implementation cannot record)."""

    impl: object
    subprograms: dict
    records: dict
    counters: Counters


def bind_step(st, impls: dict, counters: Counters, tagged: bool = True):
    """A callable ``f(*input values) -> output value (or tuple)`` executing step ``st``.

    ``counters``: see :class:`CallContext`. ``tagged``: collective calls set the flight recorder's tag
    to the step's planned records (False for a function ``torch.compile`` traces, which must not write
    Python state).
    """
    impl = impls[st.mesh]
    kind = st.kind
    if kind == "slicewise":
        n = len(st.outputs)
        return functools.partial(impl.slicewise, st.fn) if n == 1 else functools.partial(
            impl.slicewise, st.fn, num_outputs=n)
    if kind == "call":
        subs = {label: bind_subprogram(sub, impls, counters, tagged) for label, sub in st.subprograms}
        return functools.partial(st.fn, CallContext(impl, subs, dict(st.subprograms), counters))
    try:
        c, bucket = kind_of(kind)  # the MeshImpl primitive is declared with the kind
    except ValueError as e:
        raise ValueError(f"executor: step of op {st.op!r}: {e}") from None
    call = functools.partial(getattr(impl, c.bucket_method if bucket else c.method), **st.params)
    recorder = getattr(impl, "recorder", None)
    if not tagged or recorder is None:
        return call
    return functools.partial(_tagged, recorder, st.planned, call)


def _tagged(recorder, tag, call, *values):
    """``call(*values)`` with the flight recorder's tag set to ``tag`` (the step's planned records)."""
    recorder.tag = tag
    try:
        return call(*values)
    finally:
        recorder.tag = None


def bind(steps, frees, impls: dict, counters: Counters, tagged: bool = True) -> list:
    """``[(callable, inputs, outputs, frees)]`` for :func:`run_steps` (``counters``, ``tagged``: see
    :func:`bind_step`)."""
    return [(bind_step(st, impls, counters, tagged), st.inputs, st.outputs, tuple(f))
            for st, f in zip(steps, frees, strict=True)]


def bind_subprogram(sub: SubProgram, impls: dict, counters: Counters, tagged: bool = True):
    """``fn(input values, external values) -> output values`` running ``sub``'s steps."""
    bound = bind(sub.steps, sub.frees, impls, counters, tagged)
    ins, ext, outs = sub.input_slots, sub.external_slots, sub.output_slots

    def run(inputs, externals):
        env = dict(zip(ext, externals, strict=True))
        env.update(zip(ins, inputs, strict=True))
        run_steps(bound, env)
        return [env[s] for s in outs]
    return run


def run_steps(steps, env) -> None:
    """Execute bound ``(fn, inputs, outputs, frees)`` steps on ``env`` (a list or dict: slot -> value)."""
    for fn, ins, outs, frees in steps:
        if len(outs) == 1:
            env[outs[0]] = fn(*[env[i] for i in ins])
        else:
            for o, v in zip(outs, fn(*[env[i] for i in ins]), strict=True):
                env[o] = v
        for f in frees:
            env[f] = None


def evaluate_constant(kind: str, data, impl):
    """The laid-out value of one program constant on ``impl`` (see ``Program.constants``)."""
    if kind == "pnum":  # equal per-processor values (e.g. a scalar every processor makes) share a tensor
        return impl.share_replicas(impl.laid_out_constant(functools.partial(data, impl)))
    if kind == "import":
        full, layout = data
        return impl.import_full(full, TensorLayout(layout))
    raise ValueError(f"executor: unknown constant kind {kind!r}.")


def evaluate_constants(program, impls: dict) -> dict:
    """``{slot: laid-out value}`` of every constant except run counters (filled per run)."""
    return {s: evaluate_constant(kind, data, impls[mesh]) for s, (kind, mesh, data) in program.constants.items()
            if kind != "run_counter"}

"""A plan as one straight-line Python function: the executor without an interpreter loop.

:func:`generate` turns the bound steps of a :class:`~meshtorch.lowering.session.Plan` into the
source of one function ``run(env)``: each slot becomes a local variable, each step one call, each
freed slot a ``del``. On a mesh implementation that holds every processor's slice in this process
(``impl.unrolled``, the placement mesh) the processors are unrolled too: a slicewise step becomes one
kernel call per processor on that processor's local variable, and only collectives see the list of
slices; when every input is the same tensor on every processor (replicated values, e.g. after an
all-reduce), the kernel runs once and the processors share its result (kernels are pure functions).
The function is data-equivalent to :func:`~meshtorch.lowering.executor.run_steps` over the same steps
(the tests run both), costs no Python loop, list building or dispatch through
``MeshImpl.slicewise`` per step, and is what ``torch.compile`` is given in compiled mode (dynamo
traces straight-line code well).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable

from meshtorch.lowering.donate import donated_mask
from meshtorch.lowering.executor import bind_step


def _unrolled(impl) -> int:
    """Number of processors to unroll on ``impl`` (0: call ``impl.slicewise`` on the laid-out value)."""
    return impl.size if getattr(impl, "unrolled", False) else 0


def _local(impl) -> bool:
    """``impl`` holds one slice per process and its ``slicewise`` is the kernel on the materialized inputs
    (``impl.local_slicewise``, the SPMD mesh): the generated code calls the kernel itself."""
    return getattr(impl, "local_slicewise", False)


def generate(steps, frees, impls: dict, counters, reads, writes, tagged: bool = True) -> Callable:
    """``run(env)`` executing ``steps`` (freeing ``frees[i]`` after step ``i``).

    ``counters`` and ``tagged``: see :func:`~meshtorch.lowering.executor.bind_step` (a function to be
    compiled is generated untagged).

    ``reads``: slots whose laid-out values the function takes from ``env`` (constants, feeds,
    variable reads); ``writes``: slots it stores back into ``env`` (fetches, new variable values).
    """
    lines = ["def run(env):"]
    names: dict[str, object] = {}
    width: dict[int, int] = {}  # slot -> processors unrolled (0: one laid-out value)

    def var(s, p=None):
        return f"s{s}" if p is None else f"s{s}_{p}"

    def whole(s):
        n = width[s]
        return var(s) if n == 0 else "[" + ", ".join(var(s, p) for p in range(n)) + "]"

    def unpack_into(s, n, expr):
        width[s] = n
        if n == 0:
            lines.append(f"    {var(s)} = {expr}")
        elif n == 1:
            lines.append(f"    {var(s, 0)}, = {expr}")
        else:
            lines.append(f"    {', '.join(var(s, p) for p in range(n))} = {expr}")

    ready: set[int] = set()  # slots of a local_slicewise mesh known to hold no collective still in flight
    first_mesh = {}
    for st in steps:
        for s in st.inputs:
            first_mesh.setdefault(s, st.mesh)
    for s in sorted(reads):
        mesh = first_mesh.get(s)
        n = _unrolled(impls[mesh]) if mesh is not None else 0
        unpack_into(s, n, f"env[{s}]")
    for i, (st, fr) in enumerate(zip(steps, frees, strict=True)):
        impl = impls[st.mesh]
        n = _unrolled(impl)
        # an in-place update on an unrolled mesh goes through impl.slicewise, which lets no call write a slice
        # another processor's call reads (a compiled plan's variable slices are never shared: Session unaliases)
        if st.kind == "slicewise" and n and not (tagged and any(donated_mask(st))):
            f = f"k{i}"
            names[f] = st.fn

            def arg(s, p):
                return var(s, p) if width[s] else f"{var(s)}[{p}]"

            def call(p, indent):
                args = ", ".join(arg(s, p) for s in st.inputs)
                lines.append(f"{indent}{', '.join(var(o, p) for o in st.outputs)}{',' if len(st.outputs) > 1 else ''}"
                             f" = {f}({args})")
            if n > 1 and st.inputs:
                # replicated inputs (the same tensor on every processor, e.g. after an all-reduce): a kernel is
                # a pure function of its inputs, so it runs once and every processor shares the result
                same = " and ".join(f"{arg(s, 0)} is {arg(s, p)}" for s in st.inputs for p in range(1, n))
                lines.append(f"    if {same}:")
                call(0, "        ")
                for o in st.outputs:
                    lines.append(f"        {' = '.join(var(o, p) for p in range(1, n))} = {var(o, 0)}")
                lines.append("    else:")
                for p in range(n):
                    call(p, "        ")
            else:
                for p in range(n):
                    call(p, "    ")
            for o in st.outputs:
                width[o] = n
        elif st.kind == "slicewise" and tagged and _local(impl):
            # one slice per process: the kernel on this process's slices, each input materialized once, at its
            # first slicewise use (where impl.slicewise would wait for it), without the call through slicewise
            f, m = f"k{i}", f"m{id(impl):x}"
            names[f], names[m] = st.fn, impl.materialize
            for s in st.inputs:
                if s not in ready:
                    lines.append(f"    {var(s)} = {m}({var(s)})")
                    ready.add(s)
            outs = ", ".join(var(o) for o in st.outputs) + ("," if len(st.outputs) > 1 else "")
            lines.append(f"    {outs} = {f}({', '.join(var(s) for s in st.inputs)})")
            for o in st.outputs:
                width[o] = 0
                ready.add(o)
        else:
            f = f"f{i}"
            names[f] = bind_step(st, impls, counters, tagged)
            args = ", ".join(whole(s) for s in st.inputs)
            if len(st.outputs) == 1:
                unpack_into(st.outputs[0], n, f"{f}({args})")
            else:
                lines.append(f"    _o = {f}({args})")
                for j, o in enumerate(st.outputs):
                    unpack_into(o, n, f"_o[{j}]")
        for s in fr:
            if s in width and s not in writes:
                lines.append("    del " + (var(s) if width[s] == 0 else ", ".join(var(s, p) for p in range(width[s]))))
                del width[s]
    for s in sorted(writes):
        if s in width:
            lines.append(f"    env[{s}] = {whole(s)}")
    lines.append("    return env")
    source = "\n".join(lines) + "\n"
    filename = f"<meshtorch plan {id(steps):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show lines
    namespace = dict(names)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    run = namespace["run"]
    run.source = source
    return run


__all__ = ["generate"]

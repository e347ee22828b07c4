"""In-place updates: a plan's optimizer kernels may write a variable's new value into its storage.

A run's reads see the values from before the run (:mod:`meshtorch.lowering.session`); an update kernel
can therefore overwrite a variable's slice in place only when nothing reads that slice, or anything
sharing its storage, after the update. :func:`donate_inputs` marks such steps: a slicewise step whose
kernel declares ``donates`` (the input positions it can update in place when called with
``donate=True``, returned as its first outputs in that order, e.g. the fused Adam kernel's weight and
moments) gets ``donate=True`` when, for each
of those inputs (a multi-tensor kernel, whose ``donates`` is a function of its parameters, gets a tuple of
bools instead: ``donate[k]`` for its ``k``-th donatable input alone),

* the input is a read (the store's own tensor), not fetched, of a variable that the run assigns: an in-place
  write is the early form of the run's assignment (whose commit then copies nothing), never a write of its own,
  so a run that assigns no new value to a variable leaves it as it was (e.g. a KV-cache step whose cache
  writes, :class:`~meshtorch.layers.kv_cache.CacheWriteOperation`, are not fetched);
* the step is its last reader;
* every other step reading it returns tensors that share no storage with their inputs (kernels
  marked ``fresh_outputs``: matmuls, gathers, the fused updates; all-gathers over axes of more than
  one processor), or returns possibly-aliasing tensors (an identity, e.g. the inputs of a
  ``recompute_grad`` block, views) that are not results of the run and whose own readers all run
  before the update and satisfy the same rule: no view of the slice outlives the update;
* on a mesh holding several processors' slices in this process (the placement mesh), processors holding
  the same slices of all the kernel's donatable inputs share one call (a replicated variable is updated in
  place once for all its replicas), and a slice that two calls read is donated by neither
  (:meth:`~meshtorch.mesh.placement.PlacementMeshImpl.slicewise`); the plan marks a variable only if its
  layout splits it over every mesh axis that splits the kernel's other variables (:func:`_replica_safe`).

The session's commit then finds the new value already in the variable's storage and copies nothing:
no new weight or optimizer-state buffers per step (PyTorch's optimizers' in-place ``step``).
"""

from __future__ import annotations

import dataclasses
import functools

from meshtorch.core.donation import donatable_positions, kernel_of
from meshtorch.lowering.collectives import KINDS, is_collective, kind_of
from meshtorch.lowering.program import Step


def donatable_inputs(st: Step) -> tuple:
    """Input positions ``st``'s kernel may update in place (:func:`~meshtorch.core.donation.donatable_positions`)."""
    return donatable_positions(st.fn) if st.kind == "slicewise" else ()


def _fresh(st: Step, impl) -> bool:
    """Are ``st``'s outputs new tensors, sharing no storage with its inputs?"""
    if st.kind == "slicewise":
        return bool(getattr(kernel_of(st.fn), "fresh_outputs", False))
    if is_collective(st.kind) and kind_of(st.kind)[0].fresh_output:  # single or bucket
        return impl.shape[st.params["mesh_axis"]].size > 1
    return False


def donates_input(st: Step) -> bool:
    """Is ``st`` a single collective whose output is written into its input's buffer (``donate=True`` on a
    ``donatable`` kind, :mod:`meshtorch.lowering.collectives`)?"""
    c = KINDS.get(st.kind)
    return c is not None and c.donatable and bool(st.params.get("donate"))


def _safe_reader(steps: list[Step], readers: dict, k: int, i: int, impl, keep: set, depth: int = 0) -> bool:
    """May step ``i`` overwrite a slice that step ``k`` reads? Yes if ``k`` is ``i``, or returns new tensors,
    or (``k`` before ``i``) each of its outputs, possibly a view of the slice, is not kept past the run and
    is read only by steps before ``i`` that are safe in turn (followed a few aliasing steps deep)."""
    if k == i or _fresh(steps[k], impl):
        return True
    if k > i or depth > 4:
        return False
    return all(o not in keep and all(r < i and _safe_reader(steps, readers, r, i, impl, keep, depth + 1)
                                     for r in readers.get(o, ())) for o in steps[k].outputs)


def donated_mask(st: Step) -> tuple[bool, ...]:
    """Which of ``st``'s leading outputs are its donated inputs updated in place (empty unless
    :func:`donate_inputs` or :func:`donate_reductions` marked it): output ``k`` is input ``donates[k]``
    (a donated all-reduce's output is its input), so it allocates nothing. A multi-tensor kernel (``donates`` a
    function) may be marked per tensor: its ``donate`` is then a tuple of bools, one per ``donates`` entry."""
    if is_collective(st.kind):
        return (True,) if donates_input(st) else ()
    if st.kind != "slicewise" or not (isinstance(st.fn, functools.partial) and st.fn.keywords.get("donate")):
        return ()
    flag = st.fn.keywords["donate"]
    n = len(donatable_inputs(st))
    return tuple(bool(f) for f in flag) if isinstance(flag, tuple) else (True,) * n


def donated_outputs(st: Step) -> int:
    """How many of ``st``'s outputs are donated inputs updated in place (see :func:`donated_mask`)."""
    return sum(donated_mask(st))


def donate_reductions(steps: list[Step], variable_slots: set, keep: set, impls: dict) -> list[Step]:
    """``steps`` with each single all-reduce that may sum in its input's buffer called with ``donate=True``.

    An all-reduce never modifies its input slot (another step may read it), so it reduces a copy; a
    gradient too large for a bucket (an embedding table's, 154 MB at the GPT-2 shape) would be copied every
    step. The copy is skipped when the input is this step's alone: not a variable, not a result of the run,
    read by no other step, and the single output of a step returning new tensors (``fresh_outputs``
    kernels: matmuls, gathers, scatter-adds), so no other value shares its storage; and the mesh gives
    this process one processor. DDP reduces in its bucket views likewise (``gradient_as_bucket_view``)."""
    readers: dict[int, list[int]] = {}
    producer: dict[int, int] = {}
    for i, st in enumerate(steps):
        for s in st.inputs:
            readers.setdefault(s, []).append(i)
        for o in st.outputs:
            producer[o] = i
    out = list(steps)
    for i, st in enumerate(steps):
        c = KINDS.get(st.kind)  # a single collective (a bucket has no one input to sum in)
        if c is None or not c.donatable or len(impls[st.mesh].local_pnums()) != 1:
            continue
        s = st.inputs[0]
        p = producer.get(s)
        if (s in variable_slots or s in keep or readers[s] != [i] or p is None
                or len(steps[p].outputs) != 1 or not _fresh(steps[p], impls[steps[p].mesh])):
            continue
        out[i] = dataclasses.replace(st, params={**st.params, "donate": True})
    return out


def _replica_safe(slots: list, layouts: dict, impl) -> list[bool]:
    """On a mesh holding several processors (the placement mesh): may each of a kernel's donatable variable
    ``slots`` be written in place, given that processors holding the same slices of all of them share one call
    and a slice two calls read is not donated (:meth:`~meshtorch.mesh.placement.PlacementMeshImpl.slicewise`)?
    A variable's replicas share one tensor, so a slice is read by one call only if it is split over every
    mesh axis (of size > 1) that splits any of the others."""
    axes = [{a for a in layouts.get(s, ()) if a is not None and impl.shape[a].size > 1} for s in slots]
    union = set().union(*axes)
    return [a == union for a in axes]


def donate_inputs(steps: list[Step], variable_slots: set, keep: set, impls: dict,
                  layouts: dict | None = None) -> list[Step]:
    """``steps`` with the update steps that may write variables in place called with ``donate=True``.

    ``variable_slots``: the slots of the reads of the variables the run assigns (the only ones written in place).
    ``layouts``: ``{variable slot: its layout}`` (mesh axis per dim), for meshes holding several processors."""
    readers: dict[int, list[int]] = {}
    for i, st in enumerate(steps):
        for s in st.inputs:
            readers.setdefault(s, []).append(i)
    out = list(steps)
    for i, st in enumerate(steps):
        donates = donatable_inputs(st)
        impl = impls[st.mesh]
        if not donates:
            continue
        slots = [st.inputs[j] for j in donates]
        ok = [slots.count(s) == 1 and s in variable_slots and s not in keep and readers[s][-1] == i
              and all(_safe_reader(steps, readers, k, i, impl, keep) for k in readers[s]) for s in slots]
        if len(impl.local_pnums()) > 1:
            ok = [o and r for o, r in zip(ok, _replica_safe(slots, layouts or {}, impl), strict=True)]
        if all(ok):
            out[i] = dataclasses.replace(st, fn=functools.partial(st.fn, donate=True))
        elif any(ok) and callable(getattr(kernel_of(st.fn), "donates", None)):  # multi-tensor: per tensor
            out[i] = dataclasses.replace(st, fn=functools.partial(st.fn, donate=tuple(ok)))
    return out


def updates_in_backward(steps: list[Step], marked: frozenset, start_slots: set, impls: dict) -> list[Step]:
    """``steps`` with each update step of an op in ``marked`` moved up to where its gradient is final:
    optimizer-in-backward (PyTorch's ``register_post_accumulate_grad_hook`` recipe), so the gradient is freed
    after its update instead of living to the end of the backward pass.

    A marked step goes right after the last step producing one of its inputs and after the last step reading
    the slots it may update in place (its ``donates`` inputs: the weight and its moments) or a view of them
    (outputs of steps whose outputs are not fresh tensors, followed through), so :func:`donate_inputs` still
    updates in place and every reader sees the values from before the step. Steps computed from
    ``start_slots`` (variables, constants) alone that feed a marked step (the learning rate, bias corrections)
    move up first, as early as their inputs allow. Deterministic, so every SPMD process runs the same order;
    the values are those of the unmoved order (each moved step reads the same inputs).
    """
    moving_updates = [i for i, st in enumerate(steps) if st.op in marked and st.kind == "slicewise"]
    if not moving_updates:
        return steps
    made_by: dict[int, int] = {}
    static: set[int] = set()
    for i, st in enumerate(steps):
        if (st.kind == "slicewise" and st.op not in marked
                and all(s in start_slots or made_by.get(s) in static for s in st.inputs)):
            static.add(i)
        for o in st.outputs:
            made_by[o] = i
    need: set[int] = set()
    stack = [s for i in moving_updates for s in steps[i].inputs]
    while stack:
        j = made_by.get(stack.pop())
        if j in static and j not in need:
            need.add(j)
            stack.extend(steps[j].inputs)
    moving = need | set(moving_updates)
    order = [st for i, st in enumerate(steps) if i not in moving]
    for i in sorted(moving):
        st = steps[i]
        inputs = set(st.inputs)
        pos = 1 + max((k for k, other in enumerate(order) if inputs.intersection(other.outputs)), default=-1)
        if i not in need:  # an update: after every reader of what it overwrites, and of views of it
            aliases = {st.inputs[j] for j in donatable_inputs(st)}
            for k, other in enumerate(order):
                if aliases.intersection(other.inputs):
                    pos = max(pos, k + 1)
                    if not _fresh(other, impls[other.mesh]):
                        aliases.update(other.outputs)
        order.insert(pos, st)
    return order

"""Inputs and calls of the MeshImpl collective primitives, shared by tests/test_collectives.py and its
4-process gloo job (the SPMD worker below runs in each rank; the parent compares with placement).

Meshes ``all:4`` and ``rows:2;cols:2``; one float64 tensor of shape [4, 8, 8]; every layout that splits
one tensor dim over one mesh axis (and, on 2x2, two dims over both axes); per layout every primitive
for every mesh axis, tensor axis, reduction and shift offset.
"""

from __future__ import annotations

import itertools

import torch

from meshtorch.core.layout import TensorLayout
from meshtorch.mesh.spmd import SpmdMeshImpl

MESHES = ("all:4", "rows:2;cols:2")
SHAPE = (4, 8, 8)
SHIFTS = ((1, True), (1, False), (-1, True), (-1, False), (2, True), (3, False))


def full_tensor() -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def partial_tensors(num_processors: int) -> list[torch.Tensor]:
    """One different full tensor per processor: the 'partial sums' that all-reduce adds."""
    gen = torch.Generator().manual_seed(6)
    return [torch.randn(*SHAPE, generator=gen, dtype=torch.float64) for _ in range(num_processors)]


def mesh_dims(mesh_shape: str) -> list[int]:
    return [int(part.split(":")[1]) for part in mesh_shape.split(";")]


def layouts(mesh_shape: str) -> list[tuple]:
    """Replicated, each tensor dim on each mesh axis, and on 2x2 every pair of dims on (rows, cols)."""
    nd = len(mesh_dims(mesh_shape))
    out = [(None,) * len(SHAPE)]
    for a in range(nd):
        for i in range(len(SHAPE)):
            out.append(tuple(a if k == i else None for k in range(len(SHAPE))))
    if nd == 2:
        for i, j in itertools.permutations(range(len(SHAPE)), 2):
            out.append(tuple(0 if k == i else 1 if k == j else None for k in range(len(SHAPE))))
    return out


def calls(impl, layout: tuple):
    """``[(key, function of the laid-out input)]``: every primitive that is legal on this layout's slices.

    Keys are plain tuples naming the primitive and its arguments: ``("allreduce", axes, reduction)``,
    ``("allconcat", a, concat_axis)``, ``("alltoall", a, split_axis, concat_axis)``,
    ``("shift", a, offset, wrap)``, ``("receive", a, source_pcoord)``, ``("broadcast", a, root)``.
    """
    sizes = impl.slice_shape([(f"d{k}", s) for k, s in enumerate(SHAPE)], TensorLayout(layout))
    out = []
    nd = impl.ndims
    for r in range(1, nd + 1):
        for axes in itertools.combinations(range(nd), r):
            for red in ("SUM", "MAX", "MIN"):
                out.append((("allreduce", axes, red), lambda x, axes=axes, red=red: impl.allreduce(x, list(axes), red)))
    for a in range(nd):
        n = impl.shape[a].size
        for c in range(len(SHAPE)):
            out.append((("allconcat", a, c), lambda x, a=a, c=c: impl.allconcat(x, a, c)))
            for s in range(len(SHAPE)):
                if sizes[s] % n == 0:
                    out.append((("alltoall", a, s, c), lambda x, a=a, s=s, c=c: impl.alltoall(x, a, s, c)))
        for off, wrap in SHIFTS:
            out.append((("shift", a, off, wrap),
                        lambda x, a=a, off=off, wrap=wrap: impl.shift_by_n_processors(x, a, off, wrap)))
        src = tuple(n - 1 - c if c % 2 == 0 else None for c in range(n))
        out.append((("receive", a, src), lambda x, a=a, src=src: impl.receive(x, a, list(src))))
        for root in (0, n - 1):
            out.append((("broadcast", a, root), lambda x, a=a, root=root: impl.broadcast(x, a, root)))
    return out


def run_all(impl, mesh_shape: str) -> dict:
    """``{(layout, key): this process's result slices (list, one per local pnum)}`` for every call;
    all-reduces get per-processor different inputs (:func:`partial_tensors`), the rest ``full_tensor()``."""
    full = full_tensor()
    parts = partial_tensors(impl.size)
    out = {}
    for lay in layouts(mesh_shape):
        tl = TensorLayout(lay)
        x = impl.import_full(full, tl)
        xp = impl.laid_out_constant(lambda p, tl=tl: parts[p][slice_bounds(impl, tl, p)].clone())
        for key, fn in calls(impl, lay):
            value = fn(xp if key[0] == "allreduce" else x)
            out[(lay, key)] = [t.clone() for t in impl.local_slices(value)]
    return out


def slice_bounds(impl, layout: TensorLayout, pnum: int) -> tuple:
    return impl.slice_bounds([(f"d{k}", s) for k, s in enumerate(SHAPE)], pnum, layout)


def spmd_worker() -> dict:
    """In each of 4 gloo ranks: ``{mesh: run_all(SpmdMeshImpl(mesh))}`` (this rank's slices), and under
    ``("functional", mesh)`` the same calls on its functional-collective view (``traceable()``, what a
    compiled program runs), eagerly."""
    out = {m: run_all(SpmdMeshImpl(m, "", async_collectives=(m == "rows:2;cols:2")), m) for m in MESHES}
    out.update({("functional", m): run_all(SpmdMeshImpl(m, "").traceable(), m) for m in MESHES})
    out["traceable"] = traceable_facts()
    return out


def traceable_facts() -> dict:
    """What ``traceable()`` of an asynchronous eager mesh is, as plain values for the parent to check."""
    import torch.distributed._functional_collectives as funcol

    from meshtorch.mesh.spmd import _InFlight
    from meshtorch.mesh.spmd_strategy import EagerCollectives, FunctionalCollectives

    eager = SpmdMeshImpl("rows:2;cols:2", "", async_collectives=True)
    view = eager.traceable()
    x = torch.full((2, 3), float(eager.rank))
    got = view.allreduce(x, [0, 1])
    started = eager.allreduce(x, [0, 1])
    return {
        "same_class": type(view) is SpmdMeshImpl, "made_once": eager.traceable() is view and view.traceable() is view,
        "functional": isinstance(view.collectives, FunctionalCollectives) and not view.async_collectives,
        "eager_unchanged": isinstance(eager.collectives, EagerCollectives) and eager.async_collectives,
        "same_mesh": (view.spec == eager.spec, view.rank == eager.rank, view.coords == eager.coords,
                      view._group([0])[0] is eager._group([0])[0]),
        "functional_result": isinstance(got, funcol.AsyncCollectiveTensor),
        "eager_result": isinstance(started, _InFlight), "input_kept": bool((x == eager.rank).all()),
        "values": (torch.tensor(got.tolist()), torch.tensor(started.result().tolist())),
    }

"""PlacementMeshImpl: one process holds every processor's slice, one torch device each.

The mesh is simulated when the devices repeat (``["cpu"] * 4``); with distinct CUDA devices
it is real model parallelism in one process. Follows Mesh TF's ``PlacementMeshImpl``.
A laid-out value is a Python list of torch tensors, index = processor number.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence

import torch

from meshtorch.core.donation import donatable_positions, kernel_of
from meshtorch.core.layout import TensorLayout
from meshtorch.mesh.base import REDUCTIONS, MeshImpl


class PlacementMeshImpl(MeshImpl):
    """Simulated (or single-process multi-device) mesh.

    Args:
        shape: a :class:`~meshtorch.core.mesh_spec.MeshSpec`, or the mesh shape, e.g. ``"rows:2;cols:2"``.
        layout: layout rules, e.g. ``"batch:rows;hidden:cols"`` (with a mesh shape; None with a spec).
        devices: one torch device per processor (may repeat); default ``"cpu"`` for all; ``""`` (Mesh TF's
            default device, as its examples pass ``[""] * mesh_size``) is the CPU.
        storage: storage rules for variables (FSDP / ZeRO-3), e.g. ``"d_model:data"``; see
            :class:`~meshtorch.mesh.base.MeshImpl` (also ``reshard_after_forward`` and ``prefetch``).

    Processors that hold the same slice on the same device share one tensor (replicated values), and a
    kernel whose inputs are all shared runs once for all of them: simulating a mesh does not repeat
    replicated work. Results are the same either way (kernels are pure functions of their inputs).

    Raises:
        ValueError: if ``len(devices)`` differs from the number of processors, or ``prefetch`` < 0.
    """

    #: every processor's slice lives in this process: executors may unroll the processors
    unrolled = True

    def __init__(self, shape, layout=None, devices: Sequence | None = None, storage=None,
                 reshard_after_forward: bool = True, prefetch: int = 1):
        super().__init__(shape, layout, storage, reshard_after_forward, prefetch)
        if devices is None:
            devices = ["cpu"] * self.size
        if len(devices) != self.size:
            raise ValueError(f"PlacementMeshImpl: mesh {self.shape} has {self.size} processors, "
                             f"but {len(devices)} devices were given.")
        self.devices = [torch.device(d or "cpu") for d in devices]  # "": Mesh TF's default device
        self._one_device = len(set(self.devices)) == 1

    def _to(self, t: torch.Tensor, p: int) -> torch.Tensor:
        return t if self._one_device and t.device == self.devices[0] else t.to(self.devices[p])

    def device(self, pnum):
        return self.devices[pnum]

    def laid_out_constant(self, fn):
        return [fn(p) for p in range(self.size)]

    def slicewise(self, fn, *inputs, num_outputs: int = 1):
        if self.size == 1:
            out = [fn(*[x[0] for x in inputs])]
        elif isinstance(fn, functools.partial) and fn.keywords.get("donate"):
            out = _donating_calls(fn, inputs, self.size)
        elif inputs and all(x[p] is x[0] for x in inputs for p in range(1, self.size)):
            out = [fn(*[x[0] for x in inputs])] * self.size  # replicated inputs: one call, a shared result
        else:
            out = [fn(*[x[p] for x in inputs]) for p in range(self.size)]
        if num_outputs == 1:
            return out
        return tuple([o[i] for o in out] for i in range(num_outputs))

    def allreduce(self, x, mesh_axes, reduction="SUM", donate=False):  # donate: sums are new tensors here anyway
        if reduction not in REDUCTIONS:
            raise ValueError(f"allreduce: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        if not mesh_axes:
            return x
        rec = self._record("allreduce", mesh_axes, (_nbytes(x[0]),), x[0].dtype, reduction)
        out = self._allreduce(x, mesh_axes, reduction)
        _finish(rec)
        return out

    def allreduce_many(self, *xs, mesh_axes, reduction="SUM"):
        if reduction not in REDUCTIONS:
            raise ValueError(f"allreduce_many: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        if not mesh_axes or not xs:
            return tuple(xs)
        rec = self._record_bucket("allreduce", mesh_axes, xs, reduction)
        out = tuple(self._allreduce(x, mesh_axes, reduction) for x in xs)
        _finish(rec)
        return out

    def _allreduce(self, x, mesh_axes, reduction):
        out = [None] * self.size
        for group in self.processor_groups(mesh_axes):
            parts = [self._to(x[p], group[0]) for p in group]
            acc = parts[0]
            for j, t in enumerate(parts[1:]):
                if reduction == "SUM":
                    acc = acc + t if j == 0 else acc.add_(t)  # accumulate into the first sum's new buffer
                elif reduction == "MAX":
                    acc = torch.maximum(acc, t)
                else:
                    acc = torch.minimum(acc, t)
            for p in group:
                out[p] = self._to(acc, p)
        return out

    def _record_bucket(self, kind, mesh_axes, xs, reduction=""):
        """One flight-recorder record for a bucket call of the values ``xs`` (one part each)."""
        return self._record(kind, mesh_axes, tuple(_nbytes(x[0]) for x in xs), xs[0][0].dtype, reduction,
                            members=tuple(range(len(xs))))

    def all_gather(self, x, mesh_axis, concat_axis):
        rec = self._record("allgather", (mesh_axis,), (_nbytes(x[0]),), x[0].dtype)
        out = self._all_gather(x, mesh_axis, concat_axis)
        _finish(rec)
        return out

    def all_gather_many(self, *xs, mesh_axis, concat_axes):
        if not xs:
            return ()
        rec = self._record_bucket("allgather", (mesh_axis,), xs)
        out = tuple(self._all_gather(x, mesh_axis, a) for x, a in zip(xs, concat_axes, strict=True))
        _finish(rec)
        return out

    def _all_gather(self, x, mesh_axis, concat_axis):
        out = [None] * self.size
        for group in self.processor_groups([mesh_axis]):
            full = torch.cat([self._to(x[p], group[0]) for p in group], dim=concat_axis)
            for p in group:
                out[p] = self._to(full, p)
        return out

    def alltoall(self, x, mesh_axis, split_axis, concat_axis):
        rec = self._record("alltoall", (mesh_axis,), (_nbytes(x[0]),), x[0].dtype)
        out = [None] * self.size
        for group in self.processor_groups([mesh_axis]):
            n = len(group)
            pieces = [torch.chunk(x[p], n, dim=split_axis) for p in group]
            for j, p in enumerate(group):
                out[p] = torch.cat([self._to(pieces[i][j], p) for i in range(n)], dim=concat_axis)
        _finish(rec)
        return out

    def reduce_scatter(self, x, mesh_axis, scatter_axis):
        rec = self._record("reduce_scatter", (mesh_axis,), (_nbytes(x[0]),), x[0].dtype)
        out = self._reduce_scatter(x, mesh_axis, scatter_axis)
        _finish(rec)
        return out

    def reduce_scatter_many(self, *xs, mesh_axis, scatter_axes):
        if not xs:
            return ()
        rec = self._record_bucket("reduce_scatter", (mesh_axis,), xs)
        out = tuple(self._reduce_scatter(x, mesh_axis, a) for x, a in zip(xs, scatter_axes, strict=True))
        _finish(rec)
        return out

    def _reduce_scatter(self, x, mesh_axis, scatter_axis):
        out = [None] * self.size
        for group in self.processor_groups([mesh_axis]):
            acc = self._to(x[group[0]], group[0])
            for p in group[1:]:
                acc = acc + self._to(x[p], group[0])
            for c, piece in enumerate(torch.chunk(acc, len(group), dim=scatter_axis)):
                out[group[c]] = self._to(piece, group[c])
        return out

    def collective_permute(self, x, mesh_axis, source_pcoord):
        rec = self._record("collective_permute", (mesh_axis,), (_nbytes(x[0]),), x[0].dtype)
        out = [None] * self.size
        for group in self.processor_groups([mesh_axis]):
            for c, p in enumerate(group):
                src = source_pcoord[c]
                out[p] = torch.zeros_like(x[p]) if src is None else self._to(x[group[src]], p)
        _finish(rec)
        return out

    def broadcast(self, x, mesh_axis, root):
        """Every member of each group along ``mesh_axis`` gets the slice of the member at coordinate ``root``."""
        rec = self._record("broadcast", (mesh_axis,), (_nbytes(x[0]),), x[0].dtype)
        out = [None] * self.size
        for group in self.processor_groups([mesh_axis]):
            for p in group:
                out[p] = self._to(x[group[root]], p)
        _finish(rec)
        return out

    def import_full(self, full: torch.Tensor, layout: TensorLayout):
        shape = full.shape
        out = []
        split = [i for i, a in enumerate(layout) if a is not None]
        made: dict = {}  # processors with the same slice on the same device share one tensor
        for p in range(self.size):
            coords = self.pnum_to_processor_coordinates(p)
            key = (tuple(coords[layout[i]] for i in split), self.devices[p])
            if key not in made:
                t = full
                for i in split:
                    a = layout[i]
                    n = self.shape[a].size
                    size = shape[i] // n
                    t = t.narrow(i, coords[a] * size, size)
                made[key] = self._to(t, p)
            out.append(made[key])
        return out

    def share_replicas(self, x, layout: TensorLayout | None = None):
        out = list(x)
        if len(out) < 2 or not all(isinstance(t, torch.Tensor) for t in out):
            return x
        axes = None if layout is None else [a for a in layout if a is not None]
        reps: dict = {}  # processors that may hold the same slice -> their distinct tensors so far
        for p in range(self.size):
            coords = self.pnum_to_processor_coordinates(p)
            key = (None if axes is None else tuple(coords[a] for a in axes), self.devices[p])
            b = out[p]
            for a in reps.setdefault(key, []):
                if a is b or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
                    out[p] = a
                    break
            else:
                reps[key].append(b)
        return out

    def export_full(self, x, layout: TensorLayout) -> torch.Tensor:
        if layout.is_fully_replicated:
            return x[0]
        split = [(i, a) for i, a in enumerate(layout) if a is not None]
        owners = self.owner_pnums(layout)
        # concatenate along split dims, innermost mesh axis first, using owner slices
        pieces = {}
        for p in owners:
            coords = self.pnum_to_processor_coordinates(p)
            pieces[tuple(coords[a] for _, a in split)] = x[p].to(self.devices[0])
        return _assemble(pieces, split, self.shape)

    def local_slices(self, x):
        return list(x)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _finish(rec) -> None:
    if rec is not None:
        rec.finish()


def _assemble(pieces: dict, split, mesh_shape):
    """Concatenate slices keyed by mesh coordinates (one per split tensor dim) into a full tensor."""
    if not split:
        return pieces[()]
    (tdim, axis), rest = split[0], split[1:]
    n = mesh_shape[axis].size
    parts = []
    for c in range(n):
        sub = {k[1:]: v for k, v in pieces.items() if k[0] == c}
        parts.append(_assemble(sub, rest, mesh_shape))
    return torch.cat(parts, dim=tdim)


def _donating_calls(fn, inputs, size: int) -> list:
    """Per processor, the result of ``fn`` (a kernel called with ``donate``: it may update the inputs at
    :func:`~meshtorch.core.donation.donatable_positions` in place) on its slices.

    Processors holding the same tensors at every donatable position (the replicas of a variable and its
    slots: their gradients are replicas too, as every value in a replicated layout) share one call and its
    result, so a replicated variable is updated in place once for all its replicas (the commit keeps one
    replica's value likewise). A donated slice that several calls read (one held by processors whose other
    slices differ) is donated by none of them: those calls return new tensors, as without ``donate``."""
    positions = donatable_positions(fn)
    calls: dict = {}  # the identities of a processor's donatable slices -> the first processor holding them
    for p in range(size):
        calls.setdefault(tuple(id(inputs[j][p]) for j in positions), p)
    readers = Counter(ptr for p in calls.values()
                      for ptr in {x[p].data_ptr() for x in inputs if isinstance(x[p], torch.Tensor)})
    flag = fn.keywords["donate"]
    flags = tuple(flag) if isinstance(flag, tuple) else (True,) * len(positions)
    per_tensor = callable(getattr(kernel_of(fn), "donates", None))  # a multi-tensor kernel takes a tuple
    results = {}
    for p in calls.values():
        ok = tuple(f and readers[inputs[j][p].data_ptr()] == 1 for j, f in zip(positions, flags, strict=True))
        donate = ok if per_tensor else all(ok)
        call = fn if donate == flag else functools.partial(fn, donate=donate)
        results[p] = call(*[x[p] for x in inputs])
    return [results[calls[tuple(id(inputs[j][p]) for j in positions)]] for p in range(size)]

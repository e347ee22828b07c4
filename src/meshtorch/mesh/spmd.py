"""SpmdMeshImpl: one process per processor over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Mesh TensorFlow's SIMD mesh implementation (``simd_mesh_impl.py``) carried onto
``torch.distributed``: every process runs the same lowered program on its own slices, and the
collective primitives become process-group collectives. The processor number is the global rank,
so a process's mesh coordinates are ``pnum_to_processor_coordinates(rank)`` (row-major, as in
Mesh TF). A laid-out value is the local ``torch.Tensor`` (this rank's slice).

Process groups: ``torch.distributed.new_group`` must be called by every rank, for every group, in
the same order. The constructor therefore creates, collectively and eagerly, the groups along every
non-empty subset of mesh axes (meshes of up to 3 axes: at most 7 subsets); for larger meshes the
groups of one subset are created together, on first use, which is safe because every rank runs the
same program and so asks for the subsets in the same order. Groups are cached per process by their
rank tuple, so building several SpmdMeshImpls (several meshes or layouts) does not recreate them.

Each collective is written once here (packing, unpacking); the call that moves the bytes, and its
flight-recorder record, is made by the mesh's strategy (:mod:`meshtorch.mesh.spmd_strategy`): eager
``torch.distributed`` collectives, optionally asynchronous, or functional collectives that
``torch.compile`` holds in one graph (:meth:`SpmdMeshImpl.traceable`).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import weakref

import torch
import torch.distributed as dist

from meshtorch.core.errors import MeshtorchError
from meshtorch.core.layout import TensorLayout
from meshtorch.mesh.base import REDUCTIONS, MeshImpl
from meshtorch.mesh.placement import _assemble
from meshtorch.mesh.process import init_distributed, on_shutdown
from meshtorch.mesh.spmd_strategy import Collectives, EagerCollectives, FunctionalCollectives, MeshGroup

_GROUPS: dict[tuple[int, ...], object] = {}  # rank tuple -> ProcessGroup (per process, shared by impls)
_IMPLS: weakref.WeakSet = weakref.WeakSet()  # live SpmdMeshImpls: their cached groups are dropped at shutdown


def _drop_groups() -> None:
    """Forget every process group this module holds (the shared cache and each live mesh's own).

    Called by :func:`meshtorch.mesh.process.shutdown_distributed` before it destroys the groups: a gloo
    group's worker threads end only when its last reference goes, and a group still referenced when the
    interpreter finalizes is destroyed then, when a worker that drops a tensor can no longer take the GIL
    (the process aborts: "terminate called without an active exception", status -6).
    """
    _GROUPS.clear()
    for impl in list(_IMPLS):
        impl._axis_groups.clear()
        impl._mesh_groups.clear()


on_shutdown(_drop_groups)


def default_device_and_backend(device=None, backend=None) -> tuple[torch.device, str]:
    """``(cuda:LOCAL_RANK, "nccl")`` where CUDA is available, else ``(cpu, "gloo")``; each overridable."""
    if device is None:
        if torch.cuda.is_available() and backend in (None, "nccl"):
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    return device, backend


class SpmdMeshImpl(MeshImpl):
    """A mesh whose processors are the ranks of the default ``torch.distributed`` process group.

    Args:
        mesh_shape: a :class:`~meshtorch.core.mesh_spec.MeshSpec`, or the mesh shape, e.g. ``"rows:2;cols:2"``;
            its size must equal the world size.
        layout_rules: e.g. ``"batch:rows;hidden:cols"`` (with a mesh shape; None with a spec).
        device: torch device of this rank's slices; default ``cuda:LOCAL_RANK`` if CUDA is
            available, else ``cpu``.
        backend: used only if the default process group is not initialized yet (it is then
            initialized from torchrun's environment, see :func:`meshtorch.mesh.process.init_distributed`);
            default ``nccl`` for CUDA devices, ``gloo`` otherwise.
        async_collectives: True: start all-reduces, all-gathers and reduce-scatters asynchronously
            (``async_op=True``) and wait at the first use of the result, so that independent
            computation overlaps the communication (DDP's overlapped buckets; with storage rules the
            planner issues each weight's all-gather one gather early, FSDP's prefetch). False: every
            call blocks. None (default): True for CUDA devices; on CPU, all-reduces (single or
            bucketed) of at least :attr:`cpu_async_all_reduce_min_bytes` (1 MiB) per processor start
            asynchronously and everything else blocks: gloo's work competes with the computation for
            the same cores, so overlap pays only for large gradient buckets (measured on the 2-core
            test machine: docs/distributed.md, docs/memory.md). ``async_allreduce`` is its older name.
        storage, reshard_after_forward, prefetch: storage rules for variables (FSDP / ZeRO-3), whether
            the backward pass gathers weights again, and how many weight gathers are issued ahead;
            see :class:`~meshtorch.mesh.base.MeshImpl`.
        collectives: the strategy that issues the collectives (:mod:`meshtorch.mesh.spmd_strategy`);
            default :class:`~meshtorch.mesh.spmd_strategy.EagerCollectives` with ``async_collectives``.
            :meth:`traceable` gives this mesh with
            :class:`~meshtorch.mesh.spmd_strategy.FunctionalCollectives`.

    Raises:
        MeshtorchError: if the mesh has a different number of processors than the world size.

    Every rank must construct the impl (it creates process groups collectively) and then run the
    same fetches in the same order. Source: Mesh TF ``SimdMeshImpl``; PyTorch ``torch.distributed``.

    A :class:`~meshtorch.Lowering` on this mesh buckets its gradient reductions by default
    (:attr:`default_bucket_bytes`, 25 MiB: DDP's ``bucket_cap_mb``).
    """

    default_bucket_bytes = 25 * 2 ** 20
    #: one slice per process; :meth:`slicewise` is the kernel on the materialized slices (codegen calls it itself)
    local_slicewise = True
    #: on CPU with ``async_collectives=None``: all-reduces of at least this many bytes start asynchronously
    cpu_async_all_reduce_min_bytes = 2 ** 20

    def __init__(self, mesh_shape, layout_rules=None, device=None, backend=None, async_collectives: bool | None = None,
                 storage=None, reshard_after_forward: bool = True, async_allreduce: bool | None = None,
                 prefetch: int = 1, collectives: Collectives | None = None):
        super().__init__(mesh_shape, layout_rules, storage, reshard_after_forward, prefetch)
        if dist.is_initialized():  # the existing group's backend decides where slices live
            backend = dist.get_backend()
            if device is None and backend != "nccl":
                device = "cpu"
        self._device, backend = default_device_and_backend(device, backend)
        if async_collectives is None:
            async_collectives = async_allreduce
        if collectives is None:
            if async_collectives is None and self._device.type != "cuda":
                collectives = EagerCollectives(False, async_all_reduce_min_bytes=self.cpu_async_all_reduce_min_bytes)
            else:
                collectives = EagerCollectives(self._device.type == "cuda" if async_collectives is None
                                               else bool(async_collectives))
        elif not isinstance(collectives, Collectives):
            raise TypeError(f"SpmdMeshImpl: collectives must be a meshtorch.mesh.spmd_strategy.Collectives, "
                            f"got {type(collectives).__name__}.")
        #: the strategy issuing each collective call (:mod:`meshtorch.mesh.spmd_strategy`)
        self.collectives = collectives
        self._traceable: SpmdMeshImpl | None = self if collectives.traceable else None
        if not dist.is_initialized():
            init_distributed(backend=backend)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.world_size != self.size:
            raise MeshtorchError(
                f"SpmdMeshImpl: mesh {self.shape} has {self.size} processors but torch.distributed has "
                f"world size {self.world_size}; launch {self.size} processes (torchrun --nproc-per-node "
                f"{self.size}) or change the mesh shape.")
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        self.coords = self.pnum_to_processor_coordinates(self.rank)
        self.recorder_rank = self.rank
        self._axis_groups: dict[tuple[int, ...], object] = {}
        self._mesh_groups: dict[tuple[int, ...], MeshGroup] = {}
        _IMPLS.add(self)
        if self.ndims <= 3:
            for r in range(1, self.ndims + 1):
                for axes in itertools.combinations(range(self.ndims), r):
                    # made before any compiled run: a group first made while dynamo traces is a dict entry
                    # its guards see missing, then present (a recompile on the second step)
                    self._mesh_group(axes)

    # ------------------------------------------------------------------ groups
    def _group(self, mesh_axes) -> tuple[object, list[int]]:
        """``(process group, member ranks)`` of this rank's group along ``mesh_axes`` (created if new)."""
        key = tuple(sorted(mesh_axes))
        if key not in self._axis_groups:
            mine = None
            for ranks in self.processor_groups(key):  # same order on every rank
                ranks_t = tuple(sorted(ranks))
                if ranks_t not in _GROUPS:
                    if len(ranks_t) == self.world_size:
                        _GROUPS[ranks_t] = dist.group.WORLD
                    else:
                        _GROUPS[ranks_t] = dist.new_group(list(ranks_t))
                if self.rank in ranks:
                    mine = (_GROUPS[ranks_t], list(ranks))
            self._axis_groups[key] = mine
        return self._axis_groups[key]

    def _mesh_group(self, mesh_axes) -> MeshGroup:
        """This rank's group along ``mesh_axes`` as the strategy calls it (recording on this mesh)."""
        key = tuple(sorted(mesh_axes))
        g = self._mesh_groups.get(key)
        if g is None:
            pg, ranks = self._group(key)
            g = self._mesh_groups[key] = MeshGroup(pg, tuple(ranks), key, self._record)
        return g

    # ------------------------------------------------------------------ mesh facts
    def device(self, pnum: int) -> torch.device:
        return self._device

    def local_pnums(self) -> list[int]:
        return [self.rank]

    def local_slices(self, x) -> list[torch.Tensor]:
        return [_ready(x)]

    def materialize(self, x):
        return _ready(x)

    def from_local_slices(self, slices):
        return slices[0]

    def barrier(self) -> None:
        dist.barrier()

    @property
    def async_collectives(self) -> bool:
        """Every collective returns an in-flight result waited for at first use (``async_collectives=True``;
        the CPU default starts only large all-reduces so: ``collectives.is_async(kind, nbytes)`` says per call)."""
        return self.collectives.asynchronous

    def traceable(self) -> SpmdMeshImpl:
        """This mesh (same spec, rank, device and process groups) issuing its collectives as functional
        collectives (:class:`~meshtorch.mesh.spmd_strategy.FunctionalCollectives`), so ``torch.compile``
        holds them in one graph; made once, on first call (every rank calls it in the same order, as
        for any group). ``collective_permute`` (the shift ops) stays a graph break. The mesh itself is unchanged."""
        if self._traceable is None:
            self._traceable = SpmdMeshImpl(self.spec, device=self._device, collectives=FunctionalCollectives())
        return self._traceable

    def is_leader(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ primitives
    def laid_out_constant(self, fn):
        return fn(self.rank)

    def slicewise(self, fn, *inputs, num_outputs: int = 1):
        out = fn(*[_ready(x) for x in inputs])
        return out if num_outputs == 1 else tuple(out)

    def allreduce(self, x, mesh_axes, reduction="SUM", donate=False):
        group = self._reduction_group("allreduce", mesh_axes, reduction)
        if group is None:
            return self._trivial("allreduce", mesh_axes, [x], reduction)[0]
        buf, back = _wire(x)
        # donate: the program reads x nowhere else, so the sum may be written into its buffer (no copy)
        work, out = self.collectives.all_reduce(buf, reduction, group, owned=donate and buf.is_contiguous())
        return self._result(work, functools.partial(back, out))

    def _trivial(self, kind, mesh_axes, xs, reduction=""):
        """A collective over groups of one processor: nothing moves; recorded (the program asked for it),
        ``xs`` returned unchanged."""
        if xs and mesh_axes:
            bufs = [_wire(x)[0] for x in xs]
            rec = self._record(kind, mesh_axes, tuple(_nbytes(b) for b in bufs), bufs[0].dtype, reduction,
                               members=None if len(xs) == 1 else tuple(range(len(xs))))
            if rec is not None:
                rec.finish()
        return tuple(xs)

    def _reduction_group(self, op, mesh_axes, reduction):
        """The process group over the axes of ``mesh_axes`` with more than one processor (None: no
        communication needed). Raises ValueError naming ``op`` for a reduction not in REDUCTIONS."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        mesh_axes = [a for a in mesh_axes if self.shape[a].size > 1]
        return self._mesh_group(mesh_axes) if mesh_axes else None

    def _result(self, work, finish):
        """``finish()`` now (``work`` is None: the strategy's output can be read now) or an
        :class:`_InFlight` waited at first use (the strategy's work handle finishes the call's record)."""
        if work is None:
            return finish()
        return _InFlight(work, finish)

    def _bucketed(self, buckets, call, piece):
        """A bucket collective: for each ``(buffer, members, sizes)`` of ``buckets`` one
        ``call(buffer, sizes) -> (work, out)`` (``sizes``: the flight recorder's parts); member ``(i, ...)``
        becomes ``piece(out, member)`` (waited for with the call). Returns the results in member index order."""
        out: dict[int, object] = {}
        for buf, members, sizes in buckets:
            work, res = call(buf, sizes)
            for m in members:  # each piece waits on its bucket's one call
                out[m[0]] = self._result(work, functools.partial(piece, res, m))
        return tuple(out[i] for i in sorted(out))

    def allreduce_many(self, *xs, mesh_axes, reduction="SUM"):
        group = self._reduction_group("allreduce_many", mesh_axes, reduction)
        if group is None:
            return self._trivial("allreduce", mesh_axes, xs, reduction)
        # one flat buffer (one call) per dtype; the flat buffer is a fresh concatenation, so owned
        return self._bucketed(
            _flat_buckets(xs), lambda flat, sizes: self.collectives.all_reduce(flat, reduction, group, True, sizes),
            lambda flat, m: _piece(flat, *m[1:]))

    def _on_axis(self, x, mesh_axis):
        """``(n, group, wire tensor, back)`` for a collective along ``mesh_axis``; None if it has one member."""
        n = self.shape[mesh_axis].size
        if n == 1:
            return None
        return (n, self._mesh_group([mesh_axis]), *_wire(x))

    def all_gather(self, x, mesh_axis, concat_axis):
        on = self._on_axis(x, mesh_axis)
        if on is None:
            return self._trivial("allgather", (mesh_axis,), [x])[0]
        n, group, buf, back = on
        buf = buf.contiguous()
        work, out = self.collectives.all_gather(buf.reshape(-1), n, group)
        return self._result(work, functools.partial(_concat_pieces, out, tuple(buf.shape), n, concat_axis, back))

    def all_gather_many(self, *xs, mesh_axis, concat_axes):
        on = self._on_axis(xs[0], mesh_axis) if xs else None
        if on is None:
            return self._trivial("allgather", (mesh_axis,), xs)
        n, group = on[0], on[1]
        # one flat buffer (one call) per dtype, FSDP's flat parameter
        return self._bucketed(
            _flat_buckets(xs), lambda flat, sizes: self.collectives.all_gather(flat, n, group, sizes),
            lambda gathered, m: _gathered_piece(gathered, n, *m[1:3], concat_axes[m[0]], m[3]))

    def reduce_scatter_many(self, *xs, mesh_axis, scatter_axes):
        on = self._on_axis(xs[0], mesh_axis) if xs else None
        if on is None:
            return self._trivial("reduce_scatter", (mesh_axis,), xs)
        n, group = on[0], on[1]
        return self._bucketed(
            _row_buckets(xs, n, scatter_axes),
            lambda rows, sizes: self.collectives.reduce_scatter(rows.reshape(-1), n, group, sizes),
            lambda mine, m: _scattered_piece(mine, *m[1:3], scatter_axes[m[0]], m[3]))

    def alltoall(self, x, mesh_axis, split_axis, concat_axis):
        on = self._on_axis(x, mesh_axis)
        if on is None:
            return self._trivial("alltoall", (mesh_axis,), [x])[0]
        n, group, buf, back = on
        moved = buf.movedim(split_axis, 0).contiguous()  # piece j = rows [j*s, (j+1)*s)
        work, out = self.collectives.all_to_all(moved, group)
        return self._result(work, functools.partial(_exchanged, out, n, split_axis, concat_axis, back))

    def reduce_scatter(self, x, mesh_axis, scatter_axis):
        on = self._on_axis(x, mesh_axis)
        if on is None:
            return self._trivial("reduce_scatter", (mesh_axis,), [x])[0]
        n, group, buf, back = on
        moved = buf.movedim(scatter_axis, 0).contiguous()  # piece c = rows [c*s, (c+1)*s)
        work, out = self.collectives.reduce_scatter(moved, n, group)
        return self._result(work, functools.partial(_moved_back, out, scatter_axis, back))

    def collective_permute(self, x, mesh_axis, source_pcoord):
        group = self._mesh_group([mesh_axis])
        ranks = group.ranks
        me = self.coords[mesh_axis]
        buf, back = _wire(x)
        buf = buf.contiguous()
        src = source_pcoord[me]
        sends = [(buf, ranks[c]) for c, s in enumerate(source_pcoord) if s == me and c != me]
        if src is None:
            out = torch.zeros_like(buf)
        elif src == me:
            out = buf.clone()
        else:
            out = torch.empty_like(buf)
        self.collectives.exchange(buf, sends, out, None if src is None or src == me else ranks[src], group)
        return back(out)

    def broadcast(self, x, mesh_axis, root):
        """Every member along ``mesh_axis`` gets the slice of the member at coordinate ``root``: a process-group
        broadcast (``torch.distributed.broadcast``, or the functional one in a traceable mesh)."""
        on = self._on_axis(x, mesh_axis)
        if on is None:
            return self._trivial("broadcast", (mesh_axis,), [x])[0]
        _, group, buf, back = on
        work, out = self.collectives.broadcast(buf.contiguous(), root, group)
        return self._result(work, functools.partial(back, out))

    def import_full(self, full: torch.Tensor, layout: TensorLayout):
        t = full
        for i, a in enumerate(layout):
            if a is not None:
                size = full.shape[i] // self.shape[a].size
                t = t.narrow(i, self.coords[a] * size, size)
        # a copy of the slice only, so the full tensor can be freed
        return t.to(self._device).clone(memory_format=torch.contiguous_format)

    def export_full(self, x, layout: TensorLayout) -> torch.Tensor:
        used = sorted({a for a in layout if a is not None})
        if not used:
            return _ready(x)
        split = [(i, a) for i, a in enumerate(layout) if a is not None]
        group = self._mesh_group(used)  # a fetch: its record has no program step's tag
        ranks = group.ranks
        n = len(ranks)
        buf, back = _wire(x)
        buf = buf.contiguous()
        work, out = self.collectives.all_gather(buf.reshape(-1), n, group)
        out = _ready(self._result(work, functools.partial(torch.Tensor.view, out, (n, *buf.shape))))
        pieces = {}
        for j, p in enumerate(ranks):
            coords = self.pnum_to_processor_coordinates(p)
            pieces[tuple(coords[a] for _, a in split)] = out[j]
        return back(_assemble(pieces, split, self.shape))


class _InFlight:
    """A collective started asynchronously (``async_op=True``); its value is waited for on first use.

    Lets computation that does not need the result (the next layer's gradient, the current layer's
    forward while the next weight is gathered) overlap with the communication, as
    DistributedDataParallel's bucketed all-reduces and FSDP's prefetched all-gathers do. Only this
    module sees these objects: every primitive resolves its inputs, and the Lowering calls
    :meth:`materialize` before storing a value beyond the run.
    """

    __slots__ = ("work", "finish", "value")

    def __init__(self, work, finish):
        self.work, self.finish, self.value = work, finish, None

    def result(self) -> torch.Tensor:
        if self.value is None:
            self.work.wait()  # also the flight recorder's time: issue to the end of this wait
            self.value = self.finish()
            self.work = self.finish = None
        return self.value


def _concat_pieces(out, shape, n, concat_axis, back):
    """An all-gather's flat output ``[n * prod(shape)]`` as the pieces concatenated on ``concat_axis``."""
    full = list(shape)
    full[concat_axis] *= n
    return back(out.view(n, *shape).movedim(0, concat_axis).reshape(full))


def _by_dtype(wired) -> list[list[int]]:
    """Indices of ``[(wire tensor, back)]`` grouped by dtype (a bucket moves one flat buffer per dtype)."""
    groups: dict = {}
    for i, (buf, _) in enumerate(wired):
        groups.setdefault(buf.dtype, []).append(i)
    return list(groups.values())


def _flat_buckets(xs):
    """One bucket per dtype of ``xs`` (a collective moves one flat buffer per dtype): yields
    ``(flat, members, sizes)``, ``flat`` the members' elements concatenated, ``members`` a list of
    ``(index in xs, offset in flat, shape, back)`` for :func:`_piece` / :func:`_gathered_piece`, ``sizes``
    ``[(index in xs, bytes per processor)]`` for the flight recorder."""
    wired = [_wire(x) for x in xs]
    for idx in _by_dtype(wired):
        members, offset = [], 0
        for i in idx:
            buf, back = wired[i]
            members.append((i, offset, tuple(buf.shape), back))
            offset += buf.numel()
        flat = torch.cat([wired[i][0].reshape(-1) for i in idx])
        yield flat, members, [(i, math.prod(shape) * flat.element_size()) for i, _, shape, _ in members]


def _row_buckets(xs, n, scatter_axes):
    """Reduce-scatter buckets, one per dtype: yields ``(rows, members, sizes)`` where row ``c`` of ``rows``
    ``[n, elements / n]`` holds piece ``c`` (along its ``scatter_axes[i]``) of every member, so one
    reduce-scatter hands processor ``c`` its pieces; ``members`` is ``(index, offset in the row, piece
    shape with the scatter axis first, back)`` for :func:`_scattered_piece`, ``sizes`` as in
    :func:`_flat_buckets`."""
    wired = [_wire(x) for x in xs]
    for idx in _by_dtype(wired):
        moved = [wired[i][0].movedim(scatter_axes[i], 0) for i in idx]  # views: no copy yet
        members, offset = [], 0
        for i, m in zip(idx, moved, strict=True):
            members.append((i, offset, (m.shape[0] // n, *m.shape[1:]), wired[i][1]))
            offset += m.numel() // n
        rows = torch.empty((n, offset), dtype=moved[0].dtype, device=moved[0].device)
        for (_, off, piece, _), m in zip(members, moved, strict=True):
            # one strided copy per member, also when its scatter axis is not the first (a reshape first
            # would copy the moved member once more)
            rows[:, off:off + m.numel() // n].view(n, *piece).copy_(m.unflatten(0, (n, piece[0])))
        yield (rows, members, [(i, m.numel() * m.element_size()) for i, m in zip(idx, moved, strict=True)])


def _gathered_piece(gathered, n, offset, shape, concat_axis, back):
    """Member ``offset..`` of a bucket gathered as ``[n, bucket elements]``, concatenated on ``concat_axis``."""
    numel = 1
    for d in shape:
        numel *= d
    full = list(shape)
    full[concat_axis] *= n
    pieces = gathered.view(n, -1)[:, offset:offset + numel].view(n, *shape)  # a view: one copy below
    return back(pieces.movedim(0, concat_axis).reshape(full))


def _scattered_piece(mine, offset, piece, scatter_axis, back):
    """This processor's piece of one bucket member (scatter axis moved first as ``piece``), axis restored."""
    numel = 1
    for d in piece:
        numel *= d
    return back(mine[offset:offset + numel].view(piece).movedim(0, scatter_axis))


def _piece(flat, offset, shape, back):
    """Elements ``[offset, offset + prod(shape))`` of a bucket's flat buffer, as ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return back(flat[offset:offset + n].view(shape))


def _exchanged(out, n, split_axis, concat_axis, back):
    """An all-to-all's output (``n`` received pieces stacked on the moved ``split_axis``) concatenated on
    ``concat_axis``, ``split_axis`` restored."""
    pieces = out.view(n, out.shape[0] // n, *out.shape[1:]).unbind(0)
    return back(torch.cat([p.movedim(0, split_axis) for p in pieces], dim=concat_axis))


def _moved_back(out, axis, back):
    return back(out.movedim(0, axis))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ready(x):
    return x.result() if isinstance(x, _InFlight) else x


def _wire(x: torch.Tensor):
    """``(tensor to communicate, function back to x's dtype)``: bool travels as uint8 (gloo/NCCL lack bool)."""
    x = _ready(x)
    if x.dtype == torch.bool:
        return x.to(torch.uint8), lambda t: t.to(torch.bool)
    return x, lambda t: t


def spmd_info() -> str:
    """One line: rank, world size and backend of the default process group (for logs)."""
    if not dist.is_initialized():
        return "torch.distributed not initialized"
    return f"rank {dist.get_rank()}/{dist.get_world_size()} backend {dist.get_backend()}"


__all__ = ["SpmdMeshImpl", "default_device_and_backend", "spmd_info"]


"""The MeshImpl interface: slice arithmetic, processor groups and collective primitives.

An op's ``lower()`` talks only to this interface (through the Lowering), never to
``torch.distributed``, so every op runs on every implementation. A *laid-out value* is whatever
the implementation uses to hold one tensor's slices: a list of per-processor torch tensors for
:class:`~meshtorch.mesh.placement.PlacementMeshImpl`, the local slice for the SPMD one.

Processor numbers ("pnum") are row-major over the mesh shape, as in Mesh TensorFlow.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from meshtorch.core.collectives import KINDS
from meshtorch.core.layout import TensorLayout
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.mesh.recorder import CollectiveRecord, flight_recorder

REDUCTIONS = ("SUM", "MAX", "MIN")
_is_compiling = torch.compiler.is_compiling  # looked up once: the flight recorder asks on every collective


class MeshImpl:
    """Base class of the backends: a :class:`~meshtorch.core.mesh_spec.MeshSpec` (``self.spec``: mesh shape,
    layout rules, storage rules, slice arithmetic) plus the tensors and collectives that run it.

    Args:
        shape: a :class:`~meshtorch.core.mesh_spec.MeshSpec` (then the other arguments must be left out),
            or the mesh shape, e.g. ``"rows:2;cols:2"`` or ``[("all", 4)]``; ``""`` or ``[]`` is a single
            processor.
        layout_rules, storage, reshard_after_forward, prefetch: the spec's fields when ``shape`` is not
            a spec (see :class:`~meshtorch.core.mesh_spec.MeshSpec`).

    The spec's fields and slice arithmetic are readable on the backend too (``impl.shape``,
    ``impl.tensor_layout(...)``, ...), as in Mesh TF's ``MeshImpl``.

    Attributes:
        default_bucket_bytes: the gradient bucket size a :class:`~meshtorch.Lowering` uses on this mesh
            when none is given (0: one collective per variable; the SPMD mesh: DDP's 25 MiB).
        local_slicewise: this process holds one slice of every laid-out value and ``slicewise(fn, *xs)`` is
            ``fn(*[materialize(x) for x in xs])`` (the SPMD mesh), so the generated-code executor
            (:mod:`meshtorch.lowering.codegen`) calls the kernels itself. False by default.

    Raises:
        LayoutError: on a malformed rule.
        ValueError: ``prefetch`` < 0, or a spec given together with rules.
        TypeError: when a subclass is defined (at import) without the primitive of a declared collective kind
            (its record's ``method``, or ``bucket_method``, :mod:`meshtorch.core.collectives`), naming the kind.
    """

    default_bucket_bytes: int = 0
    local_slicewise: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for c in KINDS.values():
            for name in (c.method, c.bucket_method):
                if name is None:
                    continue
                fn = getattr(cls, name, None)
                if fn is None or (name == c.method and fn is getattr(MeshImpl, name, None)):
                    raise TypeError(f"{cls.__name__} does not implement {name!r}, the primitive of the collective "
                                    f"kind {c.name!r} (meshtorch.core.collectives): define {cls.__name__}.{name}.")

    def __init__(self, shape, layout_rules=None, storage=None, reshard_after_forward: bool = True, prefetch: int = 1):
        if isinstance(shape, MeshSpec):
            if layout_rules is not None or storage is not None or not reshard_after_forward or prefetch != 1:
                raise ValueError(f"{type(self).__name__}: give either a MeshSpec or a mesh shape with rules, "
                                 "not both (use spec.replace(...) to change a spec).")
            self.spec = shape
        else:
            try:
                self.spec = MeshSpec(shape, layout_rules or "", storage, reshard_after_forward, prefetch)
            except ValueError as e:
                raise ValueError(str(e).replace("MeshSpec", type(self).__name__)) from None
        self._axis_names: dict = {}  # mesh axis indices -> names, for the flight recorder
        #: the process's :class:`~meshtorch.mesh.recorder.FlightRecorder` (every collective call is recorded)
        self.recorder = flight_recorder()
        #: the rank the flight recorder writes (0: one process holds every processor)
        self.recorder_rank = 0

    # ------------------------------------------------------------------ the spec's facts, read through
    shape = property(lambda self: self.spec.shape, doc="The mesh shape (:class:`~meshtorch.core.dims.Shape`).")
    layout_rules = property(lambda self: self.spec.layout_rules, doc="The compute layout rules.")
    storage_rules = property(lambda self: self.spec.storage_rules, doc="The storage layout rules.")
    reshard_after_forward = property(lambda self: self.spec.reshard_after_forward,
                                     doc="See :class:`~meshtorch.core.mesh_spec.MeshSpec`.")
    prefetch = property(lambda self: self.spec.prefetch, doc="See :class:`~meshtorch.core.mesh_spec.MeshSpec`.")
    size = property(lambda self: self.spec.size, doc="Number of processors.")
    ndims = property(lambda self: self.spec.ndims, doc="Number of mesh axes.")

    def mesh_axis_index(self, name: str) -> int:
        return self.spec.mesh_axis_index(name)

    def pnum_to_processor_coordinates(self, pnum: int) -> tuple[int, ...]:
        return self.spec.pnum_to_processor_coordinates(pnum)

    def processor_coordinates_to_pnum(self, coords: Sequence[int]) -> int:
        return self.spec.processor_coordinates_to_pnum(coords)

    def processor_groups(self, mesh_axes: Sequence[int]) -> list[list[int]]:
        return self.spec.processor_groups(mesh_axes)

    def precompute_groups(self) -> None:
        """Fill the :meth:`processor_groups` cache for every set of mesh axes (2 ** ndims sets), so that a
        traced step finds it complete: ``torch.compile`` guards on the cache's keys, and a key first
        added while tracing would make the second run recompile."""
        for k in range(self.ndims + 1):
            for axes in itertools.combinations(range(self.ndims), k):
                self.processor_groups(axes)

    def tensor_layout(self, shape, tensor_name: str = "tensor", unsplittable=(), storage: bool = False) -> TensorLayout:
        return self.spec.tensor_layout(shape, tensor_name, unsplittable, storage)

    def tensor_dimension_to_mesh_axis(self, dim_name: str) -> int | None:
        return self.spec.tensor_dimension_to_mesh_axis(dim_name)

    def slice_shape(self, shape, layout: TensorLayout | None = None) -> list[int]:
        return self.spec.slice_shape(shape, layout)

    def slice_begin(self, shape, pnum: int, layout: TensorLayout | None = None) -> list[int]:
        return self.spec.slice_begin(shape, pnum, layout)

    def slice_bounds(self, shape, pnum: int, layout: TensorLayout | None = None) -> tuple[slice, ...]:
        return self.spec.slice_bounds(shape, pnum, layout)

    def owner_pnums(self, layout: TensorLayout) -> list[int]:
        return self.spec.owner_pnums(layout)

    def device(self, pnum: int) -> torch.device:
        """The torch device that holds processor ``pnum``'s slices."""
        return torch.device("cpu")

    def _record(self, kind: str, mesh_axes, parts, dtype, reduction: str = "", members=None,
                asynchronous: bool = False) -> CollectiveRecord | None:
        """Record a collective call starting now in the flight recorder (see :mod:`meshtorch.mesh.recorder`);
        ``mesh_axes``: indices; ``parts``: a tuple, bytes per processor of each value moved. Call ``finish()`` on the
        returned record (None when recording is off) when the call ends."""
        recorder = self.recorder
        if not recorder.enabled or _is_compiling():
            return None  # nothing to record (tracing executes no collective; a compiled graph calls no method)
        key = mesh_axes if type(mesh_axes) is tuple else tuple(mesh_axes)
        names = self._axis_names.get(key)
        if names is None:
            names = self._axis_names[key] = tuple(self.shape.dims[a].name for a in key)
        return recorder.new(kind, names, parts, dtype, reduction, self.size, self.recorder_rank, members,
                            asynchronous)

    # ------------------------------------------------------------------ primitives (abstract)
    def laid_out_constant(self, fn: Callable[[int], object]):
        """A laid-out value holding ``fn(pnum)`` on each processor (e.g. its slice offsets)."""
        raise NotImplementedError

    def slicewise(self, fn: Callable, *inputs, num_outputs: int = 1):
        """Apply ``fn`` to each processor's slices; ``num_outputs`` > 1 returns a tuple."""
        raise NotImplementedError

    def allreduce(self, x, mesh_axes: Sequence[int], reduction: str = "SUM", donate: bool = False):
        """Reduce (SUM, MAX, MIN) over the processor groups along ``mesh_axes``; all get the result.
        ``donate``: nothing reads ``x`` after this call, so the implementation may reduce in its buffer
        (the program marks such calls: :func:`meshtorch.lowering.donate.donate_reductions`)."""
        raise NotImplementedError

    def allreduce_many(self, *xs, mesh_axes: Sequence[int], reduction: str = "SUM"):
        """All-reduce several laid-out values over the same mesh axes in one collective call where the
        implementation can (a gradient bucket); returns a tuple. Default: one all-reduce each."""
        return tuple(self.allreduce(x, mesh_axes, reduction) for x in xs)

    def all_gather(self, x, mesh_axis: int, concat_axis: int):
        """All-gather: concatenate the group's slices along tensor axis ``concat_axis`` (JAX's
        ``all_gather(..., tiled=True)``; Mesh TF's ``allconcat``, kept as an alias)."""
        raise NotImplementedError

    def all_gather_many(self, *xs, mesh_axis: int, concat_axes: Sequence[int]):
        """All-gather several laid-out values along one mesh axis in one collective call where the
        implementation can (FSDP's flat-parameter gather of a bucket of weights); ``concat_axes[i]``
        is value ``i``'s tensor axis. Returns a tuple. Default: one :meth:`all_gather` each."""
        return tuple(self.all_gather(x, mesh_axis, a) for x, a in zip(xs, concat_axes, strict=True))

    def reduce_scatter_many(self, *xs, mesh_axis: int, scatter_axes: Sequence[int]):
        """Reduce-scatter several laid-out values along one mesh axis in one collective call where the
        implementation can (a bucket of FSDP gradients). Returns a tuple. Default: one
        :meth:`reduce_scatter` each."""
        return tuple(self.reduce_scatter(x, mesh_axis, a) for x, a in zip(xs, scatter_axes, strict=True))

    def alltoall(self, x, mesh_axis: int, split_axis: int, concat_axis: int):
        """All-to-all along ``mesh_axis``: split on ``split_axis``, send piece j to member j, concat."""
        raise NotImplementedError

    def reduce_scatter(self, x, mesh_axis: int, scatter_axis: int):
        """Sum over the group along ``mesh_axis``; member ``c`` keeps piece ``c`` (of ``n`` equal pieces)
        of tensor axis ``scatter_axis``: JAX's ``psum_scatter(..., tiled=True)``, the transpose of
        :meth:`all_gather`."""
        raise NotImplementedError

    def collective_permute(self, x, mesh_axis: int, source_pcoord: Sequence[int | None]):
        """Processor at coordinate c on ``mesh_axis`` gets the slice of ``source_pcoord[c]`` (None: zeros).

        XLA's CollectivePermute / JAX's ``lax.ppermute`` written per target (a source may feed several
        targets); Mesh TF's ``receive``, kept as an alias."""
        raise NotImplementedError

    def broadcast(self, x, mesh_axis: int, root: int):
        """Every member of each group along ``mesh_axis`` gets the slice of the member at coordinate ``root``
        (``torch.distributed.broadcast`` within each group; JAX has no single primitive: ``psum`` of the
        slice masked off the root)."""
        raise NotImplementedError

    def shift_by_n_processors(self, x, mesh_axis: int, offset: int, wrap: bool):
        """Coordinate c receives from c - offset (mod n if ``wrap``, else zeros off the end)."""
        n = self.shape[mesh_axis].size
        source = [((c - offset) % n) if wrap else (c - offset if 0 <= c - offset < n else None) for c in range(n)]
        return self.collective_permute(x, mesh_axis, source)

    # ------------------------------------------------------------------ Mesh TF's names for the primitives
    def allconcat(self, x, mesh_axis: int, concat_axis: int):
        """Mesh TF's ``MeshImpl.allconcat``: :meth:`all_gather`."""
        return self.all_gather(x, mesh_axis, concat_axis)

    def receive(self, x, mesh_axis: int, source_pcoord: Sequence[int | None]):
        """Mesh TF's ``MeshImpl.receive``: :meth:`collective_permute`."""
        return self.collective_permute(x, mesh_axis, source_pcoord)

    def import_full(self, full: torch.Tensor, layout: TensorLayout):
        """Laid-out value from a full (logical) tensor: each processor keeps its slice."""
        raise NotImplementedError

    def export_full(self, x, layout: TensorLayout) -> torch.Tensor:
        """The full (logical) tensor from a laid-out value."""
        raise NotImplementedError

    def local_slices(self, x) -> list[torch.Tensor]:
        """The slices this process holds, in pnum order."""
        raise NotImplementedError

    def share_replicas(self, x, layout: TensorLayout | None = None):
        """``x`` with processors whose slices are equal sharing one tensor (implementations holding
        several processors' slices; kernels then run once for all of them, see
        :mod:`meshtorch.lowering.codegen`). ``layout``: only processors holding the same slice of it
        are compared (None: all). Default: ``x`` unchanged."""
        return x

    def materialize(self, x):
        """``x`` with any communication still in flight finished (the Lowering calls it before keeping
        a value beyond one run, e.g. a variable's new value). Identity unless collectives are asynchronous."""
        return x

    def traceable(self) -> MeshImpl:
        """This mesh with collectives ``torch.compile`` can hold inside one graph (a
        :class:`~meshtorch.lowering.session.Session` in ``"compile"`` mode binds its steps to it).
        Default: ``self`` (a mesh held in one process has only tensor ops to trace); the SPMD mesh
        returns itself with :class:`~meshtorch.mesh.spmd_strategy.FunctionalCollectives`."""
        return self

    def local_pnums(self) -> list[int]:
        """Processor numbers whose slices this process holds (default: all, as in placement)."""
        return list(range(self.size))

    def from_local_slices(self, slices: Sequence[torch.Tensor]):
        """Laid-out value from this process's slices, one per :meth:`local_pnums` entry, in that order."""
        return list(slices)

    def barrier(self) -> None:
        """Wait for every process of the mesh (default: none to wait for, one process holds all)."""

    def is_leader(self) -> bool:
        """True in the one process that prints and writes shared files (default: this one, it holds all)."""
        return True

    def __repr__(self):
        storage = f", storage={str(self.storage_rules)!r}" if self.storage_rules.pairs else ""
        return f"{type(self).__name__}({str(self.shape)!r}, {str(self.layout_rules)!r}{storage})"

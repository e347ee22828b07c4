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

from meshtorch.core.dims import Shape, convert_to_shape
from meshtorch.core.errors import LayoutError
from meshtorch.core.layout import LayoutRules, TensorLayout, convert_to_layout_rules

REDUCTIONS = ("SUM", "MAX", "MIN")


class MeshImpl:
    """Base class: a mesh shape (named axes) plus layout rules.

    Args:
        shape: the mesh shape, e.g. ``"rows:2;cols:2"`` or ``[("all", 4)]``; ``""`` or ``[]`` is
            a single processor.
        layout_rules: layout rules (Mesh TF's name), e.g. ``"batch:rows;hidden:cols"`` (the compute layout).
        storage: storage rules, e.g. ``"d_model:data"``: how variables, their optimizer slots and
            the update math are laid out (ZeRO-3 / FSDP). A storage rule overrides the compute
            rules for the dimension it names; default none (variables stored as computed).
        reshard_after_forward: with storage rules, a weight gathered for the forward pass is freed
            after its last forward use and gathered again for the backward pass (FSDP's default);
            False keeps the forward gather for the backward (one all-gather, more memory).
        prefetch: with storage rules, how many weight all-gathers are issued ahead of their use
            (FSDP's forward/backward prefetch; 0: each gather just before its first use). Costs
            that many gathered weights of extra memory, which the planner's memory report includes.

    A rule naming a mesh axis the mesh lacks is ignored (as in Mesh TF), so one set of rules
    serves several meshes.

    Raises:
        LayoutError: on a malformed rule.
    """

    def __init__(self, shape, layout_rules, storage=None, reshard_after_forward: bool = True, prefetch: int = 1):
        self.shape: Shape = convert_to_shape(shape)
        self.layout_rules: LayoutRules = convert_to_layout_rules(layout_rules)
        self.storage_rules: LayoutRules = convert_to_layout_rules(storage or "")
        self.reshard_after_forward = bool(reshard_after_forward)
        if int(prefetch) < 0:
            raise ValueError(f"{type(self).__name__}: prefetch must be >= 0 (gathers issued ahead), got {prefetch}.")
        self.prefetch = int(prefetch)
        self._storage_layout_rules = self.layout_rules.overridden_by(self.storage_rules)
        self._strides = []
        s = 1
        for d in reversed(self.shape.dims):
            self._strides.insert(0, s)
            s *= d.size
        self._group_cache: dict = {}

    # ------------------------------------------------------------------ mesh facts
    @property
    def size(self) -> int:
        """Number of processors."""
        return self.shape.size

    @property
    def ndims(self) -> int:
        return self.shape.ndims

    def mesh_axis_index(self, name: str) -> int:
        if name not in self.shape:
            raise LayoutError(f"Mesh {self.shape} has no axis {name!r}.")
        return self.shape.get_dim_index(name)

    def pnum_to_processor_coordinates(self, pnum: int) -> tuple[int, ...]:
        return tuple((pnum // st) % d.size for st, d in zip(self._strides, self.shape.dims, strict=True))

    def processor_coordinates_to_pnum(self, coords: Sequence[int]) -> int:
        return sum(c * st for c, st in zip(coords, self._strides, strict=True))

    def processor_groups(self, mesh_axes: Sequence[int]) -> list[list[int]]:
        """Groups of processors that differ only in their coordinates on ``mesh_axes``.

        Each group is ordered row-major over the ``mesh_axes`` coordinates; groups are ordered
        row-major over the other coordinates.
        """
        key = tuple(sorted(mesh_axes))
        if key in self._group_cache:
            return self._group_cache[key]
        other = [a for a in range(self.ndims) if a not in key]
        groups = []
        for oc in itertools.product(*[range(self.shape[a].size) for a in other]):
            group = []
            for ic in itertools.product(*[range(self.shape[a].size) for a in key]):
                coords = [0] * self.ndims
                for a, c in zip(other, oc, strict=True):
                    coords[a] = c
                for a, c in zip(key, ic, strict=True):
                    coords[a] = c
                group.append(self.processor_coordinates_to_pnum(coords))
            groups.append(group)
        self._group_cache[key] = groups
        return groups

    def precompute_groups(self) -> None:
        """Fill the :meth:`processor_groups` cache for every set of mesh axes (2 ** ndims sets), so that a
        traced step finds it complete: ``torch.compile`` guards on the cache's keys, and a key first
        added while tracing would make the second run recompile."""
        for k in range(self.ndims + 1):
            for axes in itertools.combinations(range(self.ndims), k):
                self.processor_groups(axes)

    # ------------------------------------------------------------------ layouts and slices
    def tensor_layout(self, shape, tensor_name: str = "tensor", unsplittable=(), storage: bool = False) -> TensorLayout:
        """Layout of a tensor of ``shape`` under the compute rules, or the storage rules if ``storage``.

        Raises:
            LayoutError: naming ``tensor_name`` and the dimension (see :meth:`LayoutRules.tensor_layout`).
        """
        rules = self._storage_layout_rules if storage else self.layout_rules
        return rules.tensor_layout(shape, self.shape, tensor_name, unsplittable)

    def tensor_dimension_to_mesh_axis(self, dim_name: str) -> int | None:
        return self.layout_rules.tensor_dimension_to_mesh_axis(dim_name, self.shape)

    def slice_shape(self, shape, layout: TensorLayout | None = None) -> list[int]:
        """Per-processor slice sizes of a tensor of ``shape`` (all processors hold equal slices)."""
        shape = convert_to_shape(shape)
        layout = layout if layout is not None else self.tensor_layout(shape)
        return [d.size // (self.shape[a].size if a is not None else 1) for d, a in zip(shape, layout, strict=True)]

    def slice_begin(self, shape, pnum: int, layout: TensorLayout | None = None) -> list[int]:
        """Global index of the first element of processor ``pnum``'s slice, per tensor dim."""
        shape = convert_to_shape(shape)
        layout = layout if layout is not None else self.tensor_layout(shape)
        coords = self.pnum_to_processor_coordinates(pnum)
        sizes = self.slice_shape(shape, layout)
        return [0 if a is None else coords[a] * s for a, s in zip(layout, sizes, strict=True)]

    def slice_bounds(self, shape, pnum: int, layout: TensorLayout | None = None) -> tuple[slice, ...]:
        begins = self.slice_begin(shape, pnum, layout)
        sizes = self.slice_shape(shape, layout)
        return tuple(slice(b, b + s) for b, s in zip(begins, sizes, strict=True))

    def owner_pnums(self, layout: TensorLayout) -> list[int]:
        """One processor per distinct slice: those with coordinate 0 on axes the layout leaves unused."""
        used = {a for a in layout if a is not None}
        return [p for p in range(self.size)
                if all(c == 0 for a, c in enumerate(self.pnum_to_processor_coordinates(p)) if a not in used)]

    def device(self, pnum: int) -> torch.device:
        """The torch device that holds processor ``pnum``'s slices."""
        return torch.device("cpu")

    # ------------------------------------------------------------------ primitives (abstract)
    def laid_out_constant(self, fn: Callable[[int], object]):
        """A laid-out value holding ``fn(pnum)`` on each processor (e.g. its slice offsets)."""
        raise NotImplementedError

    def slicewise(self, fn: Callable, *inputs, num_outputs: int = 1):
        """Apply ``fn`` to each processor's slices; ``num_outputs`` > 1 returns a tuple."""
        raise NotImplementedError

    def allreduce(self, x, mesh_axes: Sequence[int], reduction: str = "SUM"):
        """Reduce (SUM, MAX, MIN) over the processor groups along ``mesh_axes``; all get the result."""
        raise NotImplementedError

    def allreduce_many(self, *xs, mesh_axes: Sequence[int], reduction: str = "SUM"):
        """All-reduce several laid-out values over the same mesh axes in one collective call where the
        implementation can (a gradient bucket); returns a tuple. Default: one all-reduce each."""
        return tuple(self.allreduce(x, mesh_axes, reduction) for x in xs)

    def allconcat(self, x, mesh_axis: int, concat_axis: int):
        """All-gather: concatenate the group's slices along tensor axis ``concat_axis``."""
        raise NotImplementedError

    def allconcat_many(self, *xs, mesh_axis: int, concat_axes: Sequence[int]):
        """All-gather several laid-out values along one mesh axis in one collective call where the
        implementation can (FSDP's flat-parameter gather of a bucket of weights); ``concat_axes[i]``
        is value ``i``'s tensor axis. Returns a tuple. Default: one :meth:`allconcat` each."""
        return tuple(self.allconcat(x, mesh_axis, a) for x, a in zip(xs, concat_axes, strict=True))

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
        :meth:`allconcat`."""
        raise NotImplementedError

    def receive(self, x, mesh_axis: int, source_pcoord: Sequence[int | None]):
        """Processor at coordinate c on ``mesh_axis`` gets the slice of ``source_pcoord[c]`` (None: zeros)."""
        raise NotImplementedError

    def shift_by_n_processors(self, x, mesh_axis: int, offset: int, wrap: bool):
        """Coordinate c receives from c - offset (mod n if ``wrap``, else zeros off the end)."""
        n = self.shape[mesh_axis].size
        source = [((c - offset) % n) if wrap else (c - offset if 0 <= c - offset < n else None) for c in range(n)]
        return self.receive(x, mesh_axis, source)

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
        returns a :class:`~meshtorch.mesh.spmd_functional.FunctionalSpmdMeshImpl`."""
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

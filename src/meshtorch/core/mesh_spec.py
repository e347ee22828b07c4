"""MeshSpec: a mesh's shape, its layout rules and storage rules, and the slice arithmetic they imply.

A spec is what planning needs to know about a mesh and nothing it needs to run: no devices, no
process groups, no tensors. The planner, the layout search, memory and cost reports and the models'
checks read specs; a backend (:mod:`meshtorch.mesh`: placement in one process, SPMD over
``torch.distributed``) holds one (``impl.spec``) and adds tensors and collectives. The split follows
JAX's ``Mesh`` + ``NamedSharding`` vs the runtime, and Haliax's axis mappings (compute mapping vs
parameter mapping = Mesh TF's layout rules vs meshtorch's storage rules).

Processor numbers ("pnum") are row-major over the mesh shape, as in Mesh TensorFlow.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from meshtorch.core.dims import convert_to_shape
from meshtorch.core.errors import LayoutError
from meshtorch.core.layout import TensorLayout, convert_to_layout_rules


class MeshSpec:
    """A mesh shape (named axes) with compute and storage layout rules; immutable and hashable.

    Args:
        shape: the mesh shape, e.g. ``"rows:2;cols:2"``, ``"data:2,model:2"`` or ``[("all", 4)]``;
            ``""`` or ``[]`` is a single processor.
        layout_rules: the compute layout (Mesh TF's layout rules), e.g. ``"batch:rows;hidden:cols"``.
        storage: storage rules, e.g. ``"d_model:data"``: how variables, their optimizer slots and the
            update math are laid out (ZeRO-3 / FSDP). A storage rule overrides the compute rules for
            the dimension it names; default none (variables stored as computed).
        reshard_after_forward: with storage rules, a weight gathered for the forward pass is freed
            after its last forward use and gathered again for the backward pass (FSDP's default), except
            where freeing it saves nothing (the output projection: see
            :func:`meshtorch.lowering.planner.kept_forward_gathers`); ``"always"`` reshards those too (the
            least memory: TorchTitan's ``reshard_after_forward_policy="always"``); False keeps every forward
            gather for the backward (one all-gather, more memory).
        prefetch: with storage rules, how many weight all-gathers are issued ahead of their use
            (FSDP's forward/backward prefetch; 0: each gather just before its first use).

    A rule naming a mesh axis the mesh lacks is ignored (as in Mesh TF), so one set of rules serves
    several meshes.

    Raises:
        LayoutError: on a malformed rule or mesh shape.
        ValueError: ``prefetch`` < 0, or a ``reshard_after_forward`` string other than ``"always"``.
    """

    __slots__ = ("shape", "layout_rules", "storage_rules", "reshard_after_forward", "prefetch",
                 "_storage_layout_rules", "_strides", "_group_cache")

    def __init__(self, shape="", layout_rules="", storage=None, reshard_after_forward: bool | str = True,
                 prefetch: int = 1):
        if int(prefetch) < 0:
            raise ValueError(f"MeshSpec: prefetch must be >= 0 (gathers issued ahead), got {prefetch}.")
        if isinstance(reshard_after_forward, str) and reshard_after_forward != "always":
            raise ValueError(f"MeshSpec: reshard_after_forward must be True, False or 'always', got "
                             f"{reshard_after_forward!r}.")
        s = object.__setattr__
        s(self, "shape", convert_to_shape(shape))
        s(self, "layout_rules", convert_to_layout_rules(layout_rules))
        s(self, "storage_rules", convert_to_layout_rules(storage or ""))
        s(self, "reshard_after_forward", reshard_after_forward if reshard_after_forward == "always"
          else bool(reshard_after_forward))
        s(self, "prefetch", int(prefetch))
        s(self, "_storage_layout_rules", self.layout_rules.overridden_by(self.storage_rules))
        strides, n = [], 1
        for d in reversed(self.shape.dims):
            strides.insert(0, n)
            n *= d.size
        s(self, "_strides", tuple(strides))
        s(self, "_group_cache", {})

    def __setattr__(self, name, value):
        raise AttributeError(f"MeshSpec is immutable: use spec.replace({name}=...) for a changed copy.")

    def replace(self, **changes) -> MeshSpec:
        """A copy with some fields changed (``shape``, ``layout_rules``, ``storage``, ``reshard_after_forward``,
        ``prefetch``), like :func:`dataclasses.replace`."""
        fields = {"shape": self.shape, "layout_rules": self.layout_rules, "storage": self.storage_rules,
                  "reshard_after_forward": self.reshard_after_forward, "prefetch": self.prefetch}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"MeshSpec.replace: unknown field(s) {sorted(unknown)}; fields are {sorted(fields)}.")
        fields.update(changes)
        return MeshSpec(**fields)

    def _key(self):
        return (tuple((d.name, d.size) for d in self.shape), self.layout_rules, self.storage_rules,
                self.reshard_after_forward, self.prefetch)

    def __eq__(self, other):
        return isinstance(other, MeshSpec) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        storage = f", storage={str(self.storage_rules)!r}" if self.storage_rules.pairs else ""
        return f"MeshSpec({str(self.shape)!r}, {str(self.layout_rules)!r}{storage})"

    def record(self) -> dict:
        """What a program records of its mesh (a session checks that its backend's spec matches)."""
        return {"shape": str(self.shape), "layout": str(self.layout_rules), "storage": str(self.storage_rules),
                "reshard_after_forward": self.reshard_after_forward}

    # ------------------------------------------------------------------ mesh facts
    @property
    def size(self) -> int:
        """Number of processors."""
        return self.shape.size

    @property
    def ndims(self) -> int:
        """Number of mesh axes."""
        return self.shape.ndims

    def mesh_axis_index(self, name: str) -> int:
        """Index of mesh axis ``name``.

        Raises:
            LayoutError: if the mesh has no such axis.
        """
        if name not in self.shape:
            raise LayoutError(f"Mesh {self.shape} has no axis {name!r}.")
        return self.shape.get_dim_index(name)

    def pnum_to_processor_coordinates(self, pnum: int) -> tuple[int, ...]:
        """Processor ``pnum``'s coordinate on each mesh axis (row-major numbering)."""
        return tuple((pnum // st) % d.size for st, d in zip(self._strides, self.shape.dims, strict=True))

    def processor_coordinates_to_pnum(self, coords: Sequence[int]) -> int:
        """The processor number at mesh coordinates ``coords``."""
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

    # ------------------------------------------------------------------ layouts and slices
    def tensor_layout(self, shape, tensor_name: str = "tensor", unsplittable=(), storage: bool = False) -> TensorLayout:
        """Layout of a tensor of ``shape`` under the compute rules, or the storage rules if ``storage``.

        Raises:
            LayoutError: naming ``tensor_name`` and the dimension (see :meth:`LayoutRules.tensor_layout`).
        """
        rules = self._storage_layout_rules if storage else self.layout_rules
        return rules.tensor_layout(shape, self.shape, tensor_name, unsplittable)

    def tensor_dimension_to_mesh_axis(self, dim_name: str) -> int | None:
        """Index of the mesh axis the compute rules split ``dim_name`` over, or None."""
        return self.layout_rules.tensor_dimension_to_mesh_axis(dim_name, self.shape)

    def axis_size_for(self, dim_name: str) -> int:
        """Size of the mesh axis that splits ``dim_name`` under the compute rules (1 if it is not split):
        what a dimension's size must be a multiple of (Haliax's ``round_axis_for_partitioning``)."""
        a = self.tensor_dimension_to_mesh_axis(dim_name)
        return 1 if a is None else self.shape[a].size

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
        """Processor ``pnum``'s slice of a tensor of ``shape`` as a tuple of Python slices (one per dim)."""
        begins = self.slice_begin(shape, pnum, layout)
        sizes = self.slice_shape(shape, layout)
        return tuple(slice(b, b + s) for b, s in zip(begins, sizes, strict=True))

    def owner_pnums(self, layout: TensorLayout) -> list[int]:
        """One processor per distinct slice: those with coordinate 0 on axes the layout leaves unused."""
        used = {a for a in layout if a is not None}
        return [p for p in range(self.size)
                if all(c == 0 for a, c in enumerate(self.pnum_to_processor_coordinates(p)) if a not in used)]


def convert_to_mesh_spec(x) -> MeshSpec:
    """``x`` as a :class:`MeshSpec`: a spec itself, or the spec a mesh implementation holds (``x.spec``).

    Raises:
        TypeError: for anything else, naming its type.
    """
    if isinstance(x, MeshSpec):
        return x
    spec = getattr(x, "spec", None)
    if isinstance(spec, MeshSpec):
        return spec
    raise TypeError(f"expected a MeshSpec or a mesh implementation (with .spec), got {type(x).__name__}.")


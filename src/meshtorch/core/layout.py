"""Layout rules: which tensor dimensions are split over which mesh axes.

Follows Mesh TensorFlow's ``LayoutRules`` / ``TensorLayout`` (Shazeer et al. 2018, section 4):
a global set of ``(tensor-dimension name, mesh-axis name)`` pairs. A tensor dimension is split
iff a rule names it and the mesh has that axis.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from meshtorch.core.dims import Shape, convert_to_shape
from meshtorch.core.errors import LayoutError

_SEPARATORS = re.compile(r"[;,\s]+")


class LayoutRules:
    """Pairs ``(tensor_dim_name, mesh_axis_name)``.

    Build from a string ``"batch:rows;hidden:cols"`` (separators ``;`` ``,`` or whitespace),
    an iterable of pairs, or another LayoutRules. ``""`` means everything replicated.

    Raises:
        LayoutError: on an entry that is not ``dim:axis``.
    """

    def __init__(self, pairs: str | Iterable | LayoutRules = ()):
        rules = pairs  # Mesh TF's parameter name; a string "dim:axis;..." is accepted too
        if isinstance(rules, LayoutRules):
            self._pairs = rules._pairs
            return
        if rules is None:
            rules = ()
        if isinstance(rules, str):
            parts = [p for p in _SEPARATORS.split(rules.strip()) if p]
            pairs = []
            for p in parts:
                if p.count(":") != 1 or not all(p.split(":")):
                    raise LayoutError(
                        f"Layout rule {p!r} is not of the form 'tensor_dim:mesh_axis', "
                        "e.g. 'batch:rows;hidden:cols'."
                    )
                pairs.append(tuple(x.strip() for x in p.split(":")))
        else:
            pairs = []
            for p in rules:
                if not (isinstance(p, tuple | list) and len(p) == 2):
                    raise LayoutError(f"Layout rule {p!r} must be a (tensor_dim, mesh_axis) pair.")
                pairs.append((str(p[0]), str(p[1])))
        self._pairs = tuple(dict.fromkeys(pairs))

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        return self._pairs

    def __iter__(self):
        return iter(self._pairs)

    def __repr__(self) -> str:
        return f"LayoutRules({str(self)!r})"

    def __str__(self) -> str:
        return ";".join(f"{a}:{b}" for a, b in self._pairs)

    def __eq__(self, other):
        return isinstance(other, LayoutRules) and set(self._pairs) == set(other._pairs)

    def __hash__(self):
        return hash(frozenset(self._pairs))

    def overridden_by(self, other: LayoutRules) -> LayoutRules:
        """These rules with every rule for a dimension ``other`` names replaced by ``other``'s
        (storage rules over compute rules, see :class:`~meshtorch.mesh.base.MeshImpl`)."""
        named = {d for d, _ in other.pairs}
        return LayoutRules([p for p in self._pairs if p[0] not in named] + list(other.pairs))

    def tensor_dimension_to_mesh_axis(self, dim_name: str, mesh_shape: Shape) -> int | None:
        """Index of the mesh axis that splits ``dim_name``, or None if it is replicated.

        Raises:
            LayoutError: if rules map the dimension to two axes that both exist in the mesh.
        """
        axes = [mesh_shape.get_dim_index(a) for d, a in self._pairs if d == dim_name and a in mesh_shape]
        if not axes:
            return None
        if len(axes) > 1:
            names = [mesh_shape[i].name for i in axes]
            raise LayoutError(
                f"Layout rules map tensor dimension {dim_name!r} to mesh axes {names}; "
                "a dimension can be split over one mesh axis only. Drop one of the rules."
            )
        return axes[0]

    def tensor_layout(self, shape, mesh_shape, tensor_name: str = "tensor",
                      unsplittable=()) -> TensorLayout:
        """The :class:`TensorLayout` of a tensor of ``shape`` on a mesh of ``mesh_shape``.

        Raises:
            LayoutError: naming ``tensor_name`` and the dimension, if a size is not divisible
                by the mesh-axis size, two dims of the tensor go to one mesh axis, or a dim the
                op declares unsplittable is split.
        """
        shape = convert_to_shape(shape)
        mesh_shape = convert_to_shape(mesh_shape)
        axes = []
        used: dict[int, str] = {}
        for d in shape:
            a = self.tensor_dimension_to_mesh_axis(d.name, mesh_shape)
            if a is not None:
                axis = mesh_shape[a]
                if d.name in unsplittable:
                    raise LayoutError(
                        f"Tensor {tensor_name!r}: dimension {d.name!r} cannot be split (the op that makes "
                        f"it needs it whole), but the layout puts it on mesh axis {axis.name!r}. "
                        f"Remove the rule '{d.name}:{axis.name}' or rename the dimension first."
                    )
                if d.size % axis.size:
                    raise LayoutError(
                        f"Tensor {tensor_name!r}: dimension {d.name!r} of size {d.size} is not divisible by "
                        f"mesh axis {axis.name!r} of size {axis.size}. Change the size, the mesh, or drop "
                        f"the rule '{d.name}:{axis.name}'."
                    )
                if a in used:
                    raise LayoutError(
                        f"Tensor {tensor_name!r} {shape}: dimensions {used[a]!r} and {d.name!r} are both "
                        f"split over mesh axis {axis.name!r}; one tensor can use a mesh axis once. "
                        "Drop one of the rules or rename one dimension."
                    )
                used[a] = d.name
            axes.append(a)
        return TensorLayout(axes)


class TensorLayout:
    """Per tensor dimension, the index of the mesh axis it is split over (or None)."""

    __slots__ = ("tensor_axis_to_mesh_axis",)

    def __init__(self, tensor_axis_to_mesh_axis):
        self.tensor_axis_to_mesh_axis = tuple(tensor_axis_to_mesh_axis)

    def __eq__(self, other):
        return isinstance(other, TensorLayout) and self.tensor_axis_to_mesh_axis == other.tensor_axis_to_mesh_axis

    def __hash__(self):
        return hash(self.tensor_axis_to_mesh_axis)

    def __repr__(self):
        return f"TensorLayout{self.tensor_axis_to_mesh_axis}"

    def __len__(self):
        return len(self.tensor_axis_to_mesh_axis)

    def __getitem__(self, i):
        return self.tensor_axis_to_mesh_axis[i]

    @property
    def is_fully_replicated(self) -> bool:
        return all(a is None for a in self.tensor_axis_to_mesh_axis)

    def mesh_axis_to_tensor_axis(self, mesh_ndims: int) -> list[int | None]:
        out: list[int | None] = [None] * mesh_ndims
        for t, m in enumerate(self.tensor_axis_to_mesh_axis):
            if m is not None:
                out[m] = t
        return out


def check_rules_strict(rules, dim_names: Iterable[str], mesh_shape, flag: str = "--layout") -> LayoutRules:
    """``rules`` as :class:`LayoutRules`, refusing rules that name no dimension of the model or no axis of the mesh.

    The library ignores such rules (Mesh TF's behaviour: a rule applies only where both names exist); a
    command line calls this so that a typo is not silently run fully replicated.

    Raises:
        LayoutError: naming ``flag`` and the rule, listing the model's dimensions and the mesh's axes.
    """
    rules = convert_to_layout_rules(rules)
    dims = sorted(set(dim_names))
    axes = [d.name for d in convert_to_shape(mesh_shape)]
    for d, a in rules.pairs:
        what = []
        if d not in dims:
            what.append(f"tensor dimension {d!r} is not a dimension of the model")
        if a not in axes:
            what.append(f"mesh axis {a!r} is not an axis of the mesh")
        if what:
            raise LayoutError(f"{flag}: rule '{d}:{a}': {' and '.join(what)}. The model's dimensions are "
                              f"{', '.join(dims)}; the mesh's axes are {', '.join(axes) or '(none: one processor)'}.")
    return rules


def convert_to_layout_rules(x) -> LayoutRules:
    return x if isinstance(x, LayoutRules) else LayoutRules(x)

"""Named dimensions and shapes.

A :class:`Dimension` is a ``(name, size)`` pair; a :class:`Shape` is an ordered tuple of
dimensions with distinct names. This follows Mesh TensorFlow's ``mtf.Dimension`` and
``mtf.Shape`` (Shazeer et al. 2018, section 3), with one difference: a shape holding two
dimensions of the same name is an error here, where Mesh TF silently allowed it.
"""

from __future__ import annotations

import re
from collections import namedtuple
from collections.abc import Iterable, Iterator

from meshtorch.core.errors import ShapeError

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
_SEPARATORS = re.compile(r"[;,\s]+")


class Dimension(namedtuple("Dimension", ["name", "size"])):
    """A named tensor dimension, e.g. ``Dimension("batch", 512)``.

    Args:
        name: identifier (letters, digits, ``_ . - /``; must not start with a digit).
        size: positive int.

    Raises:
        ShapeError: if the name is not an identifier or the size is not a positive int.
    """

    __slots__ = ()

    def __new__(cls, name: str, size: int):
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ShapeError(
                f"Dimension name {name!r} is not valid: use letters, digits, '_', '.', '-' or '/', "
                "starting with a letter or '_'."
            )
        if isinstance(size, bool) or not isinstance(size, int):
            try:
                if int(size) != size:
                    raise TypeError
                size = int(size)
            except (TypeError, ValueError):
                raise ShapeError(f"Dimension {name!r}: size {size!r} is not an integer.") from None
        if size < 1:
            raise ShapeError(f"Dimension {name!r}: size must be >= 1, got {size}.")
        return super().__new__(cls, name, size)

    def __repr__(self) -> str:
        return f"Dimension({self.name!r}, {self.size})"

    def __str__(self) -> str:
        return f"{self.name}:{self.size}"


def convert_to_dimension(d) -> Dimension:
    """Return ``d`` as a Dimension; accepts a Dimension, a ``(name, size)`` pair or ``"name:size"``."""
    if isinstance(d, Dimension):
        return d
    if isinstance(d, str):
        if ":" not in d:
            raise ShapeError(f"Cannot read dimension {d!r}: write it as 'name:size', e.g. 'batch:64'.")
        name, size = d.split(":", 1)
        try:
            return Dimension(name.strip(), int(size))
        except ValueError:
            raise ShapeError(f"Cannot read dimension {d!r}: size {size!r} is not an integer.") from None
    if isinstance(d, tuple | list) and len(d) == 2:
        return Dimension(d[0], d[1])
    raise ShapeError(f"Cannot convert {d!r} to a Dimension: give Dimension(name, size) or 'name:size'.")


class Shape:
    """An ordered tuple of :class:`Dimension` with distinct names.

    Build it from a list of dimensions or ``(name, size)`` pairs, or from a string
    ``"batch:100,hidden:1024"`` (separators ``,`` ``;`` or whitespace). ``Shape([])`` is
    the shape of a scalar.

    Raises:
        ShapeError: if two dimensions share a name, or an entry cannot be read.
    """

    __slots__ = ("_dims", "_names")

    def __init__(self, dims: Iterable | str | Shape = ()):
        if isinstance(dims, Shape):
            self._dims = dims._dims
            self._names = dims._names
            return
        if isinstance(dims, str):
            dims = [p for p in _SEPARATORS.split(dims.strip()) if p]
        dims = tuple(convert_to_dimension(d) for d in dims)
        names = tuple(d.name for d in dims)
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ShapeError(
                f"Shape {_fmt(dims)} has dimension name(s) {dup} more than once; "
                "rename one of them (mtf.rename_dimension) so each name appears once."
            )
        self._dims = dims
        self._names = names

    # --- sequence protocol ---
    @property
    def dims(self) -> list[Dimension]:
        """The dimensions as a new list (Mesh TF's type, so ``x.shape.dims[:-1] + [d]`` ports as is)."""
        return list(self._dims)

    @property
    def dimension_names(self) -> tuple[str, ...]:
        return self._names

    names = dimension_names

    @property
    def ndims(self) -> int:
        return len(self._dims)

    @property
    def size(self) -> int:
        """Number of elements (product of the sizes; 1 for a scalar)."""
        n = 1
        for d in self._dims:
            n *= d.size
        return n

    def to_integer_list(self) -> list[int]:
        return [d.size for d in self._dims]

    def __iter__(self) -> Iterator[Dimension]:
        return iter(self._dims)

    def __len__(self) -> int:
        return len(self._dims)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Shape(self._dims[i])
        return self._dims[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, Shape):
            return self._dims == other._dims
        if isinstance(other, list | tuple):
            try:
                return self._dims == Shape(other)._dims
            except ShapeError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._dims)

    def __contains__(self, d) -> bool:
        if isinstance(d, str):
            return d in self._names
        return d in self._dims

    def __add__(self, other) -> Shape:
        return Shape(self._dims + tuple(convert_to_shape(other)._dims))

    def __sub__(self, other) -> Shape:
        """Remove dimensions (given as dims, names, or a Shape)."""
        if isinstance(other, Dimension | str):
            other = [other]
        drop = {d if isinstance(d, str) else convert_to_dimension(d).name for d in other}
        return Shape([d for d in self._dims if d.name not in drop])

    def __repr__(self) -> str:
        return f"Shape[{', '.join(str(d) for d in self._dims)}]"

    def __str__(self) -> str:
        return _fmt(self._dims)

    # --- lookups ---
    def has_dim(self, d) -> bool:
        return (d if isinstance(d, str) else d.name) in self._names

    def get_dim_by_name(self, name: str) -> Dimension:
        try:
            return self._dims[self._names.index(name)]
        except ValueError:
            raise ShapeError(f"Shape {self} has no dimension named {name!r}.") from None

    def get_dim_index(self, d) -> int:
        name = d if isinstance(d, str) else d.name
        try:
            return self._names.index(name)
        except ValueError:
            raise ShapeError(f"Shape {self} has no dimension named {name!r}.") from None

    def rename_dimension(self, old: str, new: str) -> Shape:
        return Shape([Dimension(new, d.size) if d.name == old else d for d in self._dims])

    def resize_dimension(self, name: str, size: int) -> Shape:
        return Shape([Dimension(name, size) if d.name == name else d for d in self._dims])


def _fmt(dims) -> str:
    return "[" + ", ".join(f"{d.name}:{d.size}" for d in dims) + "]"


def convert_to_shape(x) -> Shape:
    """Return ``x`` as a Shape (accepts Shape, list of dimensions/pairs, or a shape string)."""
    if isinstance(x, Shape):
        return x
    if x is None:
        raise ShapeError("Expected a shape, got None.")
    if isinstance(x, Dimension):
        return Shape([x])
    return Shape(x)


def combine_shapes(shapes: Iterable[Shape], what: str) -> Shape:
    """Union of shapes, in first-seen order, for ops that combine tensors (broadcasting).

    Raises:
        ShapeError: if one dimension name appears with two sizes; ``what`` names the op.
    """
    seen: dict[str, Dimension] = {}
    for s in shapes:
        for d in s:
            prev = seen.get(d.name)
            if prev is None:
                seen[d.name] = d
            elif prev.size != d.size:
                raise ShapeError(
                    f"{what}: dimension {d.name!r} has size {prev.size} in one input and {d.size} in "
                    "another; a name must mean one size. Rename one (mtf.rename_dimension) or fix the size."
                )
    return Shape(list(seen.values()))

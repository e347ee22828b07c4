"""Helpers shared by the op families: aligning slices by dimension name."""

from __future__ import annotations

import functools

from meshtorch.core.dims import Shape
from meshtorch.ops._kernels import align_spec, aligned


def align_fn(src: Shape, dst: Shape):
    """A function mapping a slice laid out as ``src`` onto ``dst``'s dim order, size-1 for dims it lacks.

    The result broadcasts against a slice of ``dst``. Sizes are not needed, so the same function
    serves full tensors and slices. Returns None when no change is needed.
    """
    spec = align_spec(src, dst)
    return None if spec is None else functools.partial(aligned, spec=spec)


def dim_names(dims) -> list[str]:
    return [d if isinstance(d, str) else d.name for d in dims]

"""Helpers shared by the op families: aligning slices by dimension name."""

from __future__ import annotations

import functools

from meshtorch.core.dims import Shape


def align_fn(src: Shape, dst: Shape):
    """A function mapping a slice laid out as ``src`` onto ``dst``'s dim order, size-1 for dims it lacks.

    The result broadcasts against a slice of ``dst``. Sizes are not needed, so the same function
    serves full tensors and slices. Returns None when no change is needed.
    """
    names = src.dimension_names
    missing = [d.name for d in src if d.name not in dst]
    if missing:
        raise ValueError(f"align: dims {missing} of {src} are not in {dst}")
    perm = [names.index(d.name) for d in dst if d.name in names]
    index = tuple(slice(None) if d.name in names else None for d in dst)
    needs_perm = perm != list(range(len(perm)))
    needs_index = any(i is None for i in index)
    if not needs_perm and not needs_index:
        return None
    return functools.partial(align, perm=tuple(perm) if needs_perm else None, index=index if needs_index else None)


def align(t, *, perm, index):
    """Kernel of :func:`align_fn`: permute ``t``'s dims by ``perm``, then insert size-1 dims (``index``)."""
    if perm is not None:
        t = t.permute(perm)
    return t if index is None else t[index]


def apply_align(fn, t):
    return t if fn is None else fn(t)


def dim_names(dims) -> list[str]:
    return [d if isinstance(d, str) else d.name for d in dims]

"""Per-processor constant kernels shared by the op families.

The lowered program is data (see :mod:`meshtorch.lowering.program`): every local computation an op
emits is a *kernel*, a module-level function (or ``functools.partial`` of one with plain-data
arguments), never a closure. Kernels of the form ``fn(impl, pnum)`` build a value per processor
(its coordinate on a mesh axis, the offset of its slice, a filled block); ops emit them with
``lw.pnum_constant(t, functools.partial(kernel, ...))`` and the executor evaluates them when it
binds the program to a mesh implementation, so one program serves a placement mesh and torchrun
ranks alike.
"""

from __future__ import annotations

import torch


def processor_coordinate(impl, pnum: int, mesh_axis: int) -> int:
    """Processor ``pnum``'s coordinate on ``mesh_axis`` (a Python int)."""
    return impl.pnum_to_processor_coordinates(pnum)[mesh_axis]


def slice_begin(impl, pnum: int, sizes, layout, dim: int | None = None):
    """Global index of the first element of ``pnum``'s slice of a tensor of ``sizes`` laid out as
    ``layout`` (mesh axis per dim, or None): a list per dim, or the one int of ``dim``."""
    coords = impl.pnum_to_processor_coordinates(pnum)
    begins = [0 if a is None else coords[a] * (s // impl.shape[a].size) for s, a in zip(sizes, layout, strict=True)]
    return begins if dim is None else begins[dim]


def filled(impl, pnum: int, sizes, value, dtype: torch.dtype) -> torch.Tensor:
    """A slice of ``sizes`` filled with ``value`` on ``pnum``'s device."""
    return torch.full(list(sizes), value, dtype=dtype, device=impl.device(pnum))


def value_of(impl, pnum: int, values):
    """``values[pnum]``: a per-processor table computed at plan time (plain data)."""
    return values[pnum]


def tensor_of(impl, pnum: int, values, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values[pnum])`` on ``pnum``'s device."""
    return torch.tensor(values[pnum], dtype=dtype, device=impl.device(pnum))


# ----- slicewise kernels shared by the op families: fn(*slices, **params) -----

def align_spec(src, dst):
    """Plan time: how a slice laid out as Shape ``src`` maps onto Shape ``dst``'s dim order.

    Plain data for :func:`aligned`: ``(perm, new_axes)`` (``perm``: tuple of source dims in ``dst``
    order, or None; ``new_axes``: tuple of bools, True where ``dst`` has a dim ``src`` lacks,
    inserted with size 1, or None), or None when no change is needed. The same transformation as
    :func:`meshtorch.ops._util.align_fn`; sizes are not needed, so it serves slices of any layout.

    Raises:
        ValueError: if ``src`` has a dim that ``dst`` lacks.
    """
    names = src.dimension_names
    missing = [d.name for d in src if d.name not in dst]
    if missing:
        raise ValueError(f"align: dims {missing} of {src} are not in {dst}")
    perm = tuple(names.index(d.name) for d in dst if d.name in names)
    new_axes = tuple(d.name not in names for d in dst)
    needs_perm = perm != tuple(range(len(perm)))
    needs_index = any(new_axes)
    if not needs_perm and not needs_index:
        return None
    return (perm if needs_perm else None, new_axes if needs_index else None)


def aligned(t: torch.Tensor, spec) -> torch.Tensor:
    """``t`` permuted and given size-1 axes as ``spec`` (from :func:`align_spec`) says."""
    if spec is None:
        return t
    perm, new_axes = spec
    if perm is not None:
        t = t.permute(list(perm))
    if new_axes is not None:
        t = t[tuple(None if n else slice(None) for n in new_axes)]
    return t


def apply_aligned(*xs: torch.Tensor, fn, aligns):
    """``fn(*xs)`` after aligning each ``xs[i]`` by ``aligns[i]`` (an :func:`align_spec` or None)."""
    return fn(*[aligned(x, a) for a, x in zip(aligns, xs, strict=True)])


def narrow(t: torch.Tensor, *, dim: int, start: int, length: int) -> torch.Tensor:
    """``t.narrow(dim, start, length)``."""
    return t.narrow(dim, start, length)


def cat(*ts: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cat(ts, dim=dim)``."""
    return torch.cat(ts, dim=dim)

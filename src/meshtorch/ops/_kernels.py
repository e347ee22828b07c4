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


def align_spec(src, dst):
    """Plan-time, plain-data form of :func:`meshtorch.ops._util.align_fn` (``src``, ``dst``: Shapes).

    ``None`` when a slice laid out as ``src`` already broadcasts against ``dst``; otherwise
    ``(perm, keep)``: the permutation into ``dst``'s dim order (None if none is needed) and, per dim
    of ``dst``, whether ``src`` has it (None if it has them all). Apply it with :func:`aligned`.
    """
    names = src.dimension_names
    missing = [d.name for d in src if d.name not in dst]
    if missing:
        raise ValueError(f"align: dims {missing} of {src} are not in {dst}")
    perm = tuple(names.index(d.name) for d in dst if d.name in names)
    keep = tuple(d.name in names for d in dst)
    perm = None if perm == tuple(range(len(perm))) else perm
    keep = None if all(keep) else keep
    return None if perm is None and keep is None else (perm, keep)


def aligned(t: torch.Tensor, spec) -> torch.Tensor:
    """``t`` moved to the dim order of an :func:`align_spec` (size-1 dims for those it lacks)."""
    if spec is None:
        return t
    perm, keep = spec
    if perm is not None:
        t = t.permute(perm)
    if keep is not None:
        t = t[tuple(slice(None) if k else None for k in keep)]
    return t

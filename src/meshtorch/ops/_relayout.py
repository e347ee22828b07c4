"""Moving one laid-out value between layouts of the same shape, and whole-dimension helpers.

Used by reshape (before and after the local reshape) and by the ops that need one dimension
whole on every processor (slice, pad, concat, split, unstack). Everything goes through the
Lowering (``lw.allconcat``, ``lw.alltoall``, ``lw.slicewise`` with ``lw.laid_out_constant``
processor coordinates), so it works on every MeshImpl.

A *layout* here is a tuple with one entry per tensor dimension: the index of the mesh axis that
splits it, or None (as :class:`~meshtorch.core.layout.TensorLayout`). Mesh axes of size 1 are
ignored: splitting over them moves no data.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.graph import Tensor
from meshtorch.ops._kernels import processor_coordinate


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def coordinate_constant(lw, t: Tensor, mesh_axis: int) -> int:
    """A slot holding each processor's coordinate (a Python int) on ``mesh_axis``."""
    return lw.pnum_constant(t, functools.partial(processor_coordinate, mesh_axis=mesh_axis))


def relayout(lw, slot: int, t: Tensor, shape, src, dst) -> int:
    """Move ``slot`` (``t``'s value laid out as ``src``: mesh axis per dim) to layout ``dst``.

    See :func:`meshtorch.lowering.layout.redistribute` (all-gather, all-to-all, local slice);
    ``shape`` must be ``t``'s shape.
    """
    assert list(shape) == list(t.shape), (shape, t.shape)
    return lw.redistribute(slot, t, tuple(src), tuple(dst))


def gather_dim(lw, t: Tensor, slot: int, dim_name: str) -> int:
    """``t``'s slot with dimension ``dim_name`` whole on every processor (all-gather if it is split)."""
    i = t.shape.get_dim_index(dim_name)
    src = tuple(lw.tensor_layout(t))
    dst = tuple(None if k == i else a for k, a in enumerate(src))
    return relayout(lw, slot, t, t.shape, src, dst)


def scatter_dim(lw, out: Tensor, slot: int, dim_name: str) -> int:
    """From a value of ``out`` with ``dim_name`` whole, keep each processor's piece (local; no communication)."""
    i = out.shape.get_dim_index(dim_name)
    dst = tuple(lw.tensor_layout(out))
    src = tuple(None if k == i else a for k, a in enumerate(dst))
    return relayout(lw, slot, out, out.shape, src, dst)

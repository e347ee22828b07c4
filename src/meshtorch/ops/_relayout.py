"""Whole-dimension helpers for the ops that need one dimension whole on every processor (slice,
pad, concat, split, unstack), and processor coordinates as a per-processor constant.

The layout changes go through the planner's one redistribution (``lw.redistribute``, see
:func:`meshtorch.lowering.layout.plan_redistribute`), so they work on every MeshImpl.
"""

from __future__ import annotations

import functools

from meshtorch.core.graph import Tensor
from meshtorch.ops._kernels import processor_coordinate


def coordinate_constant(lw, t: Tensor, mesh_axis: int) -> int:
    """A slot holding each processor's coordinate (a Python int) on ``mesh_axis``."""
    return lw.pnum_constant(t, functools.partial(processor_coordinate, mesh_axis=mesh_axis))


def gather_dim(lw, t: Tensor, slot: int, dim_name: str) -> int:
    """``t``'s slot with dimension ``dim_name`` whole on every processor (all-gather if it is split)."""
    i = t.shape.get_dim_index(dim_name)
    src = tuple(lw.tensor_layout(t))
    dst = tuple(None if k == i else a for k, a in enumerate(src))
    return lw.redistribute(slot, t, src, dst)


def scatter_dim(lw, out: Tensor, slot: int, dim_name: str) -> int:
    """From a value of ``out`` with ``dim_name`` whole, keep each processor's piece (local; no communication)."""
    i = out.shape.get_dim_index(dim_name)
    dst = tuple(lw.tensor_layout(out))
    src = tuple(None if k == i else a for k, a in enumerate(dst))
    return lw.redistribute(slot, out, src, dst)

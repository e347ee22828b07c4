"""Shifts built from other ops, with Mesh TF's names: dynamic_shift and left_halo_exchange.

Both follow mesh_tensorflow/ops.py step for step: ``dynamic_shift`` is an einsum with a one-hot
permutation (a split ``dim`` costs what that einsum costs: the contraction over the renamed copy
of ``dim`` is a partial sum, one all-reduce); ``left_halo_exchange`` concatenates ``shift``-ed
copies and a slice (what ``shift`` over a split ``blocks_dim`` communicates: one neighbour send).
"""

from __future__ import annotations

from meshtorch.core.dims import Dimension, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import equal, mod
from meshtorch.ops.einsum import einsum
from meshtorch.ops.reshape import replace_dimensions
from meshtorch.ops.sequence import mtf_range, shift
from meshtorch.ops.shape import concat
from meshtorch.ops.shape import slice as mtf_slice

__all__ = ["dynamic_shift", "left_halo_exchange"]


def _dim_of(x: Tensor, dim, what: str) -> Dimension:
    """``dim`` (a Dimension, or a name looked up in x) as x's Dimension; ShapeError if x lacks it."""
    name = dim if isinstance(dim, str) and ":" not in dim else convert_to_dimension(dim).name
    for d in x.shape:
        if d.name == name:
            if not isinstance(dim, str) and convert_to_dimension(dim) != d:
                break
            return d
    raise ShapeError(f"{what}: dim {dim} is not a dimension of {x.name!r} {x.shape}.")


def dynamic_shift(x: Tensor, offset: Tensor, dim, wrap: bool) -> Tensor:
    """Shift ``x`` by a per-position Tensor ``offset`` along ``dim`` (Mesh TF ``mtf.dynamic_shift``).

    ``out[..., i, ...] = x[..., i - offset[...], ...]``: zeros shifted in (``wrap=False``) or wrapped
    around (``wrap=True``).

    Args:
        x: Tensor with ``dim``. offset: integer Tensor whose dims are a subset of ``x``'s, without ``dim``.
        dim: a Dimension (or name) of x. wrap: bool.

    Returns:
        Tensor of x's shape and dtype; gradient flows to ``x``.

    Raises:
        ShapeError: ``dim`` not in x, ``dim`` in offset, or offset has a dim x lacks.
    """
    dim = _dim_of(x, dim, "dynamic_shift")
    if dim.name in offset.shape:
        raise ShapeError(f"dynamic_shift: offset {offset.name!r} {offset.shape} may not have dim {dim.name!r}.")
    for d in offset.shape:
        if d not in x.shape.dims:
            raise ShapeError(f"dynamic_shift: offset.shape {offset.shape} must be a subset of x.shape {x.shape}.")
    tmp = Dimension("dynamic_shift_tmp", dim.size)
    x_tmp = replace_dimensions(x, dim, tmp)
    target = mtf_range(x.mesh, tmp, dtype=offset.dtype) + offset
    if wrap:
        target = mod(target, dim.size)
    perm = ew.cast(equal(mtf_range(x.mesh, dim, dtype=offset.dtype), target), x.dtype)
    return einsum([x_tmp, perm], output_shape=x.shape)


def left_halo_exchange(x: Tensor, blocks_dim, block_size_dim, halo_size: int, wrap=False) -> Tensor:
    """Prepend to each block the last ``halo_size`` rows of the blocks to its left (Mesh TF
    ``mtf.left_halo_exchange``).

    Args:
        x: Tensor with ``blocks_dim`` and ``block_size_dim`` (Dimensions of x, or their names).
        halo_size: rows taken from the left (may exceed a block). wrap: whether the first block's halo
            comes from the last block (else zeros).

    Returns:
        x's shape with ``block_size_dim`` longer by ``halo_size`` (same name).
    """
    if halo_size == 0:
        return x
    blocks_dim = _dim_of(x, blocks_dim, "left_halo_exchange")
    block_size_dim = _dim_of(x, block_size_dim, "left_halo_exchange")
    block_size = block_size_dim.size
    partial, complete = halo_size % block_size, halo_size // block_size
    parts = [x]
    for i in range(1, complete + 1):
        parts = [shift(x, i, blocks_dim, wrap)] + parts
    if partial > 0:
        margin = mtf_slice(x, block_size - partial, partial, block_size_dim.name)
        parts = [shift(margin, complete + 1, blocks_dim, wrap)] + parts
    return concat(parts, block_size_dim.name)



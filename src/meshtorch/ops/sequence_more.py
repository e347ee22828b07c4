"""Shifts built from other ops, with Mesh TF's names: dynamic_shift and left_halo_exchange.

Both follow mesh_tensorflow/ops.py step for step: ``dynamic_shift`` is an einsum with a one-hot
permutation (a split ``dim`` costs what that einsum costs: the contraction over the renamed copy
of ``dim`` is a partial sum, one all-reduce); ``left_halo_exchange`` concatenates ``shift``-ed
copies and a slice (what ``shift`` over a split ``blocks_dim`` communicates: one neighbour send).

``permute_blocks`` (JAX's ``lax.ppermute`` in the global view) is an operation of its own: with as many
blocks as processors on the mesh axis splitting ``dim``, one ``collective_permute`` (a ``broadcast`` when
every block takes the same source block); with another number of blocks, the dim is gathered and the
blocks move locally.
"""

from __future__ import annotations

import builtins
import functools

import torch

from meshtorch.core.dims import Dimension, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import add, equal, mod
from meshtorch.ops.einsum import einsum
from meshtorch.ops.reshape import replace_dimensions
from meshtorch.ops.sequence import _dim_index, mtf_range, shift
from meshtorch.ops.shape import concat
from meshtorch.ops.shape import slice as mtf_slice

__all__ = ["dynamic_shift", "left_halo_exchange", "permute_blocks", "PermuteBlocksOperation"]


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


def _k_permute_blocks(t: torch.Tensor, *, axis: int, source: tuple) -> torch.Tensor:
    """Block ``c`` of ``t`` along ``axis`` (``len(source)`` equal blocks) replaced by block ``source[c]``
    (None: zeros)."""
    blocks = t.chunk(len(source), dim=axis)
    return torch.cat([torch.zeros_like(blocks[0]) if s is None else blocks[s] for s in source], dim=axis)


class PermuteBlocksOperation(Operation):
    """Block ``c`` of the output along ``dim`` is block ``source[c]`` of ``x`` (None: zeros)."""

    partial_sums = "first"  # linear: a partial sum stays partial

    def __init__(self, x: Tensor, dim, source, name=None):
        super().__init__([x], name=name or "permute_blocks")
        what = f"permute_blocks {self.name!r}"
        self.dim_name, self.axis = _dim_index(x, dim, what)
        source = tuple(source)
        n, size = len(source), x.shape[self.axis].size
        if n == 0 or size % n:
            raise ShapeError(f"{what}: source names {n} blocks; dimension {x.shape[self.axis]} of {x.name!r} "
                             "must split into that many equal blocks.")
        for s in source:
            if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n):
                raise ValueError(f"{what}: source entries must be None or block numbers in [0, {n}), got {s!r}.")
        self.source = source
        self.outputs = [Tensor(self, x.shape, x.dtype)]

    def lower(self, lw):
        x, out = self.inputs[0], self.outputs[0]
        ax, src, n = self.axis, self.source, len(self.source)
        a = lw.tensor_layout(x)[ax]
        if n > 1 and a is not None and lw.mesh_spec(self).shape[a].size == n:  # a block per processor
            (slot,), pending = lw.inputs(self)
            local = list(lw.slice_shape(x))
            if src == tuple(builtins.range(n)):
                res = slot
            elif all(s is None for s in src):
                res = lw.slicewise(torch.zeros_like, slot)
            elif len(set(src)) == 1:
                res = lw.broadcast(slot, a, src[0], x, local_shape=local)
            else:
                res = lw.collective_permute(slot, a, src, x, local_shape=local)
            lw.set(out, res, pending)
            return
        whole = list(lw.tensor_layout(x))
        whole[ax] = None
        slot = lw.slicewise(functools.partial(_k_permute_blocks, axis=ax, source=src), lw.get(x, whole))
        lw.set(out, lw.redistribute(slot, out, whole, tuple(lw.tensor_layout(out))))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        # block s of dx is the sum of the blocks c of dy with source[c] == s: round j sends each source
        # block its j-th target's cotangent (a partial permutation, so each round is one collective-permute)
        n = len(self.source)
        targets: dict[int, list[int]] = {}
        for c, s in enumerate(self.source):
            if s is not None:
                targets.setdefault(s, []).append(c)
        rounds = max((len(v) for v in targets.values()), default=1)
        dx = None
        for j in builtins.range(rounds):
            back = [targets[s][j] if j < len(targets.get(s, ())) else None for s in builtins.range(n)]
            part = permute_blocks(dy, self.dim_name, back, name=f"{self.name}_grad{j}")
            dx = part if dx is None else add(dx, part)
        return [dx]


def permute_blocks(x: Tensor, dim, source, name=None) -> Tensor:
    """Permute the blocks of ``dim``: output block ``c`` is block ``source[c]`` of ``x``, zeros where
    ``source[c]`` is None (``dim`` cut into ``len(source)`` equal blocks).

    The global view of JAX's ``lax.ppermute`` / XLA's CollectivePermute: with ``dim`` split over a mesh axis
    of ``len(source)`` processors, processor ``c`` receives the slice of processor ``source[c]``; JAX's
    ``perm=[(src, dst), ...]`` is ``source[dst] = src``. Unlike ``ppermute``, a block may feed several
    targets; when every block takes the same one the lowering is one ``broadcast`` from it. Any layout
    works: with ``dim`` whole (or split into another number of pieces) the blocks move locally
    (after an all-gather).

    Args:
        x: a Tensor with dimension ``dim``.
        dim: Dimension or name of ``x``.
        source: sequence of ``n`` entries, each None or a block number in ``[0, n)``; ``dim``'s size
            must be a multiple of ``n``.

    Returns:
        Tensor of ``x.shape`` and dtype. Gradient: block ``s`` of ``dx`` sums the blocks of ``dy`` whose
        source is ``s`` (one collective-permute per target of the most used block).

    Raises:
        ShapeError: ``x`` lacks ``dim``, or its size is not a multiple of ``len(source)``;
        ValueError: a source entry that is not None or a block number.
    """
    return PermuteBlocksOperation(x, dim, source, name).outputs[0]

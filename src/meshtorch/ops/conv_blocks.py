"""Spatially partitioned convolution: images as block dims, halo exchange between neighbouring blocks.

Mesh TF ``mtf.conv2d_with_blocks`` / ``conv3d_with_blocks`` / ``halo_exchange``: an image
``[batch, H, W, c]`` is stored as ``[batch, h_blocks, w_blocks, h, w, c]`` (``H = h_blocks * h``).
The *block* dims may be split over mesh axes (spatial partitioning); the dims *within* a block are
never split. A SAME convolution with a ``k``-wide window needs ``k // 2`` rows (columns) of each
neighbouring block, the *halo*:

* :class:`HaloExchangeOperation` widens each block from ``h`` to ``h + 2 * halo`` rows. On each
  processor the local blocks are laid end to end (a "strip" of ``local_blocks * h`` rows); the rows
  before and after the strip come from the neighbouring processors along the mesh axis that splits
  the block dim, with ``lw.collective_permute`` (a neighbour shift, only the boundary rows travel); past the
  image border they are zeros (SAME padding). A halo wider than a processor's strip takes several
  hops (from processors 1, 2, ... away). Neighbouring blocks on the same processor take their halo
  from the strip by slicing: no communication. Without a block dim the op is plain zero padding.
* the convolution then runs VALID inside each widened block (block dims are batch-like to it);
* the gradient of the exchange is :class:`HaloReduceOperation`, its transpose: the halo parts of
  the gradient are shifted back to the processors (and blocks) they came from and added there.

Doing the ``h`` exchange first and the ``w`` exchange on its output brings the corner values too
(two hops), as in Mesh TF. Differences from Mesh TF: the exchange is one op per dim (Mesh TF
builds it from ``shift``, ``slice`` and ``concat``), any spatial dim may have a block dim
(Mesh TF's ``conv3d_with_blocks`` blocks only depth and height), and with strides the windows are
centred (padding ``k // 2`` on both sides, PyTorch ``padding=k // 2``): for stride 1 this is TF's
SAME; a strided block convolution needs the block size divisible by the stride.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.dims import Dimension, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops.conv import ConvOperation, _filter_parts, _normalize_strides, _spatial

__all__ = ["HaloExchangeOperation", "HaloReduceOperation", "halo_exchange", "conv_with_blocks",
           "conv1d_with_blocks", "conv2d_with_blocks", "conv3d_with_blocks"]


def _dim_of(x: Tensor, d, what) -> Dimension | None:
    if d is None:
        return None
    name = d if isinstance(d, str) else convert_to_dimension(d).name
    if name not in x.shape:
        raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {name!r}.")
    return x.shape.get_dim_by_name(name)


def _strip_axes(x: Tensor, blocks: str | None, size: str) -> dict:
    """Kernel parameters locating the blocks and size dims in ``x``'s slices (``ib`` None: no blocks dim)."""
    names = x.shape.dimension_names
    return {"ib": None if blocks is None else names.index(blocks), "is_": names.index(size)}


def _to_strip(t: torch.Tensor, ib, is_) -> torch.Tensor:
    """``[.., blocks, .., size, ..]`` -> strip ``[blocks*size, rest..]``."""
    if ib is None:
        return t.movedim(is_, 0)
    t = t.movedim((ib, is_), (0, 1))
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _from_blocks(t: torch.Tensor, ib, is_) -> torch.Tensor:
    """``[nb, size, rest..]`` -> the tensor's dim order."""
    if ib is None:
        return t[0].movedim(0, is_)
    return t.movedim((0, 1), (ib, is_))


def _k_to_strip(t, *, ib, is_):
    return _to_strip(t, ib, is_)


def _k_rows(t, *, start, stop):
    """Rows ``[start, stop)`` of a strip (negative bounds count from the end, as ``len - k``)."""
    n = t.shape[0]
    return t[start if start >= 0 else n + start:stop if stop > 0 else n + stop]


def _hops(lw, x: Tensor, blocks: Dimension | None, size: Dimension, halo: int):
    """(mesh axis or None, number of processors on it, local strip rows, [rows per hop])."""
    axis = None
    if blocks is not None:
        axes = lw.tensor_mesh_axes(x, [blocks.name])
        axis = axes[0] if axes else None
    if axis is None:
        return None, 1, 0, []
    n = lw.mesh_spec(x).shape[axis].size
    local = blocks.size // n * size.size
    hops, left = [], halo
    while left > 0 and len(hops) < n - 1:
        hops.append(min(left, local))
        left -= local
    return axis, n, local, hops


def _row_shape(lw, x: Tensor, blocks: Dimension, size: Dimension, rows: int) -> list[int]:
    """Local shape of ``rows`` strip rows of x's slice (a row spans every dim but the blocks and size dims)."""
    sl = lw.slice_shape(x)
    skip = {x.shape.get_dim_index(size.name), x.shape.get_dim_index(blocks.name)}
    return [rows] + [n for i, n in enumerate(sl) if i not in skip]


def _k_assemble(s, *parts, nhops, zl, h, b, ib, is_):
    """Strip plus received halos -> widened blocks ``[.., blocks, .., size + 2h, ..]``."""
    ls, rs = parts[:nhops], parts[nhops:]
    pieces = list(reversed(ls)) + [s] + list(rs)
    if zl:
        z = s.new_zeros((zl, *s.shape[1:]))
        pieces = [z] + pieces + [z]
    ext = torch.cat(pieces, 0) if len(pieces) > 1 else s
    win = ext.unfold(0, b + 2 * h, b)  # [nb, rest.., b + 2h]
    return _from_blocks(win.movedim(-1, 1), ib, is_)


def _k_overlap_add(t, *, h, b, ib, is_):
    """Widened blocks -> strip of ``nb * b + 2h`` rows: each block's rows added where they came from."""
    w = b + 2 * h
    if h <= b:  # fast path: a halo only reaches the adjacent block
        blk = t.movedim((ib, is_), (0, 1)) if ib is not None else t.movedim(is_, 0)[None]
        nb = blk.shape[0]
        core = blk[:, h:h + b].clone()
        if nb > 1:
            core[:-1, b - h:] += blk[1:, :h]  # left halo of block j+1 = tail of block j
            core[1:, :h] += blk[:-1, h + b:]  # right halo of block j-1 = head of block j
        core = core.reshape(nb * b, *core.shape[2:])
        return torch.cat([blk[0, :h], core, blk[nb - 1, h + b:]], 0)
    s = _to_strip(t, ib, is_)  # [nb * w, rest..] (blocks of w rows)
    nb = s.shape[0] // w
    idx = (torch.arange(nb, device=s.device).unsqueeze(1) * b + torch.arange(w, device=s.device)).reshape(-1)
    ext = s.new_zeros((nb * b + 2 * h, *s.shape[1:]))
    return ext.index_add_(0, idx, s)


def _k_finish(e, *parts, hops, h, b, ib, is_):
    """Overlap-added strip plus halos sent back by neighbours -> blocks of the narrow size."""
    core = e[h:e.shape[0] - h]
    if parts:
        core = core.clone()
        for i, r in enumerate(hops):
            from_right, from_left = parts[2 * i], parts[2 * i + 1]
            core[core.shape[0] - r:] += from_right
            core[:r] += from_left
    blocks = core.reshape(core.shape[0] // b, b, *core.shape[1:])
    return _from_blocks(blocks, ib, is_)


class HaloExchangeOperation(Operation):
    """Widen each block of ``x`` along ``size_dim`` by ``halo`` rows from its neighbours (zeros at the border).

    ``x [.., blocks_dim, .., size_dim:h, ..]`` -> ``[.., blocks_dim, .., size_dim:h + 2 * halo, ..]``.
    ``blocks_dim=None``: the image is one block along ``size_dim`` (zero padding). ``size_dim`` is
    unsplittable; ``blocks_dim`` may be split (halo via ``lw.collective_permute`` from neighbouring processors).
    """

    def __init__(self, x: Tensor, blocks_dim, size_dim, halo: int, name=None):
        super().__init__([x], name=name or "halo_exchange")
        what = f"halo_exchange {self.name!r}"
        self.blocks = _dim_of(x, blocks_dim, what)
        self.size = _dim_of(x, size_dim, what)
        if self.size is None:
            raise ShapeError(f"{what}: block_size_dim must be given.")
        if self.blocks is not None and self.blocks.name == self.size.name:
            raise ShapeError(f"{what}: blocks dim and block-size dim must differ (both {self.size.name!r}).")
        if int(halo) != halo or halo < 0:
            raise ValueError(f"{what}: halo_size must be a non-negative int, got {halo!r}.")
        self.halo = int(halo)
        self.unsplittable_dims = (self.size.name,)
        self.outputs = [Tensor(self, x.shape.resize_dimension(self.size.name, self.size.size + 2 * self.halo),
                               x.dtype)]

    def lower(self, lw):
        x, out = self.inputs[0], self.outputs[0]
        sa = _strip_axes(x, None if self.blocks is None else self.blocks.name, self.size.name)
        axis, n, local, hops = _hops(lw, x, self.blocks, self.size, self.halo)
        strip = lw.slicewise(functools.partial(_k_to_strip, **sa), lw.get(x))
        lefts, rights = [], []
        for i, r in enumerate(hops, start=1):
            rows = _row_shape(lw, x, self.blocks, self.size, r)
            tail = lw.slicewise(functools.partial(_k_rows, start=-r, stop=0), strip)
            head = lw.slicewise(functools.partial(_k_rows, start=0, stop=r), strip)
            # left halo of coordinate c: the tail of c - i; right halo: the head of c + i (None: zeros)
            lefts.append(lw.collective_permute(tail, axis, [c - i if c - i >= 0 else None for c in range(n)], x, rows))
            rights.append(lw.collective_permute(head, axis, [c + i if c + i < n else None for c in range(n)], x, rows))
        f = functools.partial(_k_assemble, nhops=len(hops), zl=self.halo - sum(hops), h=self.halo, b=self.size.size,
                              **sa)
        lw.set(out, lw.slicewise(f, strip, *lefts, *rights))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        return [HaloReduceOperation(dy, self.blocks, self.size, self.halo, name=f"{self.name}_grad").outputs[0]]


class HaloReduceOperation(Operation):
    """Transpose of :class:`HaloExchangeOperation`: add each widened block's halo back where it came from.

    ``g [.., blocks_dim, .., size_dim:h + 2 * halo, ..]`` -> ``[.., blocks_dim, .., size_dim:h, ..]``
    (``size_dim`` is given with its narrow size ``h``). Halo rows from other processors are sent back
    with ``lw.collective_permute``; rows past the image border are dropped.
    """

    def __init__(self, g: Tensor, blocks_dim, size_dim, halo: int, name=None):
        super().__init__([g], name=name or "halo_reduce")
        what = f"halo_reduce {self.name!r}"
        self.blocks = _dim_of(g, blocks_dim, what)
        self.size = convert_to_dimension(size_dim)
        self.halo = int(halo)
        have = _dim_of(g, self.size.name, what)
        if have.size != self.size.size + 2 * self.halo:
            raise ShapeError(f"{what}: {g.name!r} dim {have} should be {self.size.name}:"
                             f"{self.size.size + 2 * self.halo} (block {self.size.size} + 2 x halo {self.halo}).")
        self.unsplittable_dims = (self.size.name,)
        self.outputs = [Tensor(self, g.shape.resize_dimension(self.size.name, self.size.size), g.dtype)]

    def lower(self, lw):
        g, out = self.inputs[0], self.outputs[0]
        sa = _strip_axes(g, None if self.blocks is None else self.blocks.name, self.size.name)
        axis, n, local, hops = _hops(lw, g, self.blocks, self.size, self.halo)
        h, b = self.halo, self.size.size
        ext = lw.slicewise(functools.partial(_k_overlap_add, h=h, b=b, **sa), lw.get(g))
        incoming = []
        offs = [h - sum(hops[:i]) for i in range(len(hops) + 1)]  # left hop i occupies rows [offs[i], offs[i-1])
        for i, r in enumerate(hops, start=1):
            rows = _row_shape(lw, out, self.blocks, self.size, r)
            lo = offs[i]
            left_part = lw.slicewise(functools.partial(_k_rows, start=lo, stop=lo + r), ext)
            right_part = lw.slicewise(functools.partial(_k_rows, start=-lo - r, stop=-lo), ext)
            # my left part belongs to coordinate c - i (its last r rows): so c receives from c + i
            from_right = [c + i if c + i < n else None for c in range(n)]
            from_left = [c - i if c - i >= 0 else None for c in range(n)]
            incoming.append(lw.collective_permute(left_part, axis, from_right, out, rows))
            incoming.append(lw.collective_permute(right_part, axis, from_left, out, rows))
        f = functools.partial(_k_finish, hops=tuple(hops), h=h, b=b, **sa)
        lw.set(out, lw.slicewise(f, ext, *incoming))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        return [HaloExchangeOperation(dy, self.blocks, self.size.name, self.halo, name=f"{self.name}_grad").outputs[0]]


def halo_exchange(x: Tensor, blocks_dim, block_size_dim, halo_size: int, wrap: bool = False, name=None) -> Tensor:
    """Mesh TF ``mtf.halo_exchange``: each block along ``blocks_dim`` gets ``halo_size`` rows of its neighbours.

    Args:
        x: Tensor with ``blocks_dim`` (may be split over a mesh axis, or None: zero padding) and
            ``block_size_dim`` (the rows of one block; unsplittable).
        halo_size: rows taken from each side (may exceed a block or a processor's share).
        wrap: not supported (raises ValueError): the border halo is zeros (SAME padding).

    Returns:
        x's shape with ``block_size_dim`` of size ``block + 2 * halo_size`` (same name).

    Raises:
        ShapeError: a dim is missing; ValueError: bad halo or ``wrap=True``.
    """
    if wrap:
        raise ValueError("halo_exchange: wrap=True is not supported; the halo past the border is zeros.")
    if halo_size == 0:
        return x
    return HaloExchangeOperation(x, blocks_dim, block_size_dim, halo_size, name).outputs[0]


def conv_with_blocks(conv_input: Tensor, conv_filter: Tensor, strides=1, padding="SAME", blocks_dims=None,
                     spatial_dims=None, name=None) -> Tensor:
    """SAME n-d convolution of a blocked image; see :func:`conv2d_with_blocks`.

    ``blocks_dims``: one entry per spatial dim (a block dim of ``conv_input`` or None).
    """
    what = f"conv_with_blocks {name or ''}".strip()
    n, kdims, in_dim, _ = _filter_parts(conv_filter, what)
    if not isinstance(padding, str) or padding.upper() != "SAME":
        raise ValueError(f"{what}: only padding='SAME' is supported for blocked convolutions (got {padding!r}); "
                         "for VALID use conv2d on the unblocked image.")
    blocks_dims = [None] * n if blocks_dims is None else list(blocks_dims)
    if len(blocks_dims) != n:
        raise ValueError(f"{what}: need {n} block dims (or None), got {blocks_dims}.")
    blocks = [_dim_of(conv_input, d, what) for d in blocks_dims]
    names = [d.name for d in blocks if d is not None]
    spatial = _spatial(conv_input, n, spatial_dims, [in_dim.name, *names], what)
    st = _normalize_strides(strides, n, what)
    x = conv_input
    for i, s in enumerate(spatial):
        k = kdims[i].size
        if k % 2 != 1:
            raise ValueError(f"{what}: filter window {kdims[i]} must be odd for a SAME blocked convolution.")
        size = conv_input.shape.get_dim_by_name(s)
        if size.size % st[i]:
            raise ValueError(f"{what}: block size {size} is not divisible by the stride {st[i]}.")
        if blocks[i] is not None and blocks[i].name == s:
            raise ShapeError(f"{what}: {s!r} cannot be both a block dim and a spatial dim.")
        if k // 2:
            x = HaloExchangeOperation(x, blocks[i], s, k // 2, name=f"{name or 'conv'}_halo_{s}").outputs[0]
    return ConvOperation(x, conv_filter, st, "VALID", spatial, name=name or "conv_with_blocks").outputs[0]


def conv1d_with_blocks(conv_input, conv_filter, strides=1, padding="SAME", blocks_dim=None, spatial_dims=None,
                       name=None) -> Tensor:
    """1-d :func:`conv_with_blocks`: ``[batch, blocks, w, c]`` with filter ``[k, in, out]``."""
    return conv_with_blocks(conv_input, conv_filter, strides, padding, [blocks_dim], spatial_dims, name)


def conv2d_with_blocks(conv_input: Tensor, conv_filter: Tensor, strides=(1, 1), padding="SAME", h_blocks_dim=None,
                       w_blocks_dim=None, spatial_dims=None, name=None) -> Tensor:
    """2-d convolution with spatial partitioning (Mesh TF ``mtf.conv2d_with_blocks``).

    Args:
        conv_input: ``[batch.., h_blocks, w_blocks, h, w, in]`` (any order): block ``(i, j)`` holds rows
            ``i*h .. i*h+h-1`` and columns ``j*w .. j*w+w-1`` of the image.
        conv_filter: ``[fh, fw, in, out]``, odd ``fh`` and ``fw``.
        strides: int or pair (block sizes must divide by them); padding: only ``"SAME"``.
        h_blocks_dim, w_blocks_dim: the block dims (or None: that spatial dim is one block). They may
            be split over mesh axes: each block gets a halo of ``fh // 2`` rows / ``fw // 2`` columns
            from its neighbours (same processor: slicing; other processors: ``lw.collective_permute``).
        spatial_dims: names of ``(h, w)``; default the last two dims other than ``in`` and the block dims.

    Returns:
        ``[batch.., h_blocks, w_blocks, h / sh, w / sw, out]``: equal to a SAME convolution of the
        unblocked image, re-blocked.

    Raises:
        ValueError: padding not SAME, even window, stride not dividing the block size.
        ShapeError: as :func:`meshtorch.conv2d`, or a block dim missing from ``conv_input``.
        LayoutError (at lowering): a layout splits ``h``, ``w`` (within-block dims) or the window dims.
    """
    return conv_with_blocks(conv_input, conv_filter, strides, padding, [h_blocks_dim, w_blocks_dim], spatial_dims,
                            name or "conv2d_with_blocks")


def conv3d_with_blocks(conv_input: Tensor, conv_filter: Tensor, strides=(1, 1, 1), padding="SAME", d_blocks_dim=None,
                       h_blocks_dim=None, w_blocks_dim=None, spatial_dims=None, name=None) -> Tensor:
    """3-d :func:`conv2d_with_blocks` (Mesh TF ``mtf.conv3d_with_blocks``; here ``w`` may be blocked too).

    ``conv_input [batch.., d_blocks, h_blocks, (w_blocks,) d, h, w, in]``, filter ``[fd, fh, fw, in, out]``.
    """
    return conv_with_blocks(conv_input, conv_filter, strides, padding, [d_blocks_dim, h_blocks_dim, w_blocks_dim],
                            spatial_dims, name or "conv3d_with_blocks")

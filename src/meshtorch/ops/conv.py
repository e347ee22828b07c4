"""Convolutions over named spatial dimensions: conv1d/2d/3d, their transposes and the filter gradient.

Shapes (Mesh TF ``mtf.conv2d`` / ``mtf.conv2d_transpose``, NHWC style with names):

* input ``[batch-like dims..., spatial dims..., in_channels]`` (any order; the spatial dims are
  named by ``spatial_dims`` or default to the last ``n`` dims other than ``in_channels``);
* filter ``[k_1, ..., k_n, in_channels, out_channels]`` (Mesh TF's ``[fh, fw, in, out]``);
* output: the input's dims in the input's order, ``in_channels`` replaced by ``out_channels`` and
  each spatial dim keeping its name with its new size (as Mesh TF).

All dims other than the spatial and channel dims are batch-like: each processor flattens them into
torch's N and calls ``torch.nn.functional.conv{1,2,3}d`` on its slices.

Layouts: batch-like dims split freely; ``out_channels`` splits freely (each processor holds a slice
of the filter); ``in_channels`` may be split (input and filter are split the same way, each
processor computes a partial sum, and the all-reduce over that mesh axis is deferred: a lazy sum).
The spatial dims and the filter's window dims are *unsplittable* here (a split image needs a halo:
use :func:`meshtorch.conv2d_with_blocks`, which represents the image as block dims that do split).

Gradients are graph operations: d input = :class:`ConvTransposeOperation` (the transpose of the
convolution, lowered with ``torch.nn.functional.conv_transpose{n}d``), d filter =
:class:`ConvFilterGradOperation` (a correlation of input and output gradient, lowered with
``torch.nn.grad.conv{n}d_weight``; its contraction over batch-like dims is a lazy all-reduce).

Padding follows TensorFlow: ``"VALID"`` (no padding) or ``"SAME"`` (output size ``ceil(in / s)``,
total padding ``max((out - 1) s + k - in, 0)``, the odd element at the end), so a strided SAME
convolution matches ``tf.nn.conv2d`` (PyTorch's ``padding="same"`` rejects strides).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from meshtorch.core.dims import Dimension, Shape, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._util import dim_names

__all__ = [
    "ConvOperation", "ConvTransposeOperation", "ConvFilterGradOperation",
    "conv", "conv1d", "conv2d", "conv3d",
    "conv_transpose", "conv1d_transpose", "conv2d_transpose", "conv3d_transpose",
    "conv_output_size", "conv_padding",
]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_CONV_W = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}
PADDINGS = ("SAME", "VALID")


# ============================================================================ size arithmetic
def conv_output_size(size: int, k: int, s: int, padding: str) -> int:
    """Output length of a TF-style convolution/pooling window: SAME ``ceil(size/s)``, VALID ``(size-k)//s+1``."""
    if padding == "SAME":
        return -(-size // s)
    return (size - k) // s + 1


def conv_padding(size: int, k: int, s: int, padding: str) -> tuple[int, int]:
    """``(before, after)`` zero padding of TF's SAME (odd element after) or VALID ``(0, 0)``."""
    if padding == "VALID":
        return 0, 0
    total = max((conv_output_size(size, k, s, "SAME") - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def _check_padding(padding, what):
    if not isinstance(padding, str) or padding.upper() not in PADDINGS:
        raise ValueError(f"{what}: padding must be 'SAME' or 'VALID', got {padding!r}.")
    return padding.upper()


def _normalize_strides(strides, n: int, what: str) -> tuple[int, ...]:
    """int, n ints, or Mesh TF's ``[1, s_1, ..., s_n, 1]`` -> n positive ints."""
    if isinstance(strides, int):
        strides = [strides] * n
    strides = [int(s) for s in strides]
    if len(strides) == n + 2:
        if strides[0] != 1 or strides[-1] != 1:
            raise ValueError(f"{what}: strides {strides} in Mesh TF form [1, ..., 1] must be 1 on the batch and "
                             "channel positions.")
        strides = strides[1:-1]
    if len(strides) != n or any(s < 1 for s in strides):
        raise ValueError(f"{what}: strides must be {n} positive ints (or [1, *strides, 1]), got {strides}.")
    return tuple(strides)


def _torch_pad(pads) -> list[int]:
    """F.pad argument (last dim first) from per-spatial-dim ``(before, after)``."""
    out = []
    for b, a in reversed(pads):
        out += [b, a]
    return out


def _default_spatial(x: Tensor, n: int, exclude: Sequence[str], what: str) -> list[str]:
    cands = [d.name for d in x.shape if d.name not in exclude]
    if len(cands) < n:
        raise ShapeError(f"{what}: input {x.name!r} {x.shape} has fewer than {n} spatial dimensions besides "
                         f"{list(exclude)}.")
    return cands[-n:]


def _spatial(x: Tensor, n: int, spatial_dims, exclude, what) -> list[str]:
    names = _default_spatial(x, n, exclude, what) if spatial_dims is None else dim_names(spatial_dims)
    if len(names) != n or len(set(names)) != n:
        raise ShapeError(f"{what}: need {n} distinct spatial dims, got {names}.")
    for s in names:
        if s not in x.shape:
            raise ShapeError(f"{what}: input {x.name!r} {x.shape} has no spatial dimension {s!r}.")
        if s in exclude:
            raise ShapeError(f"{what}: dimension {s!r} of {x.name!r} cannot be both spatial and a channel dim.")
    return names


class _ConvGeometry:
    """Positions of the batch-like, channel and spatial dims of one tensor (for slice permutes)."""

    def __init__(self, shape: Shape, channel: str, spatial: Sequence[str]):
        names = shape.dimension_names
        self.spatial_idx = [names.index(s) for s in spatial]
        self.channel_idx = names.index(channel)
        self.batch_idx = [i for i in range(len(names)) if i != self.channel_idx and i not in self.spatial_idx]
        self.perm = self.batch_idx + [self.channel_idx] + self.spatial_idx
        self.inv = [self.perm.index(i) for i in range(len(names))]
        self.batch_names = [names[i] for i in self.batch_idx]
        self.nb = len(self.batch_idx)

    def params(self) -> dict:
        """Plain-data keywords of the kernels: ``perm`` to ``(batch..., C, S...)``, its inverse, ``nb``."""
        return {"perm": tuple(self.perm), "inv": tuple(self.inv), "nb": self.nb}


def _to_ncs(t: torch.Tensor, perm, nb: int):
    """Slice -> ``(N, C, *S)`` (dims permuted by ``perm``, the first ``nb`` flattened) and the batch sizes."""
    t = t.permute(perm)
    bshape = t.shape[:nb]
    return t.reshape(-1, *t.shape[nb:]), bshape


def _from_ncs(t: torch.Tensor, bshape, inv) -> torch.Tensor:
    return t.reshape(*bshape, *t.shape[1:]).permute(inv)


def _filter_perm(n: int) -> list[int]:
    """``[k..., in, out]`` -> torch's ``(out, in, k...)`` (the transposed convolution reads it as (in, out, k...))."""
    return [n + 1, n] + list(range(n))


def _k_conv(xs, ws, *, n: int, perm, inv, nb: int, strides, pads):
    """Forward convolution of slice ``xs`` with filter slice ``ws`` (see :class:`ConvOperation`)."""
    t, bshape = _to_ncs(xs, perm, nb)
    if all(b == a for b, a in pads):
        y = _CONV[n](t, ws.permute(_filter_perm(n)), stride=strides, padding=tuple(b for b, _ in pads))
    else:
        y = _CONV[n](F.pad(t, _torch_pad(pads)), ws.permute(_filter_perm(n)), stride=strides)
    return _from_ncs(y, bshape, inv)


def _k_conv_transpose(xs, ws, *, n: int, perm, inv, nb: int, strides, pads, ksizes, sizes):
    """Transposed convolution of slice ``xs`` to spatial ``sizes`` (see :class:`ConvTransposeOperation`)."""
    t, bshape = _to_ncs(xs, perm, nb)
    padded = [sz + b + a for sz, (b, a) in zip(sizes, pads, strict=True)]
    base = [(t.shape[2 + i] - 1) * strides[i] + ksizes[i] for i in range(n)]
    extra = tuple(p - b for p, b in zip(padded, base, strict=True))
    if all(b == a for b, a in pads):
        y = _CONV_T[n](t, ws.permute(_filter_perm(n)), stride=strides, padding=tuple(b for b, _ in pads),
                       output_padding=extra)
    else:
        y = _CONV_T[n](t, ws.permute(_filter_perm(n)), stride=strides, output_padding=extra)
        for i, (b, _) in enumerate(pads):
            y = y.narrow(2 + i, b, sizes[i])
    return _from_ncs(y, bshape, inv)


def _k_conv_filter_grad(xs, ds, *, n: int, perm, nb: int, dperm, strides, tpad, ksizes):
    """Filter gradient ``[k..., in, out]`` from slices of x and dy (see :class:`ConvFilterGradOperation`)."""
    t, _ = _to_ncs(xs, perm, nb)
    d = ds.permute(dperm)
    d = d.reshape(-1, *d.shape[nb:])
    if any(tpad):
        t = F.pad(t, list(tpad))
    g = _CONV_W[n](t, [d.shape[1], t.shape[1], *ksizes], d, stride=strides)
    return g.permute(list(range(2, n + 2)) + [1, 0])  # (out, in, *k) -> (*k, in, out)


def _filter_parts(conv_filter: Tensor, what: str):
    n = conv_filter.shape.ndims - 2
    if n not in (1, 2, 3):
        raise ShapeError(f"{what}: filter {conv_filter.name!r} {conv_filter.shape} must be "
                         "[k_1, ..(1 to 3 window dims).., in_channels, out_channels].")
    return n, list(conv_filter.shape[:n].dims), conv_filter.shape[-2], conv_filter.shape[-1]


# ============================================================================ forward convolution
class ConvOperation(Operation):
    """n-d convolution (n = 1, 2, 3) of ``x`` with ``conv_filter``; see the module docstring.

    Lowered per slice with ``torch.nn.functional.conv{n}d`` (explicit ``F.pad`` when the SAME
    padding is asymmetric). A split ``in_channels`` leaves a lazy all-reduce over its mesh axis.
    """

    def __init__(self, x: Tensor, conv_filter: Tensor, strides, padding="SAME", spatial_dims=None, name=None):
        super().__init__([x, conv_filter], name=name or "conv")
        what = f"conv {self.name!r}"
        n, kdims, in_dim, out_dim = _filter_parts(conv_filter, what)
        if x.dtype != conv_filter.dtype:
            raise TypeError(f"{what}: input {x.name!r} is {x.dtype} but filter {conv_filter.name!r} is "
                            f"{conv_filter.dtype}; cast one of them.")
        if in_dim not in x.shape.dims:
            raise ShapeError(f"{what}: the filter's in-channels dimension {in_dim} (filter {conv_filter.name!r} "
                             f"{conv_filter.shape}) is not a dimension of input {x.name!r} {x.shape}.")
        if out_dim.name in x.shape:
            raise ShapeError(f"{what}: the filter's out-channels dimension {out_dim.name!r} is already a dimension "
                             f"of input {x.name!r} {x.shape}; give the output channels another name.")
        self.n = n
        self.strides = _normalize_strides(strides, n, what)
        self.padding = _check_padding(padding, what)
        self.spatial = _spatial(x, n, spatial_dims, [in_dim.name], what)
        self.in_dim, self.out_dim, self.kdims = in_dim, out_dim, kdims
        out_dims, self.pads = [], []
        sp = {s: i for i, s in enumerate(self.spatial)}
        for d in x.shape:
            if d.name == in_dim.name:
                out_dims.append(out_dim)
            elif d.name in sp:
                i = sp[d.name]
                k, s = kdims[i].size, self.strides[i]
                size = conv_output_size(d.size, k, s, self.padding)
                if size < 1:
                    raise ShapeError(f"{what}: spatial dimension {d} of {x.name!r} is smaller than the filter window "
                                     f"{kdims[i]} with VALID padding.")
                out_dims.append(Dimension(d.name, size))
            else:
                out_dims.append(d)
        self.pads = [conv_padding(x.shape.get_dim_by_name(s).size, kdims[i].size, self.strides[i], self.padding)
                     for i, s in enumerate(self.spatial)]
        self.unsplittable_dims = tuple(self.spatial) + tuple(d.name for d in kdims)
        self.outputs = [Tensor(self, Shape(out_dims), x.dtype)]

    @property
    def flops(self) -> int:
        out = self.outputs[0]
        return 2 * out.shape.size * self.in_dim.size * math.prod(d.size for d in self.kdims)

    def lower(self, lw):
        x, w = self.inputs
        out = self.outputs[0]
        geo = _ConvGeometry(x.shape, self.in_dim.name, self.spatial)
        f = functools.partial(_k_conv, n=self.n, strides=tuple(self.strides),
                              pads=tuple(tuple(p) for p in self.pads), **geo.params())
        pending = frozenset(lw.tensor_mesh_axes(x, [self.in_dim.name]))
        lw.set(out, lw.slicewise(f, lw.get(x), lw.get(w), flops=self.flops), pending)

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None, None]
        x, w = self.inputs
        dx = ConvTransposeOperation(dy, w, x.shape, self.strides, self.padding, self.spatial,
                                    name=f"{self.name}_grad_input").outputs[0]
        dw = ConvFilterGradOperation(x, dy, w.shape, self.strides, self.padding, self.spatial,
                                     name=f"{self.name}_grad_filter").outputs[0]
        return [dx, dw]


# ============================================================================ transpose (input gradient)
class ConvTransposeOperation(Operation):
    """Transpose of :class:`ConvOperation` w.r.t. its input (Mesh TF ``Conv2dTransposeOperation``).

    ``x [batch..., spatial..., out_channels]`` (channels = the filter's last dim) and the *same*
    filter ``[k..., in_channels, out_channels]`` give ``output_shape``: x's dims with
    ``out_channels`` replaced by ``in_channels`` and the spatial dims resized to the sizes in
    ``output_shape`` — the input sizes of the forward convolution this transposes (a forward
    convolution of ``output_shape`` with the same strides/padding must give x's spatial sizes).
    Lowered with ``torch.nn.functional.conv_transpose{n}d``; the contracted ``out_channels`` leaves a
    lazy all-reduce over its mesh axis if split.
    """

    def __init__(self, x: Tensor, conv_filter: Tensor, output_shape, strides, padding="SAME", spatial_dims=None,
                 name=None):
        super().__init__([x, conv_filter], name=name or "conv_transpose")
        what = f"conv_transpose {self.name!r}"
        n, kdims, in_dim, out_dim = _filter_parts(conv_filter, what)
        if x.dtype != conv_filter.dtype:
            raise TypeError(f"{what}: input {x.name!r} is {x.dtype} but filter {conv_filter.name!r} is "
                            f"{conv_filter.dtype}.")
        if out_dim not in x.shape.dims:
            raise ShapeError(f"{what}: input {x.name!r} {x.shape} lacks the channel dimension {out_dim} (the last dim "
                             f"of filter {conv_filter.name!r} {conv_filter.shape}).")
        if in_dim.name in x.shape:
            raise ShapeError(f"{what}: input {x.name!r} {x.shape} already has the output channel dimension "
                             f"{in_dim.name!r}.")
        self.n = n
        self.strides = _normalize_strides(strides, n, what)
        self.padding = _check_padding(padding, what)
        self.spatial = _spatial(x, n, spatial_dims, [out_dim.name], what)
        self.in_dim, self.out_dim, self.kdims = in_dim, out_dim, kdims
        output_shape = convert_to_shape(output_shape)
        want = [in_dim.name if d.name == out_dim.name else d.name for d in x.shape]
        if list(output_shape.dimension_names) != want:
            raise ShapeError(f"{what}: output shape {output_shape} must have the dims {want} (x's dims with "
                             f"{out_dim.name!r} replaced by {in_dim.name!r}).")
        if output_shape.get_dim_by_name(in_dim.name) != in_dim:
            raise ShapeError(f"{what}: output dim {output_shape.get_dim_by_name(in_dim.name)} must equal the "
                             f"filter's {in_dim}.")
        self.pads = []
        for i, s in enumerate(self.spatial):
            full, k, st = output_shape.get_dim_by_name(s).size, kdims[i].size, self.strides[i]
            if conv_output_size(full, k, st, self.padding) != x.shape.get_dim_by_name(s).size:
                raise ShapeError(f"{what}: output spatial size {s}:{full} does not convolve (k={k}, stride={st}, "
                                 f"{self.padding}) to the input's {x.shape.get_dim_by_name(s)}.")
            self.pads.append(conv_padding(full, k, st, self.padding))
        for d in x.shape:
            if d.name not in self.spatial and d.name != out_dim.name and output_shape.get_dim_by_name(d.name) != d:
                raise ShapeError(f"{what}: batch-like dim {d} of {x.name!r} must keep its size in the output.")
        self.unsplittable_dims = tuple(self.spatial) + tuple(d.name for d in kdims)
        self.outputs = [Tensor(self, output_shape, x.dtype)]

    @property
    def flops(self) -> int:
        return 2 * self.inputs[0].shape.size * self.in_dim.size * math.prod(d.size for d in self.kdims)

    def lower(self, lw):
        x, w = self.inputs
        out = self.outputs[0]
        geo = _ConvGeometry(x.shape, self.out_dim.name, self.spatial)
        f = functools.partial(_k_conv_transpose, n=self.n, strides=tuple(self.strides),
                              pads=tuple(tuple(p) for p in self.pads), ksizes=tuple(d.size for d in self.kdims),
                              sizes=tuple(out.shape.get_dim_by_name(s).size for s in self.spatial),
                              **geo.params())
        pending = frozenset(lw.tensor_mesh_axes(x, [self.out_dim.name]))
        lw.set(out, lw.slicewise(f, lw.get(x), lw.get(w), flops=self.flops), pending)

    def gradient(self, grad_ys):
        g = grad_ys[0]
        if g is None:
            return [None, None]
        x, w = self.inputs
        dx = ConvOperation(g, w, self.strides, self.padding, self.spatial, name=f"{self.name}_grad_input").outputs[0]
        dw = ConvFilterGradOperation(g, x, w.shape, self.strides, self.padding, self.spatial,
                                     name=f"{self.name}_grad_filter").outputs[0]
        return [dx, dw]


# ============================================================================ filter gradient
class ConvFilterGradOperation(Operation):
    """Gradient of a convolution w.r.t. its filter: the correlation of ``x`` and ``dy``.

    ``x [batch..., spatial..., in]``, ``dy [batch..., spatial'..., out]`` (the forward output's
    gradient) -> ``filter_shape [k..., in, out]``. Lowered with ``torch.nn.grad.conv{n}d_weight``;
    the batch-like dims are contracted, so a split batch-like dim leaves a lazy all-reduce.
    """

    def __init__(self, x: Tensor, dy: Tensor, filter_shape, strides, padding, spatial_dims, name=None):
        super().__init__([x, dy], name=name or "conv_filter_grad")
        what = f"conv_filter_grad {self.name!r}"
        filter_shape = convert_to_shape(filter_shape)
        n = filter_shape.ndims - 2
        self.n = n
        self.kdims = list(filter_shape[:n].dims)
        self.in_dim, self.out_dim = filter_shape[-2], filter_shape[-1]
        self.strides = _normalize_strides(strides, n, what)
        self.padding = _check_padding(padding, what)
        self.spatial = dim_names(spatial_dims)
        for t, ch in ((x, self.in_dim), (dy, self.out_dim)):
            if ch not in t.shape.dims:
                raise ShapeError(f"{what}: {t.name!r} {t.shape} lacks channel dimension {ch}.")
        xb = [d for d in x.shape if d.name not in self.spatial and d.name != self.in_dim.name]
        db = [d for d in dy.shape if d.name not in self.spatial and d.name != self.out_dim.name]
        if sorted(xb) != sorted(db):
            raise ShapeError(f"{what}: batch-like dims of {x.name!r} {xb} and {dy.name!r} {db} differ.")
        self.pads = []
        for i, s in enumerate(self.spatial):
            full, k, st = x.shape.get_dim_by_name(s).size, self.kdims[i].size, self.strides[i]
            if conv_output_size(full, k, st, self.padding) != dy.shape.get_dim_by_name(s).size:
                raise ShapeError(f"{what}: {x.name!r} dim {s}:{full} does not convolve to {dy.name!r}'s "
                                 f"{dy.shape.get_dim_by_name(s)}.")
            self.pads.append(conv_padding(full, k, st, self.padding))
        self.unsplittable_dims = tuple(self.spatial) + tuple(d.name for d in self.kdims)
        self.outputs = [Tensor(self, filter_shape, x.dtype)]

    @property
    def flops(self) -> int:
        return 2 * self.inputs[1].shape.size * self.in_dim.size * math.prod(d.size for d in self.kdims)

    def lower(self, lw):
        x, dy = self.inputs
        out = self.outputs[0]
        gx = _ConvGeometry(x.shape, self.in_dim.name, self.spatial)
        gd = _ConvGeometry(dy.shape, self.out_dim.name, self.spatial)
        # dy's batch-like dims in x's batch order
        dperm = [dy.shape.get_dim_index(nm) for nm in gx.batch_names] + [gd.channel_idx] + gd.spatial_idx
        f = functools.partial(_k_conv_filter_grad, n=self.n, perm=tuple(gx.perm), nb=gx.nb, dperm=tuple(dperm),
                              strides=tuple(self.strides), tpad=tuple(_torch_pad(self.pads)),
                              ksizes=tuple(d.size for d in self.kdims))
        pending = frozenset(lw.tensor_mesh_axes(x, gx.batch_names))
        lw.set(out, lw.slicewise(f, lw.get(x), lw.get(dy), flops=self.flops), pending)

    def gradient(self, grad_ys):
        g = grad_ys[0]
        if g is None:
            return [None, None]
        x, dy = self.inputs
        dx = ConvTransposeOperation(dy, g, x.shape, self.strides, self.padding, self.spatial,
                                    name=f"{self.name}_grad_x").outputs[0]
        ddy = ConvOperation(x, g, self.strides, self.padding, self.spatial, name=f"{self.name}_grad_dy").outputs[0]
        return [dx, ddy]


# ============================================================================ public functions
def conv(conv_input: Tensor, conv_filter: Tensor, strides=1, padding="SAME", spatial_dims=None, name=None) -> Tensor:
    """n-d convolution (n = filter rank - 2) over named spatial dims; see :func:`conv2d`."""
    return ConvOperation(conv_input, conv_filter, strides, padding, spatial_dims, name).outputs[0]


def conv1d(conv_input: Tensor, conv_filter: Tensor, strides=1, padding="SAME", spatial_dims=None, name=None) -> Tensor:
    """1-d convolution: filter ``[k, in, out]``; see :func:`conv2d`."""
    _expect_rank(conv_filter, 1, "conv1d")
    return conv(conv_input, conv_filter, strides, padding, spatial_dims, name or "conv1d")


def conv2d(conv_input: Tensor, conv_filter: Tensor, strides=(1, 1), padding="SAME", spatial_dims=None,
           name=None) -> Tensor:
    """2-d convolution over named dims (Mesh TF ``mtf.conv2d``; ``torch.nn.functional.conv2d`` per slice).

    Args:
        conv_input: ``[batch-like..., h, w, in]`` (any dim order), float.
        conv_filter: ``[fh, fw, in, out]``, same dtype.
        strides: int, ``(sh, sw)`` or Mesh TF's ``[1, sh, sw, 1]``.
        padding: ``"SAME"`` (TF semantics, incl. strided) or ``"VALID"``.
        spatial_dims: names of ``(h, w)`` in ``conv_input``; default the last two dims other than ``in``.

    Returns:
        ``conv_input``'s dims with ``in`` -> ``out`` and ``h``, ``w`` resized (same names).

    Raises:
        ShapeError: filter in-channels not in the input, out-channels already in it, bad spatial dims,
            a VALID window larger than the input. TypeError: dtypes differ. ValueError: bad strides/padding.
        LayoutError (at lowering): a layout splits ``h``, ``w``, ``fh`` or ``fw``.
    """
    _expect_rank(conv_filter, 2, "conv2d")
    return conv(conv_input, conv_filter, strides, padding, spatial_dims, name or "conv2d")


def conv3d(conv_input: Tensor, conv_filter: Tensor, strides=(1, 1, 1), padding="SAME", spatial_dims=None,
           name=None) -> Tensor:
    """3-d convolution: filter ``[fd, fh, fw, in, out]`` (Mesh TF ``mtf.conv3d``); see :func:`conv2d`."""
    _expect_rank(conv_filter, 3, "conv3d")
    return conv(conv_input, conv_filter, strides, padding, spatial_dims, name or "conv3d")


def conv_transpose(conv_input: Tensor, conv_filter: Tensor, strides=2, padding="SAME", spatial_dims=None,
                   output_sizes=None, name=None) -> Tensor:
    """Transposed convolution (Mesh TF ``mtf.conv2d_transpose``; ``torch.nn.functional.conv_transpose{n}d``).

    Args:
        conv_input: ``[batch-like..., spatial..., c]`` where ``c`` is the filter's *last* dim.
        conv_filter: ``[k..., out, c]`` (Mesh TF's ``[fh, fw, output_dim, input_dim]``): the filter of
            the forward convolution ``out -> c`` that this op transposes.
        strides, padding: of that forward convolution.
        output_sizes: spatial output sizes; default TF's: SAME ``in * s``, VALID ``(in - 1) * s + k``.

    Returns:
        ``conv_input``'s dims with ``c`` -> ``out`` and the spatial dims resized (same names).

    Raises:
        ShapeError / ValueError as :func:`conv2d`; ShapeError if ``output_sizes`` do not convolve back.
    """
    what = f"conv_transpose {name or ''}"
    n, kdims, in_dim, out_dim = _filter_parts(conv_filter, what)
    if out_dim not in conv_input.shape.dims:
        raise ShapeError(f"{what}: input {conv_input.name!r} {conv_input.shape} lacks the filter's last dim {out_dim}.")
    st = _normalize_strides(strides, n, what)
    pad = _check_padding(padding, what)
    spatial = _spatial(conv_input, n, spatial_dims, [out_dim.name], what)
    if output_sizes is None:
        output_sizes = []
        for i, s in enumerate(spatial):
            size = conv_input.shape.get_dim_by_name(s).size
            output_sizes.append(size * st[i] if pad == "SAME" else (size - 1) * st[i] + kdims[i].size)
    sizes = dict(zip(spatial, [int(v) for v in output_sizes], strict=True))
    out_shape = Shape([in_dim if d.name == out_dim.name else Dimension(d.name, sizes[d.name]) if d.name in sizes
                       else d for d in conv_input.shape])
    return ConvTransposeOperation(conv_input, conv_filter, out_shape, st, pad, spatial, name).outputs[0]


def conv1d_transpose(conv_input, conv_filter, strides=2, padding="SAME", spatial_dims=None, output_sizes=None,
                     name=None) -> Tensor:
    """1-d :func:`conv_transpose` (filter ``[k, out, in]``)."""
    _expect_rank(conv_filter, 1, "conv1d_transpose")
    return conv_transpose(conv_input, conv_filter, strides, padding, spatial_dims, output_sizes, name)


def conv2d_transpose(conv_input, conv_filter, strides=(2, 2), padding="SAME", spatial_dims=None, output_sizes=None,
                     name=None) -> Tensor:
    """2-d :func:`conv_transpose` (Mesh TF ``mtf.conv2d_transpose``; filter ``[fh, fw, out, in]``)."""
    _expect_rank(conv_filter, 2, "conv2d_transpose")
    return conv_transpose(conv_input, conv_filter, strides, padding, spatial_dims, output_sizes, name)


def conv3d_transpose(conv_input, conv_filter, strides=(2, 2, 2), padding="SAME", spatial_dims=None,
                     output_sizes=None, name=None) -> Tensor:
    """3-d :func:`conv_transpose` (Mesh TF ``mtf.conv3d_transpose``; filter ``[fd, fh, fw, out, in]``)."""
    _expect_rank(conv_filter, 3, "conv3d_transpose")
    return conv_transpose(conv_input, conv_filter, strides, padding, spatial_dims, output_sizes, name)


def _expect_rank(conv_filter: Tensor, n: int, what: str):
    if not isinstance(conv_filter, Tensor):
        raise TypeError(f"{what}: conv_filter must be an mtf Tensor, got {type(conv_filter).__name__}.")
    if conv_filter.shape.ndims != n + 2:
        raise ShapeError(f"{what}: filter {conv_filter.name!r} {conv_filter.shape} must have {n + 2} dims "
                         f"({n} window dims, in_channels, out_channels).")

"""Max and average pooling over named spatial dimensions (Mesh TF ``mtf.max_pool2d`` / ``avg_pool2d``).

``x [other dims..., spatial dims...]``: every dim that is not pooled is batch-like (channels too),
flattened into torch's N on each processor and pooled with ``torch.nn.functional.{max,avg}_pool{n}d``.
The spatial dims default to Mesh TF's NHWC convention: the ``n`` dims just before the last dim;
they are unsplittable (a window must not straddle processors: pool per block on a blocked image
instead, where the block dims may split). Every other dim splits freely with no communication.

Strides default to the window (Mesh TF pools with stride = ksize) and may be anything; padding is
TF's: ``"VALID"`` or ``"SAME"`` (windows hanging over the edge ignore the missing elements: max over
the present ones, average divided by the number present, as ``tf.nn.avg_pool``).

Gradient: :class:`PoolGradOperation`, lowered per slice by PyTorch's own pooling backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from meshtorch.core.dims import Dimension, Shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._util import dim_names
from meshtorch.ops.conv import _check_padding, _normalize_strides, _torch_pad, conv_output_size, conv_padding

__all__ = ["PoolOperation", "PoolGradOperation", "pool", "max_pool1d", "max_pool2d", "max_pool3d",
           "avg_pool1d", "avg_pool2d", "avg_pool3d", "pool_fn", "pool_backprop"]

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pool_ncs(t, *, kind: str, n: int, ksize, strides, tpad):
    """Pooling of an ``(N, *S)`` tensor (the channel-free layout used here); ``tpad``: F.pad's argument."""
    t = t.unsqueeze(1)
    any_pad = any(tpad)
    if kind == "MAX":
        if any_pad:
            t = F.pad(t, list(tpad), value=float("-inf"))
        return _MAX[n](t, ksize, strides).squeeze(1)
    ap = _AVG[n]
    if not any_pad:
        return ap(t, ksize, strides).squeeze(1)
    y = ap(F.pad(t, list(tpad)), ksize, strides)
    ones = F.pad(torch.ones((1, 1, *t.shape[2:]), dtype=t.dtype, device=t.device), list(tpad))
    frac = ap(ones, ksize, strides)  # fraction of each window that lies inside the input
    return (y / frac).squeeze(1)


def _k_pool(t, *, perm, inv, kind: str, n: int, ksize, strides, tpad):
    """Pooled slice ``t`` in its own dim order: spatial dims moved last by ``perm``, back by ``inv``."""
    t = t.permute(perm)
    bshape = t.shape[: t.ndim - n]
    y = _pool_ncs(t.reshape(-1, *t.shape[t.ndim - n:]), kind=kind, n=n, ksize=ksize, strides=strides, tpad=tpad)
    return y.reshape(*bshape, *y.shape[1:]).permute(inv)


def _k_pool_grad(xs, ds, **pool):
    """d(pool)/dx for slice ``xs`` and output gradient ``ds``, by PyTorch's pooling backward."""
    with torch.enable_grad():
        t = xs.detach().requires_grad_(True)
        (gx,) = torch.autograd.grad(_k_pool(t, **pool), t, ds)
    return gx


class PoolOperation(Operation):
    """``kind`` ("MAX" or "AVG") pooling of ``x`` over ``spatial_dims`` with window ``ksize``."""

    def __init__(self, x: Tensor, kind: str, ksize, strides=None, padding="VALID", spatial_dims=None, name=None):
        super().__init__([x], name=name or f"{kind.lower()}_pool")
        what = f"{kind.lower()}_pool {self.name!r}"
        if kind not in ("MAX", "AVG"):
            raise ValueError(f"{what}: kind must be MAX or AVG, got {kind!r}.")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{what}: input {x.name!r} must be floating point, got {x.dtype}.")
        ksize = [ksize] if isinstance(ksize, int) else list(ksize)
        n = len(ksize)
        if n not in (1, 2, 3) or any(int(k) < 1 for k in ksize):
            raise ValueError(f"{what}: ksize must be 1 to 3 positive ints, got {ksize}.")
        self.kind, self.n = kind, n
        self.ksize = tuple(int(k) for k in ksize)
        self.strides = self.ksize if strides is None else _normalize_strides(strides, n, what)
        self.padding = _check_padding(padding, what)
        if spatial_dims is None:
            if x.shape.ndims < n + 1:
                raise ShapeError(f"{what}: input {x.name!r} {x.shape} needs {n} spatial dims before its last dim "
                                 "(Mesh TF NHWC); pass spatial_dims to choose others.")
            spatial_dims = [d.name for d in x.shape[-n - 1:-1]]
        self.spatial = dim_names(spatial_dims)
        if len(self.spatial) != n or len(set(self.spatial)) != n:
            raise ShapeError(f"{what}: need {n} distinct spatial dims for ksize {ksize}, got {self.spatial}.")
        out_dims, self.pads = [], []
        for d in x.shape:
            if d.name in self.spatial:
                i = self.spatial.index(d.name)
                size = conv_output_size(d.size, self.ksize[i], self.strides[i], self.padding)
                if size < 1:
                    raise ShapeError(f"{what}: spatial dim {d} of {x.name!r} is smaller than the window "
                                     f"{self.ksize[i]} (VALID).")
                out_dims.append(Dimension(d.name, size))
            else:
                out_dims.append(d)
        for i, s in enumerate(self.spatial):
            if s not in x.shape:
                raise ShapeError(f"{what}: input {x.name!r} {x.shape} has no dimension {s!r}.")
            self.pads.append(conv_padding(x.shape.get_dim_by_name(s).size, self.ksize[i], self.strides[i],
                                          self.padding))
        self.unsplittable_dims = tuple(self.spatial)
        self.outputs = [Tensor(self, Shape(out_dims), x.dtype)]
        names = x.shape.dimension_names
        sidx = [names.index(s) for s in self.spatial]
        self._perm = [i for i in range(len(names)) if i not in sidx] + sidx
        self._inv = [self._perm.index(i) for i in range(len(names))]

    def kernel_params(self) -> dict:
        """Plain-data parameters of :func:`_k_pool` (also used by the gradient's kernel)."""
        return {"perm": tuple(self._perm), "inv": tuple(self._inv), "kind": self.kind, "n": self.n,
                "ksize": self.ksize, "strides": tuple(self.strides), "tpad": tuple(_torch_pad(self.pads))}

    def lower(self, lw):
        f = functools.partial(_k_pool, **self.kernel_params())
        lw.set(self.outputs[0], lw.slicewise(f, lw.get(self.inputs[0])))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        return [PoolGradOperation(self, dy).outputs[0]]


class PoolGradOperation(Operation):
    """Gradient of a :class:`PoolOperation` w.r.t. its input: inputs ``(x, dy)``, output x's shape.

    Lowered per slice with PyTorch's pooling backward (``torch.autograd.grad`` of the same slice
    function), so ties and padding are treated exactly as PyTorch treats them. No second gradient.
    """

    def __init__(self, forward: PoolOperation, dy: Tensor, name=None):
        x = forward.inputs[0]
        super().__init__([x, dy], name=name or f"{forward.name}_grad")
        if dy.shape != forward.outputs[0].shape:
            raise ShapeError(f"pool gradient {self.name!r}: dy {dy.shape} differs from the pool output "
                             f"{forward.outputs[0].shape}.")
        self.forward = forward
        self.unsplittable_dims = forward.unsplittable_dims
        self.outputs = [Tensor(self, x.shape, x.dtype)]

    def lower(self, lw):
        x, dy = self.inputs
        g = functools.partial(_k_pool_grad, **self.forward.kernel_params())
        lw.set(self.outputs[0], lw.slicewise(g, lw.get(x), lw.get(dy)))


def pool(x: Tensor, kind: str, ksize, strides=None, padding="VALID", spatial_dims=None, name=None) -> Tensor:
    """Max (``kind="MAX"``) or average (``"AVG"``) pooling; see the module docstring.

    Args:
        x: float Tensor ``[..., spatial..., c]``.
        ksize: window, one int per spatial dim (1 to 3 of them).
        strides: default ``ksize``; int, per-dim ints, or Mesh TF's ``[1, *s, 1]``.
        padding: ``"VALID"`` (default, Mesh TF) or ``"SAME"``.
        spatial_dims: dims to pool (default the ``len(ksize)`` dims before x's last dim).

    Returns:
        x's dims with the spatial ones resized (same names), x's dtype.

    Raises:
        ShapeError: missing/duplicate spatial dims or a VALID window larger than the input.
        ValueError: bad ksize/strides/padding. TypeError: integer input.
        LayoutError (at lowering): a layout splits a pooled dim.
    """
    return PoolOperation(x, kind, ksize, strides, padding, spatial_dims, name).outputs[0]


def _n(ksize, n, what):
    ksize = [ksize] * n if isinstance(ksize, int) else list(ksize)
    if len(ksize) != n:
        raise ValueError(f"{what}: ksize must have {n} entries, got {ksize}.")
    return ksize


def max_pool1d(x, ksize=2, strides=None, padding="VALID", spatial_dims=None, name=None) -> Tensor:
    """1-d max pooling (``F.max_pool1d`` per slice); see :func:`pool`."""
    return pool(x, "MAX", _n(ksize, 1, "max_pool1d"), strides, padding, spatial_dims, name or "max_pool1d")


def max_pool2d(x, ksize=(2, 2), strides=None, padding="VALID", spatial_dims=None, name=None) -> Tensor:
    """2-d max pooling (Mesh TF ``mtf.max_pool2d``, x ``[..., h, w, c]``); see :func:`pool`."""
    return pool(x, "MAX", _n(ksize, 2, "max_pool2d"), strides, padding, spatial_dims, name or "max_pool2d")


def max_pool3d(x, ksize=(2, 2, 2), strides=None, padding="VALID", spatial_dims=None, name=None) -> Tensor:
    """3-d max pooling (Mesh TF ``mtf.max_pool3d``, x ``[..., d, h, w, c]``); see :func:`pool`."""
    return pool(x, "MAX", _n(ksize, 3, "max_pool3d"), strides, padding, spatial_dims, name or "max_pool3d")


def avg_pool1d(x, ksize=2, strides=None, padding="VALID", spatial_dims=None, name=None) -> Tensor:
    """1-d average pooling; see :func:`pool`."""
    return pool(x, "AVG", _n(ksize, 1, "avg_pool1d"), strides, padding, spatial_dims, name or "avg_pool1d")


def avg_pool2d(x, ksize=(2, 2), strides=None, padding="VALID", spatial_dims=None, name=None) -> Tensor:
    """2-d average pooling (Mesh TF ``mtf.avg_pool2d``); see :func:`pool`."""
    return pool(x, "AVG", _n(ksize, 2, "avg_pool2d"), strides, padding, spatial_dims, name or "avg_pool2d")


def avg_pool3d(x, ksize=(2, 2, 2), strides=None, padding="VALID", spatial_dims=None, name=None) -> Tensor:
    """3-d average pooling (Mesh TF ``mtf.avg_pool3d``); see :func:`pool`."""
    return pool(x, "AVG", _n(ksize, 3, "avg_pool3d"), strides, padding, spatial_dims, name or "avg_pool3d")


_POOL_FN_STRINGS = {"AVG_2D": ("AVG", 2), "AVG_3D": ("AVG", 3), "MAX_2D": ("MAX", 2), "MAX_3D": ("MAX", 3)}


def _tf_pool(x: torch.Tensor, ksize, strides, padding, kind: str, n: int) -> torch.Tensor:
    """``tf.nn.{max,avg}_pool{n}d`` on a torch tensor ``[batch..., spatial (n)..., channels]``."""
    k = [ksize] * n if isinstance(ksize, int) else list(ksize)
    k = k[1:-1] if len(k) == n + 2 else k
    s = list(_normalize_strides(strides, n, "pool_fn"))
    pad = _check_padding(padding, "pool_fn")
    sizes = list(x.shape[x.ndim - n - 1:-1])
    pads = [conv_padding(sizes[i], k[i], s[i], pad) for i in range(n)]
    t = x.movedim(-1, x.ndim - n - 1)  # [..., c, spatial...]
    lead = t.shape[: t.ndim - n]
    y = _pool_ncs(t.reshape(-1, *sizes), kind=kind, n=n, ksize=tuple(k), strides=tuple(s), tpad=tuple(_torch_pad(pads)))
    return y.reshape(*lead, *y.shape[1:]).movedim(x.ndim - n - 1, -1)


def pool_fn(pool_fn_string: str):
    """Mesh TF's ``mtf.pool_fn``: ``"AVG_2D"``, ``"AVG_3D"``, ``"MAX_2D"``, ``"MAX_3D"`` -> a slice function
    ``fn(x, ksize, strides, padding)`` on torch tensors ``[batch..., spatial..., channels]`` (TF's NHWC)
    with TF's padding semantics. Raises ValueError on another string."""
    if pool_fn_string not in _POOL_FN_STRINGS:
        raise ValueError(f"Unknown pool_fn_string {pool_fn_string!r}; use one of {sorted(_POOL_FN_STRINGS)}.")
    kind, n = _POOL_FN_STRINGS[pool_fn_string]
    return functools.partial(_tf_pool, kind=kind, n=n)


def pool_backprop(x: Tensor, y: Tensor, dy: Tensor, ksize, strides, pool_fn_string: str, name=None) -> Tensor:
    """Gradient of the pooling ``y = pool(x)`` (``pool_fn_string`` as :func:`pool_fn`, VALID padding, as
    Mesh TF's pooling layers) for upstream ``dy`` (Mesh TF ``mtf.pool_backprop``). Returns x's shape.

    Raises:
        ShapeError: if ``y`` or ``dy`` do not have the pooled shape.
    """
    if pool_fn_string not in _POOL_FN_STRINGS:
        raise ValueError(f"Unknown pool_fn_string {pool_fn_string!r}; use one of {sorted(_POOL_FN_STRINGS)}.")
    kind, n = _POOL_FN_STRINGS[pool_fn_string]
    k = [ksize] * n if isinstance(ksize, int) else list(ksize)
    k = k[1:-1] if len(k) == n + 2 else k
    fwd = PoolOperation(x, kind, k, strides, "VALID", name=f"{name or 'pool_backprop'}/forward")
    if set(fwd.outputs[0].shape.dims) != set(y.shape.dims):
        raise ShapeError(f"pool_backprop: y {y.name!r} {y.shape} is not the pooled shape {fwd.outputs[0].shape}.")
    return PoolGradOperation(fwd, dy, name=name).outputs[0]

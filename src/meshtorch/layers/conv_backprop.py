"""Mesh TF's explicit convolution gradients: conv{2,3}d[_transpose]_backprop_{input,filter}.

Each is the gradient of the forward convolution (:mod:`meshtorch.ops.conv`) for the upstream
gradient ``dy``, built with :func:`meshtorch.autodiff.gradients` on that forward op: the same
operations (and communication) as the backward pass of ``mtf.conv2d`` etc. Arguments follow
mesh_tensorflow/ops.py (``tf.nn.conv2d_backprop_input`` / ``_filter``): strides as ints, ``(s, s)``
or ``[1, s, s, 1]``; padding ``"SAME"`` or ``"VALID"``; data ``[batch..., spatial..., channels]``.
"""

from __future__ import annotations

from meshtorch.autodiff import gradients
from meshtorch.core.dims import convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.ops.conv import _filter_parts, _spatial, conv, conv_transpose
from meshtorch.ops.variables import zeros

__all__ = ["conv2d_backprop_input", "conv2d_backprop_filter", "conv3d_backprop_input", "conv3d_backprop_filter",
           "conv2d_transpose_backprop_input", "conv2d_transpose_backprop_filter",
           "conv3d_transpose_backprop_input", "conv3d_transpose_backprop_filter"]


def _forward(x: Tensor, w: Tensor, dy: Tensor, strides, padding, transpose: bool, what: str) -> Tensor:
    if transpose:
        _, _, _, c = _filter_parts(w, what)
        spatial = _spatial(x, len(w.shape) - 2, None, [c.name], what)
        missing = [s for s in spatial if s not in dy.shape]
        if missing:
            raise ShapeError(f"{what}: dy {dy.name!r} {dy.shape} lacks the spatial dims {missing} of the input.")
        sizes = [dy.shape.get_dim_by_name(s).size for s in spatial]
        y = conv_transpose(x, w, strides, padding, output_sizes=sizes, name=what)
    else:
        y = conv(x, w, strides, padding, name=what)
    if set(y.shape.dims) != set(dy.shape.dims):
        raise ShapeError(f"{what}: dy {dy.name!r} {dy.shape} does not match the convolution's output {y.shape}.")
    return y


def _backprop_input(input_shape, conv_filter, dy, strides, padding, n, transpose, name):
    what = name or f"conv{n}d{'_transpose' if transpose else ''}_backprop_input"
    if len(conv_filter.shape) != n + 2:
        raise ShapeError(f"{what}: filter {conv_filter.name!r} {conv_filter.shape} must have {n + 2} dims.")
    x = zeros(conv_filter.mesh, convert_to_shape(input_shape), conv_filter.dtype, name=f"{what}/input")
    y = _forward(x, conv_filter, dy, strides, padding, transpose, what)
    return gradients([y], [x], grad_ys=[dy])[0]


def _backprop_filter(conv_input, filter_shape, dy, strides, padding, n, transpose, name):
    what = name or f"conv{n}d{'_transpose' if transpose else ''}_backprop_filter"
    filter_shape = convert_to_shape(filter_shape)
    if len(filter_shape) != n + 2:
        raise ShapeError(f"{what}: filter_shape {filter_shape} must have {n + 2} dims.")
    w = zeros(conv_input.mesh, filter_shape, conv_input.dtype, name=f"{what}/filter")
    y = _forward(conv_input, w, dy, strides, padding, transpose, what)
    return gradients([y], [w], grad_ys=[dy])[0]


def conv2d_backprop_input(input_shape, conv_filter, dy, strides, padding, name=None) -> Tensor:
    """d(conv2d(x, conv_filter))/dx for upstream ``dy``, x of ``input_shape`` ``[..., h, w, in]``
    (Mesh TF ``mtf.conv2d_backprop_input``, ``tf.nn.conv2d_backprop_input``). Returns ``input_shape``."""
    return _backprop_input(input_shape, conv_filter, dy, strides, padding, 2, False, name)


def conv2d_backprop_filter(conv_input, filter_shape, dy, strides, padding, name=None) -> Tensor:
    """d(conv2d(conv_input, w))/dw for upstream ``dy``, w of ``filter_shape`` ``[fh, fw, in, out]``
    (Mesh TF ``mtf.conv2d_backprop_filter``). Returns ``filter_shape``."""
    return _backprop_filter(conv_input, filter_shape, dy, strides, padding, 2, False, name)


def conv3d_backprop_input(input_shape, conv_filter, dy, strides, padding, name=None) -> Tensor:
    """3-d :func:`conv2d_backprop_input` (Mesh TF ``mtf.conv3d_backprop_input``)."""
    return _backprop_input(input_shape, conv_filter, dy, strides, padding, 3, False, name)


def conv3d_backprop_filter(conv_input, filter_shape, dy, strides, padding, name=None) -> Tensor:
    """3-d :func:`conv2d_backprop_filter` (Mesh TF ``mtf.conv3d_backprop_filter``)."""
    return _backprop_filter(conv_input, filter_shape, dy, strides, padding, 3, False, name)


def conv2d_transpose_backprop_input(input_shape, conv_filter, dy, strides, padding, name=None) -> Tensor:
    """d(conv2d_transpose(x, conv_filter))/dx for upstream ``dy`` (Mesh TF
    ``mtf.conv2d_transpose_backprop_input``); filter ``[fh, fw, out, in]``, x of ``input_shape``."""
    return _backprop_input(input_shape, conv_filter, dy, strides, padding, 2, True, name)


def conv2d_transpose_backprop_filter(conv_input, filter_shape, dy, strides, padding, name=None) -> Tensor:
    """d(conv2d_transpose(conv_input, w))/dw for upstream ``dy`` (Mesh TF
    ``mtf.conv2d_transpose_backprop_filter``). Returns ``filter_shape``."""
    return _backprop_filter(conv_input, filter_shape, dy, strides, padding, 2, True, name)


def conv3d_transpose_backprop_input(input_shape, conv_filter, dy, strides, padding, name=None) -> Tensor:
    """3-d :func:`conv2d_transpose_backprop_input` (Mesh TF ``mtf.conv3d_transpose_backprop_input``)."""
    return _backprop_input(input_shape, conv_filter, dy, strides, padding, 3, True, name)


def conv3d_transpose_backprop_filter(conv_input, filter_shape, dy, strides, padding, name=None) -> Tensor:
    """3-d :func:`conv2d_transpose_backprop_filter` (Mesh TF ``mtf.conv3d_transpose_backprop_filter``)."""
    return _backprop_filter(conv_input, filter_shape, dy, strides, padding, 3, True, name)

"""Convolution layers with filter variables (Mesh TF ``mtf.layers.conv1d/conv2d/conv3d``, ``*_with_blocks``,
``conv2d_transpose``). The ops themselves are :mod:`meshtorch.ops.conv` and :mod:`meshtorch.ops.conv_blocks`.

Filters are variables ``{name}/kernel`` of shape ``[fh, fw, in, out]`` (window dims named ``fd``,
``fh``, ``fw`` as in Mesh TF; ``f`` for 1-d) with no bias, as in Mesh TF. The default initializer
is TF's default for such a variable (Glorot uniform with fan_in = window x in, fan_out = window x
out), which is what Mesh TF's layers get from ``tf.get_variable``.
"""

from __future__ import annotations

from meshtorch.core.dims import Dimension, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.ops.conv import conv, conv_transpose
from meshtorch.ops.conv_blocks import conv_with_blocks, halo_exchange
from meshtorch.ops.initializers import VarianceScalingInitializer
from meshtorch.ops.shape import pad
from meshtorch.ops.variables import get_variable

_WINDOW_NAMES = {1: ["f"], 2: ["fh", "fw"], 3: ["fd", "fh", "fw"]}


def _filter(x: Tensor, in_dim, out_dim, filter_size, name, initializer, dtype, transpose=False) -> Tensor:
    filter_size = [filter_size] if isinstance(filter_size, int) else list(filter_size)
    n = len(filter_size)
    if n not in (1, 2, 3):
        raise ValueError(f"conv layer {name!r}: filter_size must have 1 to 3 entries, got {filter_size}.")
    if in_dim is None:
        in_dim = x.shape[-1]
    else:
        in_name = in_dim if isinstance(in_dim, str) else convert_to_dimension(in_dim).name
        if in_name not in x.shape:
            raise ShapeError(f"conv layer {name!r}: input {x.name!r} {x.shape} has no in-channels dim {in_name!r}.")
        in_dim = x.shape.get_dim_by_name(in_name)
    out_dim = convert_to_dimension(out_dim)
    if out_dim.name in x.shape:
        raise ShapeError(f"conv layer {name!r}: output dim {out_dim.name!r} is already a dim of {x.name!r} {x.shape}.")
    window = [Dimension(nm, int(k)) for nm, k in zip(_WINDOW_NAMES[n], filter_size, strict=True)]
    chans = [out_dim, in_dim] if transpose else [in_dim, out_dim]
    if initializer is None:
        initializer = VarianceScalingInitializer(1.0, "fan_avg", "uniform", reduced_dims=window + [chans[0]],
                                                 new_dims=window + [chans[1]])
    return get_variable(x.mesh, f"{name}/kernel", window + chans, initializer=initializer, dtype=dtype or x.dtype)


def _scope(x: Tensor, name, default):
    return x.graph.unique_name(name or default)


def conv1d(x: Tensor, output_dim, filter_size=3, stride=1, padding="SAME", filter_initializer=None,
           variable_dtype=None, name=None, in_dim=None, spatial_dims=None) -> Tensor:
    """1-d convolution layer: ``x [batch.., length, in]`` -> ``[batch.., length', output_dim]`` (Mesh TF ``conv1d``)."""
    name = _scope(x, name, "conv1d")
    w = _filter(x, in_dim, output_dim, filter_size, name, filter_initializer, variable_dtype)
    return conv(x, w, stride, padding, spatial_dims, name=f"{name}/conv")


def conv2d(x: Tensor, output_dim, filter_size=(3, 3), strides=(1, 1), padding="SAME", filter_initializer=None,
           variable_dtype=None, name=None, in_dim=None, spatial_dims=None) -> Tensor:
    """2-d convolution layer (Mesh TF ``mtf.layers.conv2d``).

    Args:
        x: ``[batch.., h, w, in]`` (``in`` = x's last dim unless ``in_dim`` is given).
        output_dim: Dimension of the output channels.
        filter_size, strides, padding: as :func:`meshtorch.conv2d`.

    Returns:
        x's dims with ``in`` -> ``output_dim`` (spatial dims resized). Variable ``{name}/kernel``
        ``[fh, fw, in, output_dim]``.
    """
    name = _scope(x, name, "conv2d")
    w = _filter(x, in_dim, output_dim, filter_size, name, filter_initializer, variable_dtype)
    return conv(x, w, strides, padding, spatial_dims, name=f"{name}/conv")


def conv3d(x: Tensor, output_dim, filter_size=(3, 3, 3), strides=(1, 1, 1), padding="SAME", filter_initializer=None,
           variable_dtype=None, name=None, in_dim=None, spatial_dims=None) -> Tensor:
    """3-d convolution layer (Mesh TF ``mtf.layers.conv3d``); see :func:`conv2d`."""
    name = _scope(x, name, "conv3d")
    w = _filter(x, in_dim, output_dim, filter_size, name, filter_initializer, variable_dtype)
    return conv(x, w, strides, padding, spatial_dims, name=f"{name}/conv")


def conv2d_with_blocks(x: Tensor, output_dim, filter_size=(3, 3), strides=(1, 1), padding="SAME", h_blocks_dim=None,
                       w_blocks_dim=None, filter_initializer=None, variable_dtype=None, name=None, in_dim=None,
                       spatial_dims=None) -> Tensor:
    """Spatially partitioned 2-d convolution layer (Mesh TF ``mtf.layers.conv2d_with_blocks``).

    ``x [batch, h_blocks, w_blocks, h, w, in]``; the block dims may be split over mesh axes (halo
    exchange, see :func:`meshtorch.conv2d_with_blocks`). Only SAME padding and odd filter sizes.
    """
    name = _scope(x, name, "conv2d_with_blocks")
    w = _filter(x, in_dim, output_dim, filter_size, name, filter_initializer, variable_dtype)
    return conv_with_blocks(x, w, strides, padding, [h_blocks_dim, w_blocks_dim], spatial_dims, name=f"{name}/conv")


def conv3d_with_blocks(x: Tensor, output_dim, filter_size=(3, 3, 3), strides=(1, 1, 1), padding="SAME",
                       d_blocks_dim=None, h_blocks_dim=None, filter_initializer=None, variable_dtype=None, name=None,
                       w_blocks_dim=None, in_dim=None, spatial_dims=None) -> Tensor:
    """Spatially partitioned 3-d convolution layer (Mesh TF ``mtf.layers.conv3d_with_blocks``, whose
    signature has no ``w_blocks_dim``: here it comes after ``name``)."""
    name = _scope(x, name, "conv3d_with_blocks")
    w = _filter(x, in_dim, output_dim, filter_size, name, filter_initializer, variable_dtype)
    return conv_with_blocks(x, w, strides, padding, [d_blocks_dim, h_blocks_dim, w_blocks_dim], spatial_dims,
                            name=f"{name}/conv")


def conv2d_transpose(x: Tensor, output_dim, filter_size=(2, 2), strides=(2, 2), padding="SAME",
                     filter_initializer=None, variable_dtype=None, name=None, in_dim=None,
                     spatial_dims=None) -> Tensor:
    """2-d transposed convolution layer (Mesh TF ``mtf.layers.conv2d_transpose``).

    Variable ``{name}/kernel [fh, fw, output_dim, in]``; output sizes SAME ``in * s``, VALID
    ``(in - 1) * s + k``.
    """
    name = _scope(x, name, "conv2d_transpose")
    w = _filter(x, in_dim, output_dim, filter_size, name, filter_initializer, variable_dtype, transpose=True)
    return conv_transpose(x, w, strides, padding, spatial_dims, name=f"{name}/conv")


def conv3d_transpose(x: Tensor, output_dim, filter_size=(2, 2, 2), strides=(2, 2, 2), padding="SAME",
                     filter_initializer=None, variable_dtype=None, name=None, in_dim=None,
                     spatial_dims=None) -> Tensor:
    """3-d transposed convolution layer (Mesh TF ``mtf.layers.conv3d_transpose``)."""
    name = _scope(x, name, "conv3d_transpose")
    w = _filter(x, in_dim, output_dim, filter_size, name, filter_initializer, variable_dtype, transpose=True)
    return conv_transpose(x, w, strides, padding, spatial_dims, name=f"{name}/conv")


def _transpose_with_blocks(x, output_dim, filter_size, strides, padding, blocks, filter_initializer, variable_dtype,
                           name, layer, what):
    """Mesh TF's ``conv{2,3}d_transpose_with_blocks``: halo-exchange (or zero-pad) each spatial dim by
    ``filter_size // 2 - 1``, then a VALID transposed convolution."""
    if all(b is None for b in blocks):
        return layer(x, output_dim, filter_size, strides, padding, filter_initializer, variable_dtype, name)
    if any(k % 2 for k in filter_size):
        raise ValueError(f"{what}: filter sizes must be even, got {filter_size}.")
    if padding != "SAME":
        raise ValueError(f"{what} requires padding='SAME', got {padding!r}.")
    n = len(filter_size)
    for blocks_dim, size_dim, k in zip(blocks, x.shape.dims[-n - 1:-1], filter_size, strict=True):
        halo = k // 2 - 1
        if halo > 0:
            x = halo_exchange(x, blocks_dim, size_dim, halo) if blocks_dim is not None else \
                pad(x, [halo, halo], size_dim.name)
    return layer(x, output_dim, filter_size, strides, "VALID", filter_initializer, variable_dtype, name)


def conv2d_transpose_with_blocks(x: Tensor, output_dim, filter_size=(2, 2), strides=(2, 2), padding="SAME",
                                 h_blocks_dim=None, w_blocks_dim=None, filter_initializer=None, variable_dtype=None,
                                 name=None) -> Tensor:
    """Spatially partitioned 2-d transposed convolution (Mesh TF ``layers.conv2d_transpose_with_blocks``):
    ``x [batch, h_blocks, w_blocks, h, w, in]``; halo exchange of ``filter_size // 2 - 1`` rows over the
    block dims (zero padding where a block dim is None), then :func:`conv2d_transpose` with VALID padding.
    Even filter sizes, SAME padding only (ValueError otherwise)."""
    return _transpose_with_blocks(x, output_dim, filter_size, strides, padding, [h_blocks_dim, w_blocks_dim],
                                  filter_initializer, variable_dtype, name, conv2d_transpose,
                                  "conv2d_transpose_with_blocks")


def conv3d_transpose_with_blocks(x: Tensor, output_dim, filter_size=(2, 2, 2), strides=(2, 2, 2), padding="SAME",
                                 d_blocks_dim=None, h_blocks_dim=None, filter_initializer=None, variable_dtype=None,
                                 name=None) -> Tensor:
    """3-d :func:`conv2d_transpose_with_blocks` (Mesh TF ``layers.conv3d_transpose_with_blocks``: block dims
    for depth and height only, as there)."""
    return _transpose_with_blocks(x, output_dim, filter_size, strides, padding, [d_blocks_dim, h_blocks_dim, None],
                                  filter_initializer, variable_dtype, name, conv3d_transpose,
                                  "conv3d_transpose_with_blocks")

"""Normalization layers on a named dimension: layer_norm and rms_norm.

Both reduce over ``dim``; if ``dim`` is split over a mesh axis, the means are lazy all-reduces
over that axis (two small all-reduces per call), otherwise they are local.

Low-precision inputs (bfloat16, float16): the statistics (mean, variance or mean square, and the reciprocal
square root) are computed in float32 from a float32 copy of ``x``, and the normalised value is rounded to
``x``'s dtype before the scale is applied, as Hugging Face's ``LlamaRMSNorm`` does and as
``torch.autocast`` runs ``layer_norm`` (float32 list).
"""

from __future__ import annotations

import torch

from meshtorch.core.dims import convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops.initializers import ones_initializer, zeros_initializer
from meshtorch.ops.precision import LOW_PRECISION_DTYPES
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import get_variable


def _dim(x: Tensor, dim, what):
    name = dim if isinstance(dim, str) else convert_to_dimension(dim).name
    if name not in x.shape:
        raise ShapeError(f"{what}: tensor {x.name!r} {x.shape} has no dimension {name!r} to normalize over.")
    return x.shape.get_dim_by_name(name)


def _stats_input(x: Tensor) -> Tensor:
    """``x`` in float32 when it is bfloat16 / float16 (the statistics are computed in float32), else ``x``."""
    return ew.cast(x, torch.float32) if x.dtype in LOW_PRECISION_DTYPES else x


def layer_norm(x: Tensor, dim, epsilon: float = 1e-6, name: str | None = None, use_bias: bool = True) -> Tensor:
    """``(x - mean) / sqrt(var + epsilon) * scale + bias`` over ``dim`` (Ba et al. 2016).

    Matches ``torch.nn.functional.layer_norm(x, [dim], weight=scale, bias=bias, eps=epsilon)``.
    Variables ``{name}/scale`` and ``{name}/bias`` of shape ``[dim]`` (ones / zeros).

    Args:
        x: Tensor ``[..., dim, ...]``, float.
        dim: the Dimension (or name) to normalize over.

    Returns:
        Tensor of x's shape and dtype (statistics in float32 for bfloat16 / float16 ``x``).
    """
    d = _dim(x, dim, "layer_norm")
    name = x.graph.unique_name(name or "layer_norm")
    xs = _stats_input(x)
    mean = reduce_mean(xs, reduced_dim=d.name)
    centered = xs - mean
    var = reduce_mean(ew.square(centered), reduced_dim=d.name)
    y = ew.cast(centered * ew.rsqrt(var + epsilon), x.dtype)
    scale = get_variable(x.mesh, f"{name}/scale", [d], initializer=ones_initializer(), dtype=x.dtype)
    y = y * scale
    if use_bias:
        y = y + get_variable(x.mesh, f"{name}/bias", [d], initializer=zeros_initializer(), dtype=x.dtype)
    return y


def rms_norm(x: Tensor, dim, epsilon: float = 1e-6, name: str | None = None) -> Tensor:
    """``x / sqrt(mean(x**2) + epsilon) * scale`` over ``dim`` (Zhang & Sennrich 2019; T5's layer norm).

    Matches ``torch.nn.functional.rms_norm(x, [dim], weight=scale, eps=epsilon)``. Variable
    ``{name}/scale`` of shape ``[dim]`` (ones). Tensor of x's shape and dtype (statistics in float32 for
    bfloat16 / float16 ``x``).
    """
    d = _dim(x, dim, "rms_norm")
    name = x.graph.unique_name(name or "rms_norm")
    xs = _stats_input(x)
    ms = reduce_mean(ew.square(xs), reduced_dim=d.name)
    scale = get_variable(x.mesh, f"{name}/scale", [d], initializer=ones_initializer(), dtype=x.dtype)
    if xs is x:
        return x * ew.rsqrt(ms + epsilon) * scale
    return ew.cast(xs * ew.rsqrt(ms + epsilon), x.dtype) * scale

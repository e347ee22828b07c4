"""More reductions with Mesh TF's names, as compositions of existing graph ops.

reduce_all, reduce_any, reduce_first, nth_smallest_element, pool_tensor_1d, stride_tensor_1d, and the
string-to-function helpers binary_reduction_fn / reduction_fn (mesh_tensorflow/ops.py; here they
return torch functions). They communicate what the ops they are built from communicate (a
reduction over a split dimension: one all-reduce).
"""

from __future__ import annotations

import torch

from meshtorch.core.dims import Dimension, convert_to_dimension
from meshtorch.core.graph import Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import equal
from meshtorch.ops.reduce import reduce_max, reduce_mean, reduce_min, reduce_sum
from meshtorch.ops.reshape import replace_dimensions
from meshtorch.ops.selection import nth_largest_element
from meshtorch.ops.sequence import mtf_range

__all__ = ["reduce_all", "reduce_any", "reduce_first", "nth_smallest_element", "pool_tensor_1d", "stride_tensor_1d",
           "binary_reduction_fn", "reduction_fn"]


def reduce_all(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None, name=None) -> Tensor:
    """Logical and over ``reduced_dim`` or down to ``output_shape`` (Mesh TF ``mtf.reduce_all``):
    ``cast(reduce_min(to_float(x)), bool)``. Bool output, no gradient."""
    f = ew.cast(x, torch.float32)
    return ew.cast(reduce_min(f, disable_positional_args, output_shape, reduced_dim, name or "reduce_all"), torch.bool)


def reduce_any(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None, name=None) -> Tensor:
    """Logical or over ``reduced_dim`` or down to ``output_shape`` (Mesh TF ``mtf.reduce_any``):
    ``cast(reduce_max(to_float(x)), bool)``. Bool output, no gradient."""
    f = ew.cast(x, torch.float32)
    return ew.cast(reduce_max(f, disable_positional_args, output_shape, reduced_dim, name or "reduce_any"), torch.bool)


def reduce_first(tensor: Tensor, reduced_dim) -> Tensor:
    """The first element along ``reduced_dim`` (Mesh TF ``mtf.reduce_first``): ``x.shape - reduced_dim``.

    Computed as Mesh TF does, ``reduce_sum(x * (range == 0))``: a split ``reduced_dim`` costs one
    all-reduce. The gradient reaches only the first elements.
    """
    reduced_dim = convert_to_dimension(reduced_dim)
    first = ew.cast(equal(mtf_range(tensor.mesh, reduced_dim, dtype=torch.int32), 0), tensor.dtype)
    return reduce_sum(tensor * first, reduced_dim=reduced_dim)


def nth_smallest_element(x: Tensor, n: int, reduced_dim, name=None) -> Tensor:
    """The ``n``-th smallest value along ``reduced_dim``, zero-indexed (Mesh TF ``mtf.nth_smallest_element``):
    ``-nth_largest_element(-x, n, reduced_dim)``. Shape ``x.shape - reduced_dim``."""
    return -nth_largest_element(-x, n, reduced_dim, name=name)


def pool_tensor_1d(tensor: Tensor, pool_dim, reduce_fn=reduce_mean, pool_size=2) -> Tensor:
    """Pool ``pool_dim`` in windows of ``pool_size`` with ``reduce_fn(t, reduced_dim=...)`` (Mesh TF
    ``mtf.pool_tensor_1d``): ``pool_dim`` becomes ``pool_dim.size // pool_size`` long, same name.

    Raises:
        ValueError: if ``pool_size`` does not divide ``pool_dim``.
    """
    pool_dim = convert_to_dimension(pool_dim)
    if pool_dim.size % pool_size:
        raise ValueError(f"pool_tensor_1d: pool_size {pool_size} must divide dimension {pool_dim}.")
    high, low = Dimension(pool_dim.name, pool_dim.size // pool_size), Dimension("_low", pool_size)
    return reduce_fn(replace_dimensions(tensor, pool_dim, [high, low]), reduced_dim=low)


def stride_tensor_1d(tensor: Tensor, pool_dim, pool_size=2) -> Tensor:
    """Every ``pool_size``-th element along ``pool_dim`` (Mesh TF ``mtf.stride_tensor_1d``:
    ``pool_tensor_1d`` with ``reduce_first``)."""
    return pool_tensor_1d(tensor, pool_dim, reduce_fn=reduce_first, pool_size=pool_size)


_BINARY = {"SUM": torch.add, "MAX": torch.maximum, "MIN": torch.minimum}
_REDUCE = {"SUM": torch.sum, "MAX": torch.amax, "MIN": torch.amin}


def binary_reduction_fn(reduction_fn_string: str):
    """``"SUM"`` / ``"MAX"`` / ``"MIN"`` -> torch.add / torch.maximum / torch.minimum (Mesh TF's helper,
    which returns the tf functions). Raises ValueError on another string."""
    if reduction_fn_string not in _BINARY:
        raise ValueError(f"Unknown reduction_fn_string {reduction_fn_string!r}; use SUM, MAX or MIN.")
    return _BINARY[reduction_fn_string]


def reduction_fn(reduction_fn_string: str):
    """``"SUM"`` / ``"MAX"`` / ``"MIN"`` -> torch.sum / torch.amax / torch.amin (``fn(t, dim)``; Mesh TF's
    helper returns tf.reduce_*). Raises ValueError on another string."""
    if reduction_fn_string not in _REDUCE:
        raise ValueError(f"Unknown reduction_fn_string {reduction_fn_string!r}; use SUM, MAX or MIN.")
    return _REDUCE[reduction_fn_string]

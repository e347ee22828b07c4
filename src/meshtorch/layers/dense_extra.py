"""Mesh TF's dense-layer helpers: DenseInitializer, VarianceScalingInitializer (the layers' version),
dense_product, us_einsum / unit_scaling_convention, and separable_conv1d (mesh_tensorflow/layers.py).
"""

from __future__ import annotations

import functools
import math

from meshtorch.core.dims import convert_to_dimension
from meshtorch.core.graph import Tensor
from meshtorch.layers.core import dense, scoped_dense
from meshtorch.ops import activations, binary
from meshtorch.ops import elementwise as ew
from meshtorch.ops.einsum import einsum
from meshtorch.ops.initializers import RandomUniform, TruncatedNormal
from meshtorch.ops.sequence import shift

__all__ = ["DenseInitializer", "VarianceScalingInitializer", "dense_product", "scoped_dense_product",
           "unit_scaling_convention", "us_einsum", "separable_conv1d"]


class DenseInitializer:
    """An initializer for :func:`~meshtorch.layers.dense`: called as ``init(reduced_dims, new_dims)`` it
    returns a variable initializer (Mesh TF ``layers.DenseInitializer``)."""

    def __call__(self, reduced_dims, new_dims):
        raise NotImplementedError


class VarianceScalingInitializer(DenseInitializer):
    """Mesh TF ``layers.VarianceScalingInitializer``: stddev ``sqrt(scale / n)``, ``n`` = fan_in (product
    of ``reduced_dims``), fan_out (``new_dims``) or their mean; ``"normal"`` draws a truncated normal with
    that stddev (``tf.truncated_normal_initializer``, no variance correction, as Mesh TF), ``"uniform"``
    a uniform on ``[-sqrt(3) stddev, +sqrt(3) stddev]``.

    Raises:
        ValueError: on another mode or distribution (when called).
    """

    def __init__(self, scale=1.0, mode="fan_in", distribution="normal"):
        self.scale, self.mode, self.distribution = scale, mode.lower(), distribution.lower()

    def __call__(self, reduced_dims, new_dims):
        fan_in = math.prod(convert_to_dimension(d).size for d in reduced_dims)
        fan_out = math.prod(convert_to_dimension(d).size for d in new_dims)
        n = {"fan_in": max(1.0, fan_in), "fan_out": max(1.0, fan_out),
             "fan_avg": max(1.0, (fan_in + fan_out) / 2)}.get(self.mode)
        if n is None:
            raise ValueError(f"Invalid `mode` argument: expected one of fan_in, fan_out, fan_avg, got {self.mode!r}.")
        stddev = (self.scale / n) ** 0.5
        if self.distribution == "normal":
            return TruncatedNormal(0.0, stddev)
        if self.distribution == "uniform":
            return RandomUniform(-stddev * 3 ** 0.5, stddev * 3 ** 0.5)
        raise ValueError(f"Invalid `distribution` argument: expected normal or uniform, got {self.distribution!r}.")


def unit_scaling_convention(value=False):
    """Mesh TF's gin switch for the unit-scaling convention; without gin it returns ``value`` (False)."""
    return value


def us_einsum(xs, *args, **kwargs) -> Tensor:
    """``einsum(xs, ...)``, times ``size(reduced dims) ** -0.5`` under the unit-scaling convention (off
    without gin, so plain einsum; Mesh TF ``layers.us_einsum``)."""
    y = einsum(xs, *args, **kwargs)
    if unit_scaling_convention():
        reduced = {d for x in xs for d in x.shape.dims if d not in y.shape.dims}
        y = y * math.prod(d.size for d in reduced) ** -0.5
    return y


def dense_product(x: Tensor, reduced_dims, new_dims, activation_functions=None, name="dense_product",
                  **kwargs) -> Tensor:
    """The elementwise product of one :func:`dense` per activation (Mesh TF ``layers.dense_product``; a GLU
    with ``["sigmoid", "linear"]``). Activations: functions, mtf function names, "linear" or None.

    Variables: ``{name}_{i}/kernel`` (``{name}/kernel`` for one factor); ``kwargs`` go to :func:`dense`.

    Raises:
        ValueError: for an activation name that is not an mtf function.
    """
    return dense_factors(dense, x, reduced_dims, new_dims, product_factors(activation_functions, name), kwargs)


def scoped_dense_product(x: Tensor, reduced_dims, new_dims, activation_functions=None, name="dense_product",
                         **kwargs) -> Tensor:
    """:func:`dense_product` built from :func:`~meshtorch.layers.core.scoped_dense` (Mesh TF's variable scopes:
    ``{name}_{i}/kernel`` under the current scope, reused by a second call); what ``mtf.transformer`` calls."""
    factors = product_factors(activation_functions, name)
    return dense_factors(scoped_dense, x, reduced_dims, new_dims, factors, kwargs)


def _activation(act):
    """A function (or None for ``"linear"`` / None) from an activation given as a function or an mtf name."""
    if act is None or act == "linear":
        return None
    if not isinstance(act, str):
        return act
    fn = getattr(activations, act, None) or getattr(ew, act, None)
    if not callable(fn):
        raise ValueError(f"dense_product: activation {act!r} is not an mtf function (e.g. relu, gelu, sigmoid, "
                         "tanh, swish, or pass a function).")
    return fn


def product_factors(activation_functions, name: str) -> list:
    """``dense_product``'s ``(name, activation)`` per factor: ``{name}_{i}``, or ``name`` for one."""
    acts = activation_functions if isinstance(activation_functions, list) else [activation_functions]
    return [(f"{name}_{i}" if len(acts) > 1 else name, act) for i, act in enumerate(acts)]


def dense_factors(dense_fn, x: Tensor, reduced_dims, new_dims, factors, kwargs) -> Tensor:
    """``prod_i dense_fn(x, name=name_i, activation=act_i)`` over ``factors`` ``[(name_i, act_i)]`` (an activation
    as :func:`dense_product` takes it), multiplied left to right: the input half of every feed-forward layer
    (a GLU with two factors). ``dense_fn`` is :func:`dense` or ``scoped_dense``; ``kwargs`` go to it."""
    out = [dense_fn(x, reduced_dims=reduced_dims, new_dims=new_dims, activation=_activation(act), name=n, **kwargs)
           for n, act in factors]
    return functools.reduce(binary.multiply, out)


def separable_conv1d(x: Tensor, output_dim, min_relative_pos=-1, max_relative_pos=1,
                     depthwise_filter_initializer_scale=1.0, pointwise_filter_initializer_scale=1.0, name=None,
                     use_bias=True, kernel_depth_weights=None) -> Tensor:
    """Depthwise 1-d convolution over ``length`` (x's second-last dim) then a pointwise dense (Mesh TF
    ``layers.separable_conv1d``).

    The depthwise part is Mesh TF's: for each relative position ``p`` in ``[min, max]`` a per-channel
    weight ``{name}/depthwise_dense_{i}/kernel [depth]`` times ``shift(x, -p, length)`` (zero-filled),
    a bias ``[depth]`` on the first; then ``{name}/pointwise_dense`` maps ``depth`` to ``output_dim``.

    Returns:
        x's shape with the last dim (depth) replaced by ``output_dim``.
    """
    depth_dim, length_dim = x.shape.dims[-1], x.shape.dims[-2]
    scope = x.graph.unique_name(name or "separable_conv1d")
    size = max_relative_pos - min_relative_pos + 1
    ret = None
    for i in range(size):
        shifted = shift(x, -(min_relative_pos + i), length_dim, wrap=False)
        term = dense(shifted, new_dims=[], reduced_dims=[], expert_dims=[depth_dim],
                     kernel_weights=kernel_depth_weights[i] if kernel_depth_weights else None,
                     name=f"{scope}/depthwise_dense_{i}", use_bias=use_bias and i == 0,
                     kernel_initializer=VarianceScalingInitializer(scale=depthwise_filter_initializer_scale / size))
        ret = term if ret is None else ret + term
    pointwise = VarianceScalingInitializer(scale=pointwise_filter_initializer_scale)
    return dense(ret, new_dims=[output_dim], reduced_dims=[depth_dim], name=f"{scope}/pointwise_dense",
                 use_bias=use_bias, kernel_initializer=pointwise)

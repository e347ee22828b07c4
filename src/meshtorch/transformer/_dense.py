"""Mesh TF's ``mtf.layers.dense`` / ``dense_product`` as the transformer package calls them.

Kept here so the transformer layers get Mesh TF's variable names (``{name}/kernel``,
``{name}/bias`` inside ``variable_scope(name)``, ``dense_product``'s ``{name}_{i}`` for several
factors) and its initialiser (variance scaling, scale 1, fan-in over ``reduced_dims``, normal)
whatever ``mtf.layers.dense``'s own naming does.
"""

from __future__ import annotations

import functools

from meshtorch.transformer import _mtf as mtf

_ACTIVATIONS = {"relu": mtf.relu, "gelu": mtf.gelu, "sigmoid": mtf.sigmoid, "tanh": mtf.tanh}


def dense(x, new_dims, reduced_dims=None, expert_dims=None, use_bias=True, activation=None, variable_dtype=None,
          kernel_initializer=None, name=None):
    """``activation(einsum(x, kernel) + bias)`` (Mesh TF ``mtf.layers.dense``).

    Args:
        x: ``[..., reduced_dims]``.
        new_dims: Dimension or list of Dimensions.
        reduced_dims: dims of x contracted (default its last).
        expert_dims: optional leading dims of the kernel (one kernel per expert / ensemble member).
        use_bias: add ``bias`` ``[expert_dims + new_dims]`` (zeros).
        activation: None or a function Tensor -> Tensor.
        variable_dtype: VariableDType or torch dtype (default x's dtype).
        kernel_initializer: default variance scaling (fan-in, normal).
        name: variable scope (default a unique ``dense``, ``dense_1``, ...).

    Returns:
        ``[x's other dims, new_dims]``. Variables ``{name}/kernel`` ``[expert_dims + reduced_dims + new_dims]``.
    """
    new_dims = new_dims if isinstance(new_dims, list) else [new_dims]
    expert_dims = expert_dims or []
    reduced_dims = list(reduced_dims) if reduced_dims is not None else x.shape.dims[-1:]
    for i, d in enumerate(reduced_dims):  # Mesh TF: rename a reduced dim that a new dim also names
        if d in new_dims:
            tmp = mtf.Dimension("_" + d.name, d.size)
            x = mtf.rename_dimension(x, d.name, tmp.name)
            reduced_dims[i] = tmp
    output_shape = mtf.Shape([d for d in x.shape.dims if d not in reduced_dims] + new_dims)
    vd = variable_dtype if variable_dtype is not None else x.dtype
    with mtf.variable_scope(name, default_name="dense"):
        init = kernel_initializer or mtf.VarianceScalingInitializer(1.0, "fan_in", "normal", reduced_dims, new_dims)
        w = mtf.get_variable(x.mesh, "kernel", mtf.Shape(expert_dims + reduced_dims + new_dims), initializer=init,
                             dtype=vd)
        w = mtf.cast(w, x.dtype)
        y = mtf.einsum([x, w], output_shape)
        if use_bias:
            b = mtf.get_variable(x.mesh, "bias", mtf.Shape(expert_dims + new_dims),
                                 initializer=mtf.zeros_initializer(), dtype=vd)
            y += b
        if activation is not None:
            y = activation(y)
        return y


def dense_product(x, reduced_dims, new_dims, activation_functions=None, name="dense_product", **kwargs):
    """Elementwise product of dense layers, one per activation (Mesh TF ``mtf.layers.dense_product``).

    ``activation_functions``: one or a list of: a function, a name (``"relu"``, ``"gelu"``,
    ``"sigmoid"``, ``"tanh"``), or None / ``"linear"``. Several factors are named ``{name}_{i}``.

    Raises:
        ValueError: for an unknown activation name.
    """
    if not isinstance(activation_functions, list):
        activation_functions = [activation_functions]
    num_factors = len(activation_functions)
    factors = []
    for i, activation in enumerate(activation_functions):
        if activation == "linear":
            activation = None
        elif isinstance(activation, str):
            if activation not in _ACTIVATIONS:
                raise ValueError(f"dense_product: activation {activation!r} is not one of {sorted(_ACTIVATIONS)} "
                                 "(or pass a function).")
            activation = _ACTIVATIONS[activation]
        factors.append(dense(x, reduced_dims=reduced_dims, new_dims=new_dims, activation=activation,
                             name=f"{name}_{i}" if num_factors > 1 else name, **kwargs))
    return functools.reduce(mtf.multiply, factors)

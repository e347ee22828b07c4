"""Dense layer and softmax cross-entropy (Mesh TF ``mtf.layers.dense`` / ``softmax_cross_entropy_with_logits``)."""

from __future__ import annotations

from meshtorch.core.dims import Shape, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.ops import binary, reduce
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast, square
from meshtorch.ops.initializers import VarianceScalingInitializer, zeros_initializer
from meshtorch.ops.variables import get_variable


def _dims(x):
    if x is None:
        return None
    if isinstance(x, list | tuple) and not (len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], int)):
        return [convert_to_dimension(d) for d in x]
    return [convert_to_dimension(x)]


def dense(x: Tensor, new_dims, reduced_dims=None, use_bias=True, activation=None, name=None,
          kernel_initializer=None, variable_dtype=None) -> Tensor:
    """Fully connected layer: ``activation(einsum(x, kernel) + bias)``.

    Args:
        x: Tensor ``[..., reduced_dims]``.
        new_dims: Dimension or list: the output dims.
        reduced_dims: dims of x to contract (default: x's last dim).
        use_bias: add a bias of shape ``new_dims`` (zeros-initialised).
        activation: optional function Tensor -> Tensor (e.g. ``mtf.relu``).
        name: variable scope; the variables are ``{name}/kernel`` ``[reduced_dims + new_dims]`` and
            ``{name}/bias`` ``[new_dims]``.
        kernel_initializer: default variance scaling (scale 1, fan_in over ``reduced_dims``,
            normal), as Mesh TF.
        variable_dtype: dtype of the variables (default x's dtype).

    Returns:
        Tensor ``[x's other dims..., new_dims]``.
    """
    new_dims = _dims(new_dims)
    reduced_dims = _dims(reduced_dims) if reduced_dims is not None else [x.shape[-1]]
    for d in reduced_dims:
        if d not in x.shape.dims:
            raise ShapeError(f"dense {name!r}: reduced dim {d} is not in input {x.name!r} {x.shape}.")
    for d in new_dims:
        if d.name in x.shape:
            raise ShapeError(f"dense {name!r}: new dim {d.name!r} is already a dim of {x.name!r} {x.shape}; "
                             "choose another name.")
    graph = x.graph
    name = graph.unique_name(name or "dense")
    dtype = variable_dtype or x.dtype
    init = kernel_initializer or VarianceScalingInitializer(reduced_dims=reduced_dims, new_dims=new_dims)
    w = get_variable(x.mesh, f"{name}/kernel", Shape(reduced_dims + new_dims), initializer=init, dtype=dtype)
    out_shape = (x.shape - [d.name for d in reduced_dims]) + new_dims
    y = einsum([x, w], output_shape=out_shape, name=f"{name}/einsum")
    if use_bias:
        b = get_variable(x.mesh, f"{name}/bias", Shape(new_dims), initializer=zeros_initializer(), dtype=dtype)
        y = binary.add(y, b, name=f"{name}/add_bias")
    if activation is not None:
        y = activation(y)
    return y


def softmax_cross_entropy_with_logits(logits: Tensor, targets: Tensor, vocab_dim, z_loss: float = 0.0,
                                      name=None) -> Tensor:
    """Per-example cross entropy ``logsumexp(logits) - sum(targets * logits)`` over ``vocab_dim``.

    Args:
        logits: ``[..., vocab_dim]`` float.
        targets: same shape: a probability distribution per example (e.g. ``mtf.one_hot``).
        vocab_dim: the class dimension (may be split: one lazy all-reduce per sum).
        z_loss: coefficient of the auxiliary loss ``z_loss * logsumexp(logits)**2`` (Mesh TF).

    Returns:
        Tensor ``logits.shape - vocab_dim``.

    Raises:
        ShapeError: if the shapes differ or lack ``vocab_dim``.
    """
    vocab_dim = vocab_dim if isinstance(vocab_dim, str) else convert_to_dimension(vocab_dim).name
    if vocab_dim not in logits.shape:
        raise ShapeError(f"softmax_cross_entropy_with_logits: logits {logits.name!r} {logits.shape} have no "
                         f"dimension {vocab_dim!r}.")
    if set(logits.shape.dimension_names) != set(targets.shape.dimension_names):
        raise ShapeError(f"softmax_cross_entropy_with_logits: logits {logits.shape} and targets {targets.shape} "
                         "must have the same dims.")
    if targets.dtype != logits.dtype:
        targets = cast(targets, logits.dtype)
    lse = reduce.reduce_logsumexp(logits, vocab_dim)
    loss = binary.subtract(lse, reduce.reduce_sum(binary.multiply(logits, targets), vocab_dim), name=name)
    if z_loss:
        loss = loss + square(lse) * z_loss
    return loss


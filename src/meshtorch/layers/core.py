"""Dense layer and softmax cross-entropy (Mesh TF ``mtf.layers.dense`` / ``softmax_cross_entropy_with_logits``)."""

from __future__ import annotations

from meshtorch.core.dims import Shape, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.ops import binary, reduce
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast, negative, square
from meshtorch.ops.indexing import one_hot
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
    """Per-example softmax cross entropy over ``vocab_dim`` (Mesh TF ``mtf.layers.softmax_cross_entropy_with_logits``).

    ``loss = -sum_vocab(targets * (logits - logsumexp(logits)))`` plus, if ``z_loss`` is nonzero,
    ``z_loss * logsumexp(logits)**2`` (Mesh TF's formula literally, so soft targets that do not sum
    to one give Mesh TF's numbers too).

    Args:
        logits: ``[..., vocab_dim]`` float.
        targets: hard targets: an integer Tensor with the dims of ``logits`` other than
            ``vocab_dim`` (class ids in ``[0, vocab_dim.size)``; one-hot encoded here, in the logits'
            dtype), or soft targets: a float Tensor with exactly the dims of ``logits``.
        vocab_dim: the class Dimension (or its name); may be split over a mesh axis (each sum is
            then one lazy all-reduce).
        z_loss: coefficient of the auxiliary loss on ``logsumexp(logits)**2`` (e.g. 1e-4).
        name: optional name of the result op.

    Returns:
        Tensor ``logits.shape - vocab_dim``, the logits' dtype.

    Raises:
        ShapeError: if ``vocab_dim`` is not a dim of ``logits``; if hard targets' dims are not the
            logits' dims minus ``vocab_dim``; if soft targets' dims differ from the logits'.
    """
    vname = vocab_dim if isinstance(vocab_dim, str) else convert_to_dimension(vocab_dim).name
    if vname not in logits.shape:
        raise ShapeError(f"softmax_cross_entropy_with_logits: logits {logits.name!r} {logits.shape} have no "
                         f"dimension {vname!r} (vocab_dim).")
    vdim = logits.shape.get_dim_by_name(vname)
    if not targets.dtype.is_floating_point:
        want = set(logits.shape.dimension_names) - {vname}
        if set(targets.shape.dimension_names) != want:
            raise ShapeError(f"softmax_cross_entropy_with_logits: hard (integer) targets {targets.name!r} "
                             f"{targets.shape} must have the logits' dims other than {vname!r}: {sorted(want)} "
                             f"(logits {logits.shape}).")
        targets = one_hot(targets, vdim, dtype=logits.dtype)
    elif set(logits.shape.dimension_names) != set(targets.shape.dimension_names):
        raise ShapeError(f"softmax_cross_entropy_with_logits: soft targets {targets.name!r} {targets.shape} must "
                         f"have the same dims as the logits {logits.shape} (or pass integer class ids).")
    elif targets.dtype != logits.dtype:
        targets = cast(targets, logits.dtype)
    log_z = reduce.reduce_logsumexp(logits, vname)
    log_softmax = binary.subtract(logits, log_z)
    loss = negative(reduce.reduce_sum(binary.multiply(log_softmax, targets), vname), name=None if z_loss else name)
    if z_loss:
        loss = binary.add(loss, square(log_z) * z_loss, name=name)
    return loss

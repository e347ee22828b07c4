"""Dense layer and softmax cross-entropy (Mesh TF ``mtf.layers.dense`` / ``softmax_cross_entropy_with_logits``)."""

from __future__ import annotations

from meshtorch.core.dims import Dimension, Shape, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.core.scopes import variable_scope
from meshtorch.ops import binary, reduce
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast, negative, square
from meshtorch.ops.initializers import Initializer, VarianceScalingInitializer, zeros_initializer
from meshtorch.ops.precision import VariableDType
from meshtorch.ops.reshape import rename_dimension
from meshtorch.ops.variables import get_variable
from meshtorch.ops.xent import sparse_softmax_cross_entropy_with_logits


def _dims(x):
    if x is None:
        return None
    if isinstance(x, list | tuple) and not (len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], int)):
        return [convert_to_dimension(d) for d in x]
    return [convert_to_dimension(x)]


def dense(x: Tensor, new_dims, reduced_dims=None, expert_dims=None, use_bias=True, activation=None,
          master_dtype=None, slice_dtype=None, variable_dtype=None, kernel_initializer=None, kernel_weights=None,
          name=None) -> Tensor:
    """Fully connected layer: ``activation(einsum(x, kernel) + bias)`` (Mesh TF ``layers.dense``).

    Args:
        x: Tensor ``[..., reduced_dims]``.
        new_dims: Dimension or list: the output dims.
        reduced_dims: dims of x to contract (default: x's last dim). A reduced dim that is also a new
            dim is renamed ``_<name>`` first (Mesh TF).
        expert_dims: leading dims of the kernel and bias (one kernel per expert; Mesh TF).
        use_bias: add a bias of shape ``new_dims`` (zeros-initialised).
        activation: optional function Tensor -> Tensor (e.g. ``mtf.relu``).
        name: variable scope; the variables are ``{name}/kernel`` ``[reduced_dims + new_dims]`` and
            ``{name}/bias`` ``[new_dims]``.
        kernel_initializer: default variance scaling (scale 1, fan_in over ``reduced_dims``,
            normal), as Mesh TF; a :class:`~meshtorch.layers.dense_extra.DenseInitializer` is called
            with ``(reduced_dims, new_dims)``.
        master_dtype, slice_dtype, variable_dtype: the variables' dtypes. Default x's dtype (Mesh TF
            defaults master and slice dtypes to float32; the same for float32 activations).
        kernel_weights: an existing kernel ``[expert_dims + reduced_dims + new_dims]`` to use instead.

    Returns:
        Tensor ``[x's other dims..., new_dims]``.
    """
    name = x.graph.unique_name(name or "dense")
    dtype = _variable_dtype(x, master_dtype, slice_dtype, variable_dtype)
    return _dense(x, new_dims, reduced_dims, expert_dims, use_bias, activation, dtype, kernel_initializer,
                  kernel_weights, f"{name}/", name)


def scoped_dense(x: Tensor, new_dims, reduced_dims=None, expert_dims=None, use_bias=True, activation=None,
                 variable_dtype=None, kernel_initializer=None, name=None) -> Tensor:
    """:func:`dense` named as Mesh TF names it: ``kernel`` and ``bias`` inside
    ``variable_scope(name, default_name="dense")`` (Mesh TF ``mtf.layers.dense``'s own ``tf.variable_scope``).

    A second call with the same name in the same variable scope reuses the variables (decoding loops,
    shared layers), where :func:`dense` makes the name unique in the graph. ``mtf.transformer`` builds its
    layers with it; the arithmetic, the initialiser and the errors are :func:`dense`'s.
    """
    with variable_scope(name, default_name="dense"):
        dtype = variable_dtype if variable_dtype is not None else x.dtype
        return _dense(x, new_dims, reduced_dims, expert_dims, use_bias, activation, dtype, kernel_initializer,
                      None, "", None)


def _dense(x, new_dims, reduced_dims, expert_dims, use_bias, activation, dtype, kernel_initializer, kernel_weights,
           prefix: str, name):
    """The one dense layer: variables ``{prefix}kernel`` / ``{prefix}bias`` (scoped by ``get_variable``), ops
    named under ``name`` (None: default op names)."""
    new_dims = _dims(new_dims)
    expert_dims = _dims(expert_dims) or []
    reduced_dims = list(_dims(reduced_dims)) if reduced_dims is not None else [x.shape[-1]]
    for d in reduced_dims:
        if d not in x.shape.dims:
            raise ShapeError(f"dense {name or prefix!r}: reduced dim {d} is not in input {x.name!r} {x.shape}.")
    for i, d in enumerate(reduced_dims):
        if d in new_dims:  # Mesh TF: contract a renamed copy
            reduced_dims[i] = Dimension("_" + d.name, d.size)
            x = rename_dimension(x, d.name, "_" + d.name)
    for d in new_dims:
        if d.name in x.shape:
            raise ShapeError(f"dense {name or prefix!r}: new dim {d.name!r} is already a dim of {x.name!r} "
                             f"{x.shape}; choose another name.")
    w = kernel_weights
    if w is None:
        w = _kernel(x, new_dims, reduced_dims, expert_dims, kernel_initializer, f"{prefix}kernel", dtype)
    out_shape = (x.shape - [d.name for d in reduced_dims]) + [d for d in new_dims if d.name not in x.shape]
    y = einsum([x, w], output_shape=out_shape, name=name and f"{name}/einsum")
    if use_bias:
        b = get_variable(x.mesh, f"{prefix}bias", Shape(expert_dims + new_dims), initializer=zeros_initializer(),
                         dtype=dtype)
        y = binary.add(y, b, name=name and f"{name}/add_bias")
    if activation is not None:
        y = activation(y)
    return y


def _variable_dtype(x, master_dtype, slice_dtype, variable_dtype):
    if variable_dtype is not None:
        return variable_dtype
    if master_dtype is None and slice_dtype is None:
        return x.dtype
    return VariableDType(master_dtype or x.dtype, slice_dtype or master_dtype or x.dtype, x.dtype)


def get_dense_kernel_weights(x: Tensor, new_dims, reduced_dims, expert_dims, kernel_initializer, name=None,
                             variable_dtype=None, master_dtype=None, slice_dtype=None) -> Tensor:
    """The kernel variable ``{name}/kernel`` ``[expert_dims + reduced_dims + new_dims]`` of :func:`dense`,
    in x's dtype (Mesh TF ``layers.get_dense_kernel_weights``; ``name`` is used as given)."""
    new_dims, reduced_dims, expert_dims = _dims(new_dims), _dims(reduced_dims), _dims(expert_dims) or []
    dtype = _variable_dtype(x, master_dtype, slice_dtype, variable_dtype)
    return _kernel(x, new_dims, reduced_dims, expert_dims, kernel_initializer, f"{name or 'dense'}/kernel", dtype)


def _kernel(x, new_dims, reduced_dims, expert_dims, kernel_initializer, var_name: str, dtype) -> Tensor:
    init = kernel_initializer
    if init is None:
        init = VarianceScalingInitializer(reduced_dims=reduced_dims, new_dims=new_dims)
    elif callable(init) and not isinstance(init, Initializer):  # a DenseInitializer
        init = init(reduced_dims, new_dims)
    w = get_variable(x.mesh, var_name, Shape(expert_dims + reduced_dims + new_dims), initializer=init, dtype=dtype)
    return w if w.dtype == x.dtype else cast(w, x.dtype)


def softmax_cross_entropy_with_logits(logits: Tensor, targets: Tensor, vocab_dim, z_loss: float = 0.0,
                                      name=None) -> Tensor:
    """Per-example softmax cross entropy over ``vocab_dim`` (Mesh TF ``mtf.layers.softmax_cross_entropy_with_logits``).

    ``loss = -sum_vocab(targets * (logits - logsumexp(logits)))`` plus, if ``z_loss`` is nonzero,
    ``z_loss * logsumexp(logits)**2`` (Mesh TF's formula literally, so soft targets that do not sum
    to one give Mesh TF's numbers too).

    Args:
        logits: ``[..., vocab_dim]`` float.
        targets: hard targets: an integer Tensor with the dims of ``logits`` other than
            ``vocab_dim`` (class ids in ``[0, vocab_dim.size)``; computed without a one-hot tensor by
            :func:`meshtorch.ops.xent.sparse_softmax_cross_entropy_with_logits`, the same numbers), or soft
            targets: a float Tensor with exactly the dims of ``logits``.
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
        return sparse_softmax_cross_entropy_with_logits(logits, targets, vdim, z_loss=z_loss, name=name)
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

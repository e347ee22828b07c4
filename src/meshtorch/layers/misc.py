"""Mesh TF layers built from existing ops: pooling with Mesh TF's signatures, batch_norm, sigmoid cross
entropy, Pearson correlation, compress_mean, multiplicative_jitter, clip_activation_gradient,
annealed_dropout, reversible_half_residual_and_swap, embedding_weights and the local-attention biases
(mesh_tensorflow/layers.py). Each is a composition of graph ops; see each docstring for the source.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.autodiff import recompute_grad
from meshtorch.core.dims import Dimension, Shape, convert_to_dimension, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import less, maximum, minimum
from meshtorch.ops.control import custom_gradient
from meshtorch.ops.einsum import einsum
from meshtorch.ops.initializers import ones_initializer, random_normal_initializer, zeros_initializer
from meshtorch.ops.pool import pool
from meshtorch.ops.random import random_uniform
from meshtorch.ops.reduce import reduce_mean, reduce_sum
from meshtorch.ops.reshape import rename_dimension, reshape
from meshtorch.ops.sequence import mtf_range
from meshtorch.ops.shape import concat
from meshtorch.ops.variables import assign, get_variable, zeros, zeros_like
from meshtorch.optim.base import get_or_create_global_step

__all__ = ["max_pool2d", "max_pool3d", "avg_pool2d", "avg_pool3d", "batch_norm", "sigmoid_cross_entropy_with_logits",
           "corr", "compress_mean", "multiplicative_jitter", "clip_activation_gradient", "annealed_dropout",
           "reversible_half_residual_and_swap", "embedding_weights", "attention_bias_local_block"]


def _pool(x, ksize, kind, name):
    ksize = tuple(ksize)
    if all(k == 1 for k in ksize):
        return x
    return pool(x, kind, list(ksize), strides=list(ksize), padding="VALID", name=name)


def max_pool2d(x: Tensor, ksize=(2, 2), name="max_pool2d") -> Tensor:
    """2-d max pooling of ``x [..., h, w, c]`` with stride = ``ksize``, VALID (Mesh TF ``layers.max_pool2d``)."""
    return _pool(x, ksize, "MAX", name)


def max_pool3d(x: Tensor, ksize=(2, 2, 2), name="max_pool3d") -> Tensor:
    """3-d max pooling of ``x [..., d, h, w, c]`` (Mesh TF ``layers.max_pool3d``)."""
    return _pool(x, ksize, "MAX", name)


def avg_pool2d(x: Tensor, ksize=(2, 2), name="avg_pool2d") -> Tensor:
    """2-d average pooling of ``x [..., h, w, c]`` (Mesh TF ``layers.avg_pool2d``)."""
    return _pool(x, ksize, "AVG", name)


def avg_pool3d(x: Tensor, ksize=(2, 2, 2), name="avg_pool3d") -> Tensor:
    """3-d average pooling of ``x [..., d, h, w, c]`` (Mesh TF ``layers.avg_pool3d``)."""
    return _pool(x, ksize, "AVG", name)


def batch_norm(x: Tensor, is_training, momentum, epsilon=1e-9, dims_idx_start=0, dims_idx_end=-1, init_zero=False,
               name=None):
    """Batch normalisation over ``x.shape.dims[dims_idx_start:dims_idx_end]`` (Mesh TF ``layers.batch_norm``).

    Variables (shape: x's other dims) ``{name}/batch_norm_scale`` (ones, or zeros with ``init_zero``),
    ``/batch_norm_bias`` (zeros), non-trainable ``/bn_moving_mean`` (normal(0, 1), as Mesh TF) and
    ``/bn_moving_variance`` (ones).

    Returns:
        ``(y, update_ops)``: ``y`` of x's shape; in training the batch statistics normalise and
        ``update_ops`` (fetch them) move the moving averages by ``momentum``; otherwise the moving
        statistics normalise and ``update_ops`` is empty.
    """
    scope = x.graph.unique_name(name or "batch_norm")
    norm_dims = x.shape.dims[dims_idx_start:dims_idx_end]
    reduced_shape = x.shape - [d.name for d in norm_dims]

    def var(n, init, trainable=True):
        return get_variable(x.mesh, f"{scope}/{n}", reduced_shape, initializer=init, dtype=x.dtype,
                            trainable=trainable)

    scale = var("batch_norm_scale", zeros_initializer() if init_zero else ones_initializer())
    bias = var("batch_norm_bias", zeros_initializer())
    moving_mean = var("bn_moving_mean", random_normal_initializer(stddev=1.0), trainable=False)
    moving_variance = var("bn_moving_variance", ones_initializer(), trainable=False)
    if is_training:
        mean = reduce_mean(x, output_shape=reduced_shape)
        variance = reduce_mean(ew.square(x - mean), output_shape=reduced_shape)
        norm_x = (x - mean) * ew.rsqrt(variance + epsilon)
        ops = [assign(moving_mean, moving_mean * momentum + mean * (1 - momentum), name=f"{scope}/bn_mean_update"),
               assign(moving_variance, moving_variance * momentum + variance * (1 - momentum),
                      name=f"{scope}/bn_var_update")]
    else:
        norm_x = (x - moving_mean) * ew.rsqrt(moving_variance + epsilon)
        ops = []
    return norm_x * scale + bias, ops


def sigmoid_cross_entropy_with_logits(logits: Tensor, targets: Tensor) -> Tensor:
    """``relu(x) - x z + log(1 + exp(-|x|))`` elementwise (Mesh TF / ``tf.nn.sigmoid_cross_entropy_with_logits``).

    Raises:
        ShapeError: if the shapes differ.
    """
    if logits.shape != targets.shape:
        raise ShapeError(f"sigmoid_cross_entropy_with_logits: logits shape {logits.shape} must equal targets shape "
                         f"{targets.shape}.")
    x, z = logits, targets
    return ew.relu(x) - x * z + ew.log(ew.exp(-ew.abs(x)) + 1.0)


def corr(x: Tensor, dim, epsilon=1e-20, name="pearson_correlation") -> Tensor:
    """Pearson correlation matrix between the entries of ``dim`` over x's other dims (Mesh TF ``layers.corr``).

    Returns ``[dim_1, dim_2]`` (``dim`` renamed twice; ``dim`` must be x's last dim, as Mesh TF assumes).
    """
    dim = convert_to_dimension(dim)
    c = x - reduce_mean(x, output_shape=[dim])
    x1, x2 = rename_dimension(c, dim.name, f"{dim.name}_1"), rename_dimension(c, dim.name, f"{dim.name}_2")

    def norm(z):
        return ew.sqrt(reduce_sum(ew.square(z), output_shape=z.shape.dims[-1:])) + epsilon
    d1, d2 = x1.shape.dims[-1], x2.shape.dims[-1]
    cov = einsum([x1, x2], output_shape=[d1, d2])
    return cov / einsum([norm(x1), norm(x2)], output_shape=[d1, d2])


def compress_mean(x: Tensor, dim, compression_factor) -> Tensor:
    """Mean over windows of ``compression_factor`` along ``dim`` (Mesh TF ``layers.compress_mean``):
    ``dim`` becomes ``dim.size // compression_factor`` long, same name."""
    dim = convert_to_dimension(dim)
    dims = x.shape.dims
    pos = dims.index(dim)
    factor = Dimension("compression_factor", compression_factor)
    new_shape = dims[:pos] + [Dimension(dim.name, dim.size // compression_factor), factor] + dims[pos + 1:]
    return reduce_mean(reshape(x, new_shape), reduced_dim=factor)


def multiplicative_jitter(x: Tensor, epsilon=1e-2) -> Tensor:
    """``x * uniform(1 - epsilon, 1 + epsilon)`` (Mesh TF ``layers.multiplicative_jitter``; the noise is
    layout-independent)."""
    if epsilon == 0:
        return x
    return x * random_uniform(x.mesh, x.shape, minval=1.0 - epsilon, maxval=1.0 + epsilon, dtype=x.dtype)


def _clip_grad_fn(inputs, outputs, output_grads, clip_rms_norm):
    out = []
    for g in output_grads:
        if clip_rms_norm and g is not None:
            rms = ew.sqrt(reduce_mean(ew.square(g)))
            g = g / maximum(rms / clip_rms_norm, 1.0)
        out.append(g)
    return out


def clip_activation_gradient(x: Tensor, clip_rms_norm=None) -> Tensor:
    """Identity whose gradient is divided by ``max(1, rms(dy) / clip_rms_norm)`` (Mesh TF
    ``layers.clip_activation_gradient``; its tf summaries are left out)."""
    return custom_gradient(ew.identity, functools.partial(_clip_grad_fn, clip_rms_norm=clip_rms_norm), [x])


def annealed_dropout(x: Tensor, is_training, start_step, end_step, init_rate=None, noise_shape=None,
                     name=None) -> Tensor:
    """Dropout whose rate falls linearly from ``init_rate`` at ``start_step`` to 0 at ``end_step`` of the
    global step (Mesh TF ``layers.annealed_dropout``): keep probability
    ``min(1, (1 - init_rate) + init_rate (step - start) / (end - start))``. Identity if not training."""
    if not is_training:
        return x
    step = ew.cast(get_or_create_global_step(x.mesh), torch.float32)
    frac = (step - float(start_step)) / float(end_step - start_step)
    keep = ew.cast(minimum(frac * float(init_rate) + (1.0 - float(init_rate)), 1.0), x.dtype)
    noise_shape = x.shape if noise_shape is None else convert_to_shape(noise_shape)
    noise = ew.cast(less(random_uniform(x.mesh, noise_shape, dtype=x.dtype, name=name), keep), x.dtype)
    return x * (noise / keep)


def _half_residual_and_swap(x1, x1_backwards, x2, x2_backwards, f=None):
    return x2, x2_backwards, x1 + f(x2), x1_backwards


def reversible_half_residual_and_swap(x1, x1_backwards, x2, x2_backwards, f, recompute_grads=True):
    """RevNet half step (Mesh TF ``layers.reversible_half_residual_and_swap``): returns
    ``(x2, x2_backwards, x1 + f(x2), x1_backwards)``.

    With ``recompute_grads`` ``f`` is recomputed in the backward pass (:func:`meshtorch.recompute_grad`).
    Differs from Mesh TF: Mesh TF reconstructs ``x1`` from the outputs and passes it back through the
    ``*_backwards`` gradient slots; here gradients are the ordinary ones (the same for ``x1``, ``x2``
    and ``f``'s variables; the ``*_backwards`` inputs get their outputs' gradients).
    """
    fn = functools.partial(_half_residual_and_swap, f=f)
    if not recompute_grads:
        return fn(x1, x1_backwards, x2, x2_backwards)
    x1_backwards = zeros_like(x1) if x1_backwards is None else x1_backwards
    x2_backwards = zeros_like(x2) if x2_backwards is None else x2_backwards
    return recompute_grad(fn, [x1, x1_backwards, x2, x2_backwards])


def embedding_weights(mesh, vocab_dim, output_dim, variable_dtype, name="embedding", ensemble_dim=None,
                      initializer=None) -> Tensor:
    """The variable ``name`` ``[ensemble_dim..., vocab_dim, output_dim]``, normal(0, 1) by default (Mesh TF
    ``layers.embedding_weights``)."""
    ensemble = [] if not ensemble_dim else (list(ensemble_dim) if isinstance(ensemble_dim, list) else [ensemble_dim])
    shape = Shape([convert_to_dimension(d) for d in ensemble] + [convert_to_dimension(vocab_dim),
                                                                 convert_to_dimension(output_dim)])
    return get_variable(mesh, name, shape, dtype=variable_dtype,
                        initializer=random_normal_initializer() if initializer is None else initializer)


def attention_bias_local_block(mesh, block_length, memory_length, dtype=torch.int32) -> Tensor:
    """Additive float32 bias ``[block_length, memory_length (2 x block)]`` for local attention over the
    previous and the current block: 0 on the previous block and on and below the diagonal of the
    current one, -1e9 above it (Mesh TF ``layers.attention_bias_local_block``)."""
    block_length = convert_to_dimension(block_length)
    memory_length = Dimension(convert_to_dimension(memory_length).name, block_length.size)
    future = ew.cast(less(mtf_range(mesh, block_length, dtype=dtype), mtf_range(mesh, memory_length, dtype=dtype)),
                     dtype)
    mask = concat([zeros(mesh, [block_length, memory_length], dtype=dtype), future], memory_length.name)
    return ew.cast(mask, torch.float32) * -1e9


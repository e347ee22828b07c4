"""More elementwise functions with Mesh TF's names: trigonometry, activations, casts, logical not.

sin, cos, elu, selu, softplus, swish, squared_relu, leaky_relu, pow (``mtf_pow``), ``mtf_abs``,
logical_not, to_float, to_int32, to_bfloat16 and ``cwise`` (mesh_tensorflow/ops.py). Built on
:func:`meshtorch.ops.elementwise.slicewise` with module-level torch functions and gradients written
as graph ops, or as compositions of existing ops. None communicates under any layout.

Where we differ from Mesh TF: ``sin`` / ``cos`` / ``elu`` / ``selu`` / ``softplus`` get their analytic
gradients (Mesh TF derives them with ``tf.gradients`` of the slice function: same values).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from meshtorch.core.graph import Tensor
from meshtorch.ops import binary as bn
from meshtorch.ops import elementwise as ew
from meshtorch.ops.shape import where

__all__ = ["sin", "cos", "elu", "selu", "softplus", "swish", "squared_relu", "leaky_relu", "mtf_pow", "pow",
           "mtf_abs", "logical_not", "to_float", "to_int32", "to_bfloat16", "cwise"]

#: SELU constants (Klambauer et al. 2017, as tf.nn.selu / torch.nn.functional.selu)
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _check(x, what):
    if not isinstance(x, Tensor):
        raise TypeError(f"{what}: expected an mtf Tensor, got {type(x).__name__}.")
    return x


def cwise(tf_fn, xs, output_dtype=None, grad_function=None, name=None) -> Tensor:
    """Componentwise ``tf_fn`` (a torch function here) of same-shaped tensors ``xs`` (Mesh TF ``mtf.cwise``).

    Every dim of ``xs[0]`` may be split (Mesh TF: ``splittable_dims=xs[0].shape.dims``).
    ``grad_function(op, dy)`` returns one graph Tensor (or None) per input.
    """
    xs = [xs] if isinstance(xs, Tensor) else list(xs)
    return ew.slicewise(tf_fn, xs, output_dtype=output_dtype, splittable_dims=xs[0].shape.dims,
                        grad_function=grad_function, name=name or "cwise")


def _sin_grad(op, dy):
    return [dy * cos(op.inputs[0])]


def _cos_grad(op, dy):
    return [-(dy * sin(op.inputs[0]))]


def sin(x: Tensor, name="sin") -> Tensor:
    """sin(x) elementwise (Mesh TF ``mtf.sin``); gradient dy * cos(x). Same shape and dtype."""
    return cwise(torch.sin, [_check(x, "sin")], grad_function=_sin_grad, name=name)


def cos(x: Tensor, name="cos") -> Tensor:
    """cos(x) elementwise (Mesh TF ``mtf.cos``); gradient -dy * sin(x). Same shape and dtype."""
    return cwise(torch.cos, [_check(x, "cos")], grad_function=_cos_grad, name=name)


def _positive(x):
    return bn.greater(x, 0.0)


def _elu_grad(op, dy):
    x = op.inputs[0]
    return [bn.multiply(dy, ew.exp(bn.minimum(x, 0.0)))]  # 1 for x > 0, exp(x) otherwise


def elu(x: Tensor) -> Tensor:
    """ELU (Clevert et al. 2015, arXiv:1511.07289): x if x > 0 else exp(x) - 1 (Mesh TF ``mtf.elu``)."""
    return cwise(F.elu, [_check(x, "elu")], grad_function=_elu_grad, name="elu")


def _selu_grad(op, dy):
    x = op.inputs[0]
    e = ew.exp(bn.minimum(x, 0.0))
    return [where(_positive(x), dy, bn.multiply(dy, e) * SELU_ALPHA) * SELU_SCALE]


def selu(x: Tensor) -> Tensor:
    """SELU (Klambauer et al. 2017, arXiv:1706.02515): scale * (x if x > 0 else alpha (exp(x) - 1))

    (Mesh TF ``mtf.selu``, as ``tf.nn.selu`` / ``torch.nn.functional.selu``)."""
    return cwise(F.selu, [_check(x, "selu")], grad_function=_selu_grad, name="selu")


def _softplus_grad(op, dy):
    return [dy * ew.sigmoid(op.inputs[0])]


def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x)) elementwise (Mesh TF ``mtf.softplus``); gradient dy * sigmoid(x)."""
    return cwise(F.softplus, [_check(x, "softplus")], grad_function=_softplus_grad, name="softplus")


def swish(x: Tensor) -> Tensor:
    """x * sigmoid(x) (Ramachandran et al. 2017, arXiv:1710.05941; Mesh TF ``mtf.swish``)."""
    return _check(x, "swish") * ew.sigmoid(x)


def squared_relu(x: Tensor) -> Tensor:
    """relu(x)**2 (Primer, So et al. 2021, arXiv:2109.08668; Mesh TF ``mtf.squared_relu``)."""
    return ew.square(ew.relu(_check(x, "squared_relu")))


def _leaky_relu_grad(op, dy, alpha):
    x = op.inputs[0]
    return [where(_positive(x), dy, dy * alpha)]


def leaky_relu(x: Tensor, alpha=0.2, name="leaky_relu") -> Tensor:
    """x if x > 0 else alpha * x (Mesh TF ``mtf.leaky_relu``, default alpha 0.2 as there).

    Gradient: dy where x > 0, alpha * dy where x <= 0 (Mesh TF's rule).
    """
    return cwise(functools.partial(F.leaky_relu, negative_slope=float(alpha)), [_check(x, "leaky_relu")],
                 grad_function=functools.partial(_leaky_relu_grad, alpha=float(alpha)), name=name)


def mtf_pow(x, y) -> Tensor:
    """x ** y as ``exp(log(x) * y)`` (Mesh TF ``mtf.pow``: defined for x > 0; broadcasting by name)."""
    return ew.exp(bn.multiply(ew.log(x), y))


pow = mtf_pow  # noqa: A001 - Mesh TF exports mtf_pow as mtf.pow


def mtf_abs(x: Tensor) -> Tensor:
    """|x| (Mesh TF ``mtf.abs`` / ``mtf_abs``); gradient dy * sign(x)."""
    return ew.abs(_check(x, "abs"))


def logical_not(x: Tensor, name="logical_not") -> Tensor:
    """Elementwise not of a bool tensor (Mesh TF ``mtf.logical_not``); no gradient."""
    return cwise(torch.logical_not, [_check(x, "logical_not")], name=name)


def to_float(x: Tensor, name="to_float") -> Tensor:
    """``cast(x, torch.float32)`` (Mesh TF ``mtf.to_float``)."""
    return ew.cast(x, torch.float32, name=name)


def to_int32(x: Tensor, name="to_int32") -> Tensor:
    """``cast(x, torch.int32)`` (Mesh TF ``mtf.to_int32``); no gradient."""
    return ew.cast(x, torch.int32, name=name)


def to_bfloat16(x: Tensor, name="to_bfloat16") -> Tensor:
    """``cast(x, torch.bfloat16)`` (Mesh TF ``mtf.to_bfloat16``)."""
    return ew.cast(x, torch.bfloat16, name=name)


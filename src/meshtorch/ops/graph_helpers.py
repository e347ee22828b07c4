"""Mesh TF's small graph-building helpers: anonymize, read_variable, binary_arguments_to_tensors,
binary_op_with_broadcasting (mesh_tensorflow/ops.py), as compositions of existing ops.
"""

from __future__ import annotations

from meshtorch.core.graph import Tensor
from meshtorch.core.processors import anonymous_shape
from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import BinaryOperation
from meshtorch.ops.reshape import reshape
from meshtorch.ops.variables import _as_variable, constant

__all__ = ["anonymize", "read_variable", "binary_arguments_to_tensors", "binary_op_with_broadcasting"]


def anonymize(x: Tensor) -> Tensor:
    """``x`` reshaped to :func:`~meshtorch.core.processors.anonymous_shape` (dims ``_anonymous_i``), so
    no layout rule splits it: the result is replicated on every processor (Mesh TF ``mtf.anonymize``)."""
    return reshape(x, anonymous_shape(x.shape))


def read_variable(var) -> Tensor:
    """The value of a variable (a Variable or its value Tensor) as a new tensor (Mesh TF
    ``mtf.read_variable``); the gradient passes to the variable."""
    return ew.identity(_as_variable(var).outputs[0], name="read_variable")


def binary_arguments_to_tensors(x1, x2) -> tuple[Tensor, Tensor]:
    """Both operands as Tensors: a Python scalar becomes a scalar constant of the other's dtype.

    Raises:
        ValueError: if neither is an mtf Tensor (Mesh TF's error).
    """
    if not isinstance(x1, Tensor) and not isinstance(x2, Tensor):
        raise ValueError("at least one of x1 and x2 must be an mtf Tensor")
    if isinstance(x1, Tensor) and isinstance(x2, Tensor):
        return x1, x2
    if isinstance(x1, Tensor):
        return x1, constant(x1.mesh, x2, [], dtype=x1.dtype)
    return constant(x2.mesh, x1, [], dtype=x2.dtype), x2


def binary_op_with_broadcasting(tf_fn, x1, x2, output_shape=None, output_dtype=None) -> Tensor:
    """``tf_fn(x1, x2)`` (a module-level torch function) on slices broadcast by name (Mesh TF's helper).

    The output has the union of the inputs' dims (or ``output_shape``) and dtype ``output_dtype``
    (default x1's). No gradient (as Mesh TF's ``BinaryOpWithBroadcasting`` without one).
    """
    x1, x2 = binary_arguments_to_tensors(x1, x2)
    name = getattr(tf_fn, "__name__", "binary_op")
    return BinaryOperation(tf_fn, x1, x2, name, output_shape, output_dtype, name).outputs[0]

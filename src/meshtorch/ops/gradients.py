"""Gradient rules that would make an op family import a family built on top of it.

Most operations define ``gradient()`` next to their lowering. The families ``binary``, ``reduce`` and
``shape`` import one another in that order (softmax is built from binary ops; ``add_n``, ``where`` and
``broadcast`` sum their gradients with ``reduce_to_shape``). Two rules point the other way: reduce_sum's
gradient is a broadcast (``shape``), and binary ops sum their gradients over broadcast dims with
``reduce_to_shape`` (``reduce``). They are registered here, above the three families, with
:func:`meshtorch.core.graph.register_gradient` (TensorFlow's ``tf.RegisterGradient``), so imports
between families only point one way. ``meshtorch/ops/__init__.py`` imports this module, so the rules
are in place whenever any op module is.
"""

from __future__ import annotations

from meshtorch.core.graph import register_gradient
from meshtorch.ops.binary import BinaryOperation
from meshtorch.ops.reduce import ReduceOperation, reduce_to_shape
from meshtorch.ops.shape import broadcast


@register_gradient(BinaryOperation)
def binary_gradient(op: BinaryOperation, grad_ys):
    """Each input's gradient in the output's shape, summed over the dims that input lacks."""
    dy = grad_ys[0]
    if dy is None or not op.has_gradient:
        return [None, None]
    x, y = op.inputs
    gx, gy = op.output_shape_gradients(dy)
    return [None if gx is None else reduce_to_shape(gx, x.shape),
            None if gy is None else reduce_to_shape(gy, y.shape)]


@register_gradient(ReduceOperation)
def reduce_gradient(op: ReduceOperation, grad_ys):
    """SUM: ``dy`` broadcast to the input's shape; MAX / MIN: :meth:`ReduceOperation.max_min_gradient`."""
    dy = grad_ys[0]
    if dy is None:
        return [None]
    if op.reduction == "SUM":
        return [broadcast(dy, op.inputs[0].shape)]
    return [op.max_min_gradient(dy)]


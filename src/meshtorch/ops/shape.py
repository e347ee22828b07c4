"""Shape operations. (This issue: broadcast; the rest of the family lands with the op library.)"""

from __future__ import annotations

from meshtorch.core.dims import combine_shapes, convert_to_shape
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._util import align_fn

__all__ = ["broadcast", "BroadcastOperation"]


class BroadcastOperation(Operation):
    """Broadcast ``x`` to ``new_shape`` (must contain all of x's dims, same sizes)."""

    def __init__(self, x: Tensor, new_shape, name=None):
        super().__init__([x], name=name or "broadcast")
        new_shape = convert_to_shape(new_shape)
        combine_shapes([x.shape, new_shape], f"broadcast {self.name!r}")
        missing = [d.name for d in x.shape if d.name not in new_shape]
        if missing:
            raise ShapeError(f"broadcast {self.name!r}: new shape {new_shape} lacks dims {missing} of {x.name!r} "
                             f"{x.shape}; reduce them first.")
        self.outputs = [Tensor(self, new_shape, x.dtype)]

    def lower(self, lw):
        x, out = self.inputs[0], self.outputs[0]
        a = align_fn(x.shape, out.shape)
        sizes = lw.slice_shape(out)
        if a is None:
            lw.set(out, lw.get(x))
            return
        lw.set(out, lw.slicewise(lambda t: a(t).expand(sizes), lw.get(x)))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None]
        from meshtorch.ops.binary import reduce_to_shape
        return [reduce_to_shape(dy, self.inputs[0].shape)]


def broadcast(x: Tensor, new_shape, name=None) -> Tensor:
    """``x`` broadcast to ``new_shape`` (Mesh TF ``mtf.broadcast``); no communication.

    Raises:
        ShapeError: if ``new_shape`` lacks a dim of ``x`` or gives one a different size.
    """
    new_shape = convert_to_shape(new_shape)
    if new_shape == x.shape:
        return x
    return BroadcastOperation(x, new_shape, name).outputs[0]

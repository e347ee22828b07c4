"""Indexing and selection. (This issue: one_hot; gather, top_k and friends come with the op library.)"""

from __future__ import annotations

import torch

from meshtorch.core.dims import convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor

__all__ = ["one_hot", "OneHotOperation"]


class OneHotOperation(Operation):
    """``indices.shape + [output_dim]``: ``on_value`` where the index equals the position."""

    def __init__(self, indices: Tensor, output_dim, on_value, off_value, dtype, name=None):
        super().__init__([indices], name=name or "one_hot")
        output_dim = convert_to_dimension(output_dim)
        if output_dim.name in indices.shape:
            raise ShapeError(f"one_hot {self.name!r}: indices {indices.name!r} {indices.shape} already have a "
                             f"dimension named {output_dim.name!r}.")
        if indices.dtype.is_floating_point:
            raise TypeError(f"one_hot {self.name!r}: indices {indices.name!r} must be integers, got {indices.dtype}.")
        self.on_value, self.off_value = on_value, off_value
        self.output_dim = output_dim
        self.outputs = [Tensor(self, indices.shape + [output_dim], dtype)]

    @property
    def has_gradient(self):
        return False

    def gradient(self, grad_ys):
        return [None]

    def lower(self, lw):
        out = self.outputs[0]
        impl = lw.mesh_impl(self)
        layout = lw.tensor_layout(out)
        n = lw.slice_shape(out)[-1]
        begins = lw.laid_out_constant(
            out, lambda p: torch.arange(impl.slice_begin(out.shape, p, layout)[-1],
                                        impl.slice_begin(out.shape, p, layout)[-1] + n, device=impl.device(p)))
        on, off, dt = self.on_value, self.off_value, out.dtype

        def f(idx, positions):
            hit = idx.unsqueeze(-1) == positions
            if on == 1 and off == 0:
                return hit.to(dt)
            return torch.where(hit, torch.tensor(on, dtype=dt), torch.tensor(off, dtype=dt))
        lw.set(out, lw.slicewise(f, lw.get(self.inputs[0]), begins))


def one_hot(indices: Tensor, output_dim, on_value=1.0, off_value=0.0, dtype=torch.float32, name=None) -> Tensor:
    """One-hot encoding along a new dim ``output_dim`` (may be split; no communication).

    Args:
        indices: integer Tensor of any named shape.
        output_dim: the new Dimension (its size is the number of classes).

    Returns:
        Tensor of ``indices.shape + [output_dim]``, ``dtype``. Out-of-range indices give all off.
    """
    return OneHotOperation(indices, output_dim, on_value, off_value, dtype, name).outputs[0]

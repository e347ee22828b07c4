"""Mixed precision: a variable's three dtypes (Mesh TF ``mtf.VariableDType``).

``get_variable(..., dtype=VariableDType(master_dtype, slice_dtype, activation_dtype))`` keeps the
variable's per-processor slices in ``slice_dtype`` (updates are applied in it, so keep it float32
when training: repeated bfloat16 round-off stalls small updates), and returns its value cast to
``activation_dtype`` (a cast op; its gradient is cast back to ``slice_dtype``). ``master_dtype``
is the dtype checkpoints store. Sums over many elements accumulate in float32 whatever the
activation dtype (see :mod:`meshtorch.ops.reduce`; ``torch.einsum`` on bfloat16/float16 already
accumulates in float32).
"""

from __future__ import annotations

import torch

__all__ = ["VariableDType", "LOW_PRECISION_DTYPES"]

#: floating dtypes whose sums are accumulated in float32
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


class VariableDType:
    """A variable's dtypes: master (checkpoints), slice (storage and updates), activation (compute).

    Args:
        master_dtype: dtype checkpoints store (default float32).
        slice_dtype: dtype of each processor's slice (default: ``master_dtype``).
        activation_dtype: dtype of the Tensor ``get_variable`` returns (default: ``master_dtype``).

    Raises:
        TypeError: if a dtype is not a floating ``torch.dtype`` (or None).

    Follows Mesh TF's ``VariableDType`` (mesh_tensorflow/ops.py), with torch dtypes.
    """

    def __init__(self, master_dtype=torch.float32, slice_dtype=None, activation_dtype=None):
        for n, d in (("master_dtype", master_dtype), ("slice_dtype", slice_dtype),
                     ("activation_dtype", activation_dtype)):
            if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
                raise TypeError(f"VariableDType: {n} must be a floating torch.dtype, got {d!r}.")
        self.master_dtype = master_dtype
        self.slice_dtype = slice_dtype or master_dtype
        self.activation_dtype = activation_dtype or master_dtype

    @classmethod
    def of(cls, dtype) -> VariableDType:
        """``dtype`` if it is a VariableDType, else ``VariableDType(dtype, dtype, dtype)``."""
        if isinstance(dtype, VariableDType):
            return dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"get_variable: dtype must be a torch.dtype or a VariableDType, got {dtype!r}.")
        out = cls.__new__(cls)
        out.master_dtype = out.slice_dtype = out.activation_dtype = dtype
        return out

    def __eq__(self, other):
        return isinstance(other, VariableDType) and (self.master_dtype, self.slice_dtype, self.activation_dtype) == (
            other.master_dtype, other.slice_dtype, other.activation_dtype)

    def __hash__(self):
        return hash((self.master_dtype, self.slice_dtype, self.activation_dtype))

    def __repr__(self):
        return (f"VariableDType(master_dtype={self.master_dtype}, slice_dtype={self.slice_dtype}, "
                f"activation_dtype={self.activation_dtype})")

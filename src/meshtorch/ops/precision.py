"""Mixed precision: a variable's dtypes (Mesh TF ``mtf.VariableDType``) and a model's policy (FSDP2's).

``get_variable(..., dtype=VariableDType(master_dtype, slice_dtype, activation_dtype))`` keeps the
variable's per-processor slices in ``slice_dtype`` (updates are applied in it, so keep it float32
when training: repeated bfloat16 round-off stalls small updates), and returns its value cast to
``activation_dtype`` (a cast op; its gradient is cast back to ``slice_dtype``). ``master_dtype``
is the dtype checkpoints store. Sums over many elements accumulate in float32 whatever the
activation dtype (see :mod:`meshtorch.ops.reduce`; ``torch.einsum`` on bfloat16/float16 already
accumulates in float32).

:class:`PrecisionPolicy` (FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``) applies one such
VariableDType to every trainable variable a model builds (float32 masters and optimizer state, reads in the
compute dtype, gradients reduced in the reduction dtype) and says how float32 matmuls run (TF32 or not).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from meshtorch.core.scopes import variable_scope

__all__ = ["VariableDType", "LOW_PRECISION_DTYPES", "PrecisionPolicy", "PRECISIONS", "REDUCE_DTYPES"]

#: floating dtypes whose sums are accumulated in float32
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


class VariableDType:
    """A variable's dtypes: master (checkpoints), slice (storage and updates), activation (compute).

    Args:
        master_dtype: dtype checkpoints store (default float32).
        slice_dtype: dtype of each processor's slice (default: ``master_dtype``).
        activation_dtype: dtype of the Tensor ``get_variable`` returns (default: ``master_dtype``).
        reduce_dtype: dtype in which the gradient of that read is summed over processors (the all-reduce or
            reduce-scatter of a partial sum; FSDP2's ``reduce_dtype``). None (default): the gradient's own dtype,
            i.e. the activation dtype, then cast to the slice dtype. A meshtorch extension of Mesh TF's class.

    Raises:
        TypeError: if a dtype is not a floating ``torch.dtype`` (or None).

    Follows Mesh TF's ``VariableDType`` (mesh_tensorflow/ops.py), with torch dtypes.
    """

    def __init__(self, master_dtype=torch.float32, slice_dtype=None, activation_dtype=None, reduce_dtype=None):
        for n, d in (("master_dtype", master_dtype), ("slice_dtype", slice_dtype),
                     ("activation_dtype", activation_dtype), ("reduce_dtype", reduce_dtype)):
            if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
                raise TypeError(f"VariableDType: {n} must be a floating torch.dtype, got {d!r}.")
        self.master_dtype = master_dtype
        self.slice_dtype = slice_dtype or master_dtype
        self.activation_dtype = activation_dtype or master_dtype
        self.reduce_dtype = reduce_dtype

    @classmethod
    def of(cls, dtype) -> VariableDType:
        """``dtype`` if it is a VariableDType, else ``VariableDType(dtype, dtype, dtype)``."""
        if isinstance(dtype, VariableDType):
            return dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"get_variable: dtype must be a torch.dtype or a VariableDType, got {dtype!r}.")
        out = cls.__new__(cls)
        out.master_dtype = out.slice_dtype = out.activation_dtype = dtype
        out.reduce_dtype = None
        return out

    def _key(self):
        return self.master_dtype, self.slice_dtype, self.activation_dtype, self.reduce_dtype

    def __eq__(self, other):
        return isinstance(other, VariableDType) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        extra = "" if self.reduce_dtype is None else f", reduce_dtype={self.reduce_dtype}"
        return (f"VariableDType(master_dtype={self.master_dtype}, slice_dtype={self.slice_dtype}, "
                f"activation_dtype={self.activation_dtype}{extra})")


#: ``meshtorch train --precision``: name -> (compute dtype, TF32 matmuls)
PRECISIONS = {"fp32": (torch.float32, False), "tf32": (torch.float32, True), "bf16": (torch.bfloat16, False),
              "fp16": (torch.float16, False)}  # fp16: with dynamic loss scaling (meshtorch.optim.loss_scale)
#: ``meshtorch train --reduce-dtype``: name -> gradient reduction dtype
REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """A model's mixed-precision policy (PyTorch FSDP2's ``MixedPrecisionPolicy``, on named dims).

    Every trainable floating variable a model builds under :meth:`scope` keeps float32 slices (the master
    weights; optimizer slots, made non-trainable, stay float32 too) and is read as one cast to
    ``compute_dtype`` per step, made on the stored shard: with storage rules (FSDP / ZeRO-3) the all-gather
    moves ``compute_dtype`` (FSDP2's ``param_dtype``). Matmuls and activations then run in ``compute_dtype``;
    the ops that need range or precision compute in float32 whatever their inputs: softmax (the attention
    kernel's, :mod:`meshtorch.ops.xent`'s), the cross-entropy loss (float32 output), norms' mean and variance
    (:mod:`meshtorch.layers.norms`) and rotary angles (:mod:`meshtorch.ops.rotary`). A weight's gradient, a
    partial sum over the data axes, is all-reduced or reduce-scattered in ``reduce_dtype`` (FSDP2's
    ``reduce_dtype``; its default is the param dtype, ours float32) and applied to the float32 master.

    Args:
        compute_dtype: torch.float32 (default), torch.bfloat16 or torch.float16.
        reduce_dtype: gradient reduction dtype, torch.float32 (default) or torch.bfloat16.
        tf32: float32 matmuls and convolutions on CUDA use TF32 tensor cores
            (``torch.set_float32_matmul_precision("high")``); only with a float32 ``compute_dtype``.

    Raises:
        TypeError: a dtype that is not a floating ``torch.dtype``.
        ValueError: ``compute_dtype``/``reduce_dtype`` outside the lists above; a bfloat16 ``reduce_dtype`` with a
            float32 ``compute_dtype``; ``tf32`` with a low-precision compute dtype.
    """

    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    tf32: bool = False

    def __post_init__(self):
        for n, d, ok in (("compute_dtype", self.compute_dtype, (torch.float32,) + LOW_PRECISION_DTYPES),
                         ("reduce_dtype", self.reduce_dtype, tuple(REDUCE_DTYPES.values()))):
            if not isinstance(d, torch.dtype):
                raise TypeError(f"PrecisionPolicy: {n} must be a torch.dtype, got {d!r}.")
            if d not in ok:
                raise ValueError(f"PrecisionPolicy: {n} must be one of {', '.join(map(str, ok))}, got {d}.")
        if self.reduce_dtype != torch.float32 and not self.mixed:
            raise ValueError(f"PrecisionPolicy: reduce_dtype {self.reduce_dtype} needs a low-precision compute_dtype "
                             "(--reduce-dtype bfloat16 needs --precision bf16); float32 gradients reduce in float32.")
        if self.tf32 and self.compute_dtype != torch.float32:
            raise ValueError(f"PrecisionPolicy: tf32=True needs compute_dtype torch.float32, got {self.compute_dtype}.")

    @classmethod
    def named(cls, precision: str = "fp32", reduce_dtype: str = "float32") -> PrecisionPolicy:
        """The policy of ``meshtorch train --precision {fp32,tf32,bf16,fp16} --reduce-dtype {float32,bfloat16}``.

        Raises:
            ValueError: naming the flag and its choices.
        """
        if precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}.")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"--reduce-dtype must be one of {', '.join(REDUCE_DTYPES)}, got {reduce_dtype!r}.")
        compute, tf32 = PRECISIONS[precision]
        if REDUCE_DTYPES[reduce_dtype] != torch.float32 and compute != torch.bfloat16:
            raise ValueError(f"--reduce-dtype {reduce_dtype} needs --precision bf16 (under {precision} the gradients "
                             "are float32 and are reduced in float32); drop --reduce-dtype.")
        return cls(compute, REDUCE_DTYPES[reduce_dtype], tf32)

    @classmethod
    def of(cls, policy) -> PrecisionPolicy:
        """``policy`` itself, the default (float32) policy for None, or :meth:`named` of a string."""
        if policy is None:
            return cls()
        if isinstance(policy, str):
            return cls.named(policy)
        if not isinstance(policy, cls):
            raise TypeError(f"precision must be a PrecisionPolicy, a name ({', '.join(PRECISIONS)}) or None, "
                            f"got {policy!r}.")
        return policy

    @property
    def name(self) -> str:
        """``fp32``, ``tf32``, ``bf16`` (or ``fp16``)."""
        if self.compute_dtype == torch.float32:
            return "tf32" if self.tf32 else "fp32"
        return "bf16" if self.compute_dtype == torch.bfloat16 else "fp16"

    @property
    def mixed(self) -> bool:
        """Whether the compute dtype differs from the float32 masters."""
        return self.compute_dtype != torch.float32

    def variable_dtype(self, dtype):
        """What a trainable variable asked for with ``dtype`` becomes: float32 master and slices, read in the
        compute dtype, reduced in the reduction dtype (non-floating dtypes, and every dtype under a float32
        policy, are returned unchanged)."""
        base = VariableDType.of(dtype)
        if not self.mixed or not base.master_dtype.is_floating_point:
            return dtype
        return VariableDType(torch.float32, torch.float32, self.compute_dtype, self.reduce_dtype)

    def custom_getter(self, getter, mesh, full_name, shape, dtype=torch.float32, trainable=True, **kwargs):
        """The ``variable_scope`` custom getter applying :meth:`variable_dtype` to trainable variables."""
        if trainable:
            dtype = self.variable_dtype(dtype)
        return getter(mesh, full_name, shape, dtype=dtype, trainable=trainable, **kwargs)

    @contextlib.contextmanager
    def scope(self):
        """Variables made inside (``mtf.get_variable``) follow the policy; a float32 policy changes nothing."""
        if not self.mixed:
            yield
            return
        with variable_scope("", custom_getter=self.custom_getter):
            yield

    def set_matmul_precision(self) -> str:
        """Set this process's float32 matmul precision, ``"high"`` (TF32 on CUDA) for ``tf32`` else ``"highest"``
        (``torch.set_float32_matmul_precision``; cuDNN convolutions follow ``torch.backends.cudnn.allow_tf32``).
        Call it in every process (each torchrun rank) before a graph is traced or compiled: compiled kernels
        keep the precision they were generated under. Returns the precision set."""
        precision = "high" if self.tf32 else "highest"
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = self.tf32
        return precision

    def record(self) -> dict:
        """What run.json records: the policy and the process's float32 matmul precision."""
        return {"precision": self.name, "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                "reduce_dtype": str(self.reduce_dtype).removeprefix("torch."),
                "float32_matmul_precision": torch.get_float32_matmul_precision()}

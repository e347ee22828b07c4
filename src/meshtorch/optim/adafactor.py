"""Adafactor (Shazeer & Stern 2018) as Mesh TF's ``AdafactorOptimizer`` (mesh_tensorflow/optimize.py).

For a variable ``w`` with gradient ``g`` and step ``s`` (updates before this one, 0 at the first)::

    decay   = 1 - (s + 1)^-0.8                       (adafactor_decay_rate_pow(0.8))
    lr      = min(0.01, 1/sqrt(s + 1))               (default; times 0.05 if not multiply_by_parameter_scale)
    g2      = g^2 + epsilon1
    factored (two largest dims d0 >= d1, both >= min_dim_size_to_factor):
        vr <- decay vr + (1 - decay) mean_{d0}(g2)       vr: shape of w minus d0
        vc <- decay vc + (1 - decay) mean_{d1}(g2)       vc: shape of w minus d1
        x   = g * rsqrt(vr / mean_{d1}(vr)) * rsqrt(vc)
    else:
        v  <- decay v + (1 - decay) g2;   x = g * rsqrt(v)
    x      /= max(1, rms(x) / clipping_threshold)                      (update clipping)
    u       = x * lr * max(rms(w), epsilon2)                           (multiply_by_parameter_scale)
    m      <- beta1 m + (1 - beta1) u;   u = m                         (only if beta1 > 0)
    w      <- w - u

Checked against the Mesh TF source (2020 version): ``min_dim_size_to_factor`` defaults to 128
(older releases used 32), ``epsilon1=1e-30``, ``epsilon2=1e-3``, ``clipping_threshold=1.0``,
``beta1=0.0`` and ``step_num()`` is the float32 ``global_step`` read before its increment. Slots keep
Mesh TF's names (``{var}_slot_vr``, ``_slot_vc``, ``_slot_v``, ``_slot_m``) and are float32. The RMS
reductions are the only communication: ``mean`` over split dims gives an all-reduce.

Differences from Mesh TF: the 0.05 factor on the default learning rate without parameter scaling
ignores Mesh TF's ``layers.unit_scaling_convention()`` (default False there, absent here); Mesh TF
increments ``global_step`` in its training loop with no ordering against the reads (racy in TF1
graphs), we return the increment from ``apply_grads`` and every read in the run sees the old value.
"""

from __future__ import annotations

import functools
import math

import torch

from meshtorch.ops import elementwise as ew
from meshtorch.ops.binary import maximum, minimum
from meshtorch.ops.initializers import zeros_initializer
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.variables import Assign, get_variable
from meshtorch.optim.base import Optimizer, check_grad, grouped_pairs, scalar_tensor
from meshtorch.optim.foreach_adafactor import ForeachAdafactorGroupUpdate
from meshtorch.optim.fused_adafactor import FusedAdafactorUpdate

__all__ = ["AdafactorOptimizer", "adafactor_decay_rate_pow", "adafactor_decay_rate_adam", "reduce_rms"]


def reduce_rms(x, **kwargs):
    """sqrt(mean(x^2)) (Mesh TF ``optimize.reduce_rms``): over all dims (a scalar), or as ``kwargs``
    (``reduced_dim=`` / ``output_shape=``) tell :func:`~meshtorch.ops.reduce.reduce_mean`."""
    return ew.sqrt(reduce_mean(ew.square(x), **kwargs))


def adafactor_decay_rate_pow(exponent: float = 0.8, offset=0):
    """Schedule ``step -> 1 - (step - offset + 1)^-exponent`` (Mesh TF ``adafactor_decay_rate_pow``;
    ``offset``: the first step of a fine-tuning phase)."""
    def decay(step):
        return 1.0 - ((step - float(offset)) + 1.0) ** (-float(exponent))
    return decay


def _k_decay_rate_adam(s, *, beta2: float):
    """``beta2 (1 - beta2^(t-1)) / (1 - beta2^t)``, ``t = s + 1``, in float32 from the int step (no float64 op):
    ``beta2 expm1((t-1) log beta2) / expm1(t log beta2)``, ``log beta2`` in double on the host."""
    if beta2 <= 0:
        return torch.zeros_like(s, dtype=torch.float32)
    t = s.to(torch.float32) + 1.0
    log_b = math.log(beta2)
    return beta2 * torch.expm1((t - 1.0) * log_b) / torch.expm1(t * log_b)


def adafactor_decay_rate_adam(beta2: float):
    """Schedule ``step -> beta2 (1 - beta2^(t-1)) / (1 - beta2^t)``, ``t = step + 1``.

    Mesh TF ``adafactor_decay_rate_adam``: Adam's second-moment decay with its bias correction folded in.
    """
    b2 = float(beta2)

    def decay(step):
        return ew.slicewise(functools.partial(_k_decay_rate_adam, beta2=b2), [step], output_dtype=torch.float32,
                            name="adafactor_decay_rate_adam")
    return decay


def _chunks(pairs, cap_bytes: int) -> list:
    """``pairs`` (gradient, variable) cut in order into runs of at most ``cap_bytes`` of float32 variables (a
    larger variable alone)."""
    out, size = [], 0
    for p in pairs:
        b = 4 * p[1].shape.size
        if out and out[-1] and size + b > cap_bytes:
            out.append([])
            size = 0
        if not out:
            out.append([])
        out[-1].append(p)
        size += b
    return out


class AdafactorOptimizer(Optimizer):
    """Adafactor with Mesh TF's defaults: ``AdafactorOptimizer()`` behaves like Mesh TF's.

    Args:
        multiply_by_parameter_scale: scale the step by ``max(rms(w), epsilon2)``.
        learning_rate: None (Mesh TF default ``min(0.01, rsqrt(step + 1))``, times 0.05 without
            parameter scaling), a float, a scalar Tensor or a schedule ``fn(step) -> Tensor``.
        decay_rate: None (``1 - (step + 1)^-0.8``), or a float / scalar Tensor / schedule.
        beta1: momentum on the (scaled, clipped) update; 0 disables it and its slot.
        clipping_threshold: update clipping at this RMS; None disables it.
        factored: use factored second moments where the shape allows.
        epsilon1: added to squared gradients. epsilon2: floor of the parameter RMS.
        min_dim_size_to_factor: factor only if the two largest dims are both at least this size.
        stacked_dim_names: dims never factored or reduced over: the parameter scale is an RMS per
            index of these dims (Mesh TF's stacked layers).
        exclude_from_parameter_scale: substrings; a variable whose name contains one is updated
            without the parameter scale.
        fused: compute the update with four kernels and the all-reduces its statistics need instead of
            about twenty elementwise graph ops per variable; equal to float32 rounding (default True).
            ``apply_grads`` builds one multi-tensor op per mesh and :attr:`group_bytes` of variables
            (:class:`~meshtorch.optim.foreach_adafactor.ForeachAdafactorGroupUpdate`: ``torch._foreach_*``
            calls over the group's slices); ``apply_grad`` (or :func:`~meshtorch.optim.in_backward.per_variable`)
            one :class:`~meshtorch.optim.fused_adafactor.FusedAdafactorUpdate` per variable.

    Shapes: ``grad`` has the variable's named shape. Slots: ``vr`` = var shape minus ``d0``,
    ``vc`` = var shape minus ``d1`` (factored), else ``v`` and (beta1) ``m`` of the var's shape; each
    is laid out by the same rules as the variable.

    Raises:
        ValueError: if ``beta1`` is outside [0, 1) or a gradient's dims differ from its variable's.
    """

    #: fused: one multi-tensor update over every variable of a mesh (False: one update op per variable, which
    #: :func:`meshtorch.optim.in_backward.per_variable` sets so each update can run as its gradient is final)
    multi_tensor = True
    #: the float32 bytes (full variables) of one multi-tensor update at most: a mesh's variables are updated in
    #: groups of this size, in order (a variable larger than this alone), so the update's intermediates (the
    #: update ``x`` of every variable of a group, held between its kernels) stay bounded as in a per-variable step
    group_bytes = 256 * 2 ** 20

    def __init__(self, multiply_by_parameter_scale=True, learning_rate=None, decay_rate=None, beta1=0.0,
                 clipping_threshold=1.0, factored=True, epsilon1=1e-30, epsilon2=1e-3, min_dim_size_to_factor=128,
                 stacked_dim_names=None, exclude_from_parameter_scale=None, fused: bool = True):
        super().__init__(learning_rate)
        self.fused = bool(fused)
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"AdafactorOptimizer: beta1 must be in [0, 1), got {beta1}.")
        self.multiply_by_parameter_scale = bool(multiply_by_parameter_scale)
        self.decay_rate = adafactor_decay_rate_pow(0.8) if decay_rate is None else decay_rate
        self.beta1 = float(beta1)
        self.clipping_threshold = clipping_threshold
        self.factored = bool(factored)
        self.epsilon1, self.epsilon2 = float(epsilon1), float(epsilon2)
        self.min_dim_size_to_factor = int(min_dim_size_to_factor)
        self.stacked_dim_names = list(stacked_dim_names or [])
        self.exclude_from_parameter_scale = list(exclude_from_parameter_scale or [])

    def factored_dims(self, shape):
        """The two largest dims ``[d0, d1]`` to factor over, or None (Mesh TF ``_factored_dims``).

        Ties keep the shape's order (a stable sort, as in Mesh TF).
        """
        dims = [d for d in shape.dims if d.name not in self.stacked_dim_names]
        if not self.factored or len(dims) < 2:
            return None
        sorted_dims = sorted(dims, key=lambda d: -d.size)
        if sorted_dims[1].size < self.min_dim_size_to_factor:
            return None
        return sorted_dims[:2]

    def lr(self, mesh):
        if self.learning_rate is not None:
            return super().lr(mesh)
        c = self._context(mesh)
        if "adafactor_lr" not in c:
            lr = minimum(ew.rsqrt(c["step_float"] + 1.0), scalar_tensor(0.01, mesh))
            if not self.multiply_by_parameter_scale:
                lr = lr * 0.05
            c["adafactor_lr"] = lr
        return c["adafactor_lr"]

    def _slots(self, var):
        """``var``'s second-moment slots (``[vr, vc]`` factored, else ``[v]``), then ``m`` if ``beta1``."""
        def slot(suffix, shape):
            return get_variable(var.mesh, f"{var.name}_slot_{suffix}", shape, initializer=zeros_initializer(),
                                dtype=torch.float32, trainable=False)
        fd = self.factored_dims(var.shape)
        slots = [slot("vr", var.shape - fd[0]), slot("vc", var.shape - fd[1])] if fd else [slot("v", var.shape)]
        return slots + ([slot("m", var.shape)] if self.beta1 else [])

    def _param_scale(self, var) -> bool:
        return self.multiply_by_parameter_scale and not any(s in var.name for s in self.exclude_from_parameter_scale)

    def _assigns(self, var, slots, new_w, new_slots):
        """The assignments of one variable's update, grouped as the graph-op path's."""
        n_v = len(slots) - (1 if self.beta1 else 0)
        updates = [Assign([s.operation for s in slots[:n_v]], new_slots[:n_v], name=f"{var.name}/adafactor_v")]
        if self.beta1:
            updates.append(Assign([slots[-1].operation], [new_slots[-1]], name=f"{var.name}/adafactor_m"))
        updates.append(Assign([var], [new_w], name=f"{var.name}/adafactor_update"))
        return updates

    def apply_grads(self, grads, variables):
        """As :meth:`Optimizer.apply_grads`; fused: one multi-tensor update per mesh and :attr:`group_bytes` of
        variables (:class:`~meshtorch.optim.foreach_adafactor.ForeachAdafactorGroupUpdate`; one for every variable
        of a model up to 64M parameters), then the assignments of each variable as :meth:`apply_grad` makes them
        (the same slot names, equal values)."""
        grads, variables = list(grads), list(variables)
        if (not self.fused or not self.multi_tensor or len(grads) != len(variables)
                or type(self).apply_grad is not AdafactorOptimizer.apply_grad):
            return super().apply_grads(grads, variables)
        groups = grouped_pairs(grads, variables)
        ops = []
        for mesh, pairs in groups.items():
            with mesh.graph.storage_scope():
                for g, var in pairs:
                    check_grad(g, var, "AdafactorOptimizer")
                decay = scalar_tensor(self.hyper(self.decay_rate, "decay_rate", mesh), mesh)
                lr = scalar_tensor(self.lr(mesh), mesh)
                for chunk in _chunks(pairs, self.group_bytes):
                    ops.extend(self._group_update(chunk, decay, lr))
            step = self.step_int(mesh)
            ops.append(Assign([step.operation], [step + 1], name="global_step_increment"))
        return ops

    def _group_update(self, pairs, decay, lr):
        """One :class:`ForeachAdafactorGroupUpdate` of ``pairs`` (gradient, variable); the variables' assignments."""
        gs = [g if g.dtype == var.dtype else ew.cast(g, var.dtype) for g, var in pairs]
        vs = [var for _, var in pairs]
        slots = [self._slots(var) for var in vs]
        op = ForeachAdafactorGroupUpdate(
            [var.value for var in vs], gs, decay, lr, slots,
            factored_dims=[self.factored_dims(var.shape) for var in vs],
            param_scale=[self._param_scale(var) for var in vs], stacked=self.stacked_dim_names, beta1=self.beta1,
            clipping_threshold=self.clipping_threshold, epsilon1=self.epsilon1, epsilon2=self.epsilon2,
            name="adafactor_group")
        ops, new_slots = [], op.outputs[len(vs):]
        for i, (var, ss) in enumerate(zip(vs, slots, strict=True)):
            ops.extend(self._assigns(var, ss, op.outputs[i], new_slots[:len(ss)]))
            new_slots = new_slots[len(ss):]
        return ops

    def apply_grad(self, grad, var):
        check_grad(grad, var, "AdafactorOptimizer")
        mesh = var.mesh
        f32 = torch.float32
        decay = self.hyper(self.decay_rate, "decay_rate", mesh)
        lr = self.lr(mesh)

        def slot(suffix, shape):
            return get_variable(mesh, f"{var.name}_slot_{suffix}", shape, initializer=zeros_initializer(),
                                dtype=f32, trainable=False)

        if self.fused:
            return self._fused_update(grad, var, decay, lr, slot)
        grad = ew.cast(grad, f32)
        old_val = ew.cast(var.value, f32)
        mixing = 1.0 - decay

        grad_squared = ew.square(grad) + self.epsilon1
        if self.multiply_by_parameter_scale and not any(s in var.name for s in self.exclude_from_parameter_scale):
            stacked = [d for d in var.shape.dims if d.name in self.stacked_dim_names]
            update_scale = maximum(reduce_rms(old_val, output_shape=stacked), scalar_tensor(self.epsilon2, mesh)) * lr
        else:
            update_scale = lr
        updates = []
        fd = self.factored_dims(var.shape)
        if fd:
            d0, d1 = fd
            vr_shape, vc_shape = var.shape - d0, var.shape - d1
            vr, vc = slot("vr", vr_shape), slot("vc", vc_shape)
            new_vr = vr * decay + reduce_mean(grad_squared, output_shape=vr_shape) * mixing
            new_vc = vc * decay + reduce_mean(grad_squared, output_shape=vc_shape) * mixing
            updates.append(Assign([vr.operation, vc.operation], [new_vr, new_vc], name=f"{var.name}/adafactor_v"))
            long_term_mean = reduce_mean(new_vr, reduced_dim=d1)
            x = grad * ew.rsqrt(new_vr / long_term_mean) * ew.rsqrt(new_vc)
        else:
            v = slot("v", var.shape)
            new_v = v * decay + grad_squared * mixing
            updates.append(Assign([v.operation], [new_v], name=f"{var.name}/adafactor_v"))
            x = grad * ew.rsqrt(new_v)
        if self.clipping_threshold is not None:
            x = x / maximum(scalar_tensor(1.0, mesh), reduce_rms(x) / float(self.clipping_threshold))
        subtrahend = x * update_scale
        if self.beta1:
            m = slot("m", var.shape)
            subtrahend = m * self.beta1 + subtrahend * (1.0 - self.beta1)
            updates.append(Assign([m.operation], [subtrahend], name=f"{var.name}/adafactor_m"))
        updates.append(Assign([var], [old_val - subtrahend], name=f"{var.name}/adafactor_update"))
        return updates

    def _fused_update(self, grad, var, decay, lr, slot):
        """The same update as one :class:`FusedAdafactorUpdate` op; Assigns grouped as the graph-op path's."""
        mesh = var.mesh
        fd = self.factored_dims(var.shape)
        slots = self._slots(var)
        op = FusedAdafactorUpdate(var.value, grad, scalar_tensor(decay, mesh), scalar_tensor(lr, mesh), slots,
                                  factored_dims=fd, stacked=self.stacked_dim_names, beta1=self.beta1,
                                  clipping_threshold=self.clipping_threshold, epsilon1=self.epsilon1,
                                  epsilon2=self.epsilon2, param_scale=self._param_scale(var),
                                  name=f"{var.name}/fused_adafactor")
        new_w, *new_slots = op.outputs
        return self._assigns(var, slots, new_w, new_slots)

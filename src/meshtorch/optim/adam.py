"""Adam (Kingma & Ba 2015) and AdamW (Loshchilov & Hutter 2019) as graph operations.

Formulas of ``torch.optim.Adam`` / ``torch.optim.AdamW`` (amsgrad=False, maximize=False), with
``t = step + 1`` the number of this update::

    g <- g + wd * w                          (Adam only: L2 in the gradient)
    w <- w * (1 - lr * wd)                   (AdamW only: decoupled decay)
    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    w <- w - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The slots ``{var}/adam_m`` and ``{var}/adam_v`` (Mesh TF's names in ``AdamWeightDecayOptimizer``)
are non-trainable variables of the parameter's named shape, so they get its layout and need no
communication. Mesh TF's ``AdamWeightDecayOptimizer`` has no bias correction and puts ``eps`` the
same place; we follow torch (bias-corrected), so torch recipes port unchanged.
"""

from __future__ import annotations

import functools
import math

import torch

from meshtorch.core.graph import Tensor
from meshtorch.ops import elementwise as ew
from meshtorch.ops.initializers import zeros_initializer
from meshtorch.ops.variables import Assign, get_variable
from meshtorch.optim.base import Optimizer, check_grad, grouped_pairs
from meshtorch.optim.fused import FusedAdamGroupUpdate, FusedAdamUpdate, fused_adam_available

__all__ = ["AdamOptimizer", "AdamWOptimizer"]


def _one_minus_pow(s, beta: float):
    """``1 - beta^(s + 1)`` in float32 from the int step ``s``, as ``-expm1((s + 1) log(beta))``.

    ``log(beta)`` is taken on the host in double precision; the rest is float32 with no cancellation (the
    direct ``1 - beta^t`` loses ~4 digits at t = 1 for beta = 0.999), so the step runs no float64 op
    (GPUs' float64 units are slow, and a float64 op in a step blocks CUDA graphs' and TF32's
    all-float32 path) and stays within float32 rounding of the double formula.
    """
    return -torch.expm1((s.to(torch.float32) + 1.0) * math.log(beta)) if beta > 0 else torch.ones_like(
        s, dtype=torch.float32)


def _k_bias_correction(s, *, beta: float):
    """``1 - beta^(s + 1)`` from the int step ``s``, float32 (:func:`_one_minus_pow`)."""
    return _one_minus_pow(s, beta)


def _k_bias_correction_sqrt(s, *, beta: float):
    """``sqrt(1 - beta^(s + 1))`` from the int step ``s``, float32 (:func:`_one_minus_pow`)."""
    return torch.sqrt(_one_minus_pow(s, beta))


class AdamOptimizer(Optimizer):
    """Adam as ``torch.optim.Adam(lr, betas, eps, weight_decay)`` (L2 weight decay in the gradient).

    Args:
        learning_rate: float, scalar Tensor, or schedule ``fn(step) -> Tensor`` (default 1e-3).
        beta1, beta2: moment decay rates in [0, 1).
        epsilon: added to ``sqrt(v_hat)`` (outside the square root, as torch).
        weight_decay: L2 coefficient.
        fused: update each variable slice with one kernel (PyTorch's fused Adam, as
            ``torch.optim.Adam(fused=True)``; :class:`~meshtorch.optim.fused.FusedAdamUpdate`) instead
            of a chain of elementwise graph ops; equal to float32 rounding. Default: where this
            PyTorch has the kernel.

    Shapes: ``grad`` has the variable's named shape; slots have it too. Parameters of any float
    dtype are updated in float32 and cast back on assignment.

    Raises:
        ValueError: on betas outside [0, 1), negative epsilon or weight decay, or a gradient whose
            dims differ from its variable's.
    """

    decoupled = False
    #: fused: one multi-tensor update over every variable (False: one update op per variable, which
    #: :func:`meshtorch.optim.in_backward.per_variable` sets so each update can run as its gradient is final)
    multi_tensor = True

    def __init__(self, learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.0,
                 fused: bool | None = None):
        super().__init__(learning_rate)
        if fused and not fused_adam_available():
            raise ValueError(f"{type(self).__name__}(fused=True): this PyTorch ({torch.__version__}) has no fused "
                             "Adam kernel (torch._fused_adamw_, torch >= 2.4); pass fused=False.")
        self.fused = fused_adam_available() if fused is None else bool(fused)
        for n, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{type(self).__name__}: {n} must be in [0, 1), got {b}.")
        if epsilon < 0 or weight_decay < 0:
            raise ValueError(f"{type(self).__name__}: epsilon ({epsilon}) and weight_decay ({weight_decay}) "
                             "must be >= 0.")
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.epsilon, self.weight_decay = float(epsilon), float(weight_decay)

    def _corrections(self, mesh):
        """(1 - b1^t, sqrt(1 - b2^t)) as float32 scalars from the int step (no float64 op)."""
        c = self._context(mesh)
        if "adam_bc" not in c:
            b1, b2 = self.beta1, self.beta2
            step = c["step"]
            bc1 = ew.slicewise(functools.partial(_k_bias_correction, beta=b1), [step],
                               output_dtype=torch.float32, name="adam_bias_correction1")
            bc2 = ew.slicewise(functools.partial(_k_bias_correction_sqrt, beta=b2),
                               [step], output_dtype=torch.float32, name="adam_bias_correction2_sqrt")
            c["adam_bc"] = (bc1, bc2)
        return c["adam_bc"]

    def _slots(self, var):
        f32 = torch.float32
        return tuple(get_variable(var.mesh, f"{var.name}/adam_{k}", var.shape, initializer=zeros_initializer(),
                                  dtype=f32, trainable=False) for k in ("m", "v"))

    def apply_grads(self, grads, variables, found_inf: Tensor | None = None):
        """As :meth:`Optimizer.apply_grads`; fused: ONE multi-tensor update per mesh
        (:class:`~meshtorch.optim.fused.FusedAdamGroupUpdate`: one ``torch._fused_adamw_`` call per processor
        for all its variables' slices, as ``torch.optim.AdamW(fused=True)``), then one assignment per variable.
        Slot names, values and checkpoints are those of the per-variable update (:meth:`apply_grad`).

        ``found_inf``: a float32 scalar (1.0: a gradient overflowed, :mod:`meshtorch.optim.loss_scale`); on 1.0
        the step changes no variable, slot or step count (``torch.amp.GradScaler.step`` with a fused optimizer).

        Raises:
            ValueError: ``found_inf`` with ``fused=False`` or a subclass's own ``apply_grad``.
        """
        grads, variables = list(grads), list(variables)
        if (not self.fused or type(self).apply_grad is not AdamOptimizer.apply_grad or len(grads) != len(variables)
                or not self.multi_tensor):
            if found_inf is not None:
                raise ValueError(f"{type(self).__name__}: skipping overflowed steps (fp16 loss scaling) needs the "
                                 "fused multi-tensor update (fused=None or True, torch >= 2.4).")
            return super().apply_grads(grads, variables)
        groups = grouped_pairs(grads, variables)
        ops = []
        for mesh, pairs in groups.items():
            with mesh.graph.storage_scope():
                gs, ws, ms, vs = [], [], [], []
                for g, var in pairs:
                    check_grad(g, var, type(self).__name__)
                    m, v = self._slots(var)
                    gs.append(g if g.dtype == var.dtype else ew.cast(g, var.dtype))
                    ws.append(var.value)
                    ms.append(m)
                    vs.append(v)
                n = len(pairs)
                op = FusedAdamGroupUpdate(ws, gs, ms, vs, self.step_int(mesh), self.lr(mesh), beta1=self.beta1,
                                          beta2=self.beta2, epsilon=self.epsilon, weight_decay=self.weight_decay,
                                          decoupled=self.decoupled, found_inf=found_inf, name="fused_adam_group")
                out = op.outputs
                ops.extend(Assign([var, m.operation, v.operation], [out[i], out[n + i], out[2 * n + i]],
                                  name=f"{var.name}/adam_update")
                           for i, ((_, var), m, v) in enumerate(zip(pairs, ms, vs, strict=True)))
            step = self.step_int(mesh)
            ops.append(Assign([step.operation], [step + 1 if found_inf is None else step + ew.cast(
                1.0 - found_inf, step.dtype)], name="global_step_increment"))
        return ops

    def apply_grad(self, grad, var):
        check_grad(grad, var, type(self).__name__)
        mesh = var.mesh
        lr = self.lr(mesh)
        f32 = torch.float32
        m, v = self._slots(var)
        if self.fused:
            op = FusedAdamUpdate(var.value, grad, m, v, self.step_int(mesh), lr, beta1=self.beta1,
                                 beta2=self.beta2, epsilon=self.epsilon, weight_decay=self.weight_decay,
                                 decoupled=self.decoupled, name=f"{var.name}/fused_adam")
            return [Assign([var, m.operation, v.operation], op.outputs, name=f"{var.name}/adam_update")]
        bc1, bc2_sqrt = self._corrections(mesh)
        g = ew.cast(grad, f32)
        w = ew.cast(var.value, f32)
        if self.weight_decay and not self.decoupled:
            g = g + w * self.weight_decay
        if self.weight_decay and self.decoupled:
            w = w * (1.0 - lr * self.weight_decay)
        new_m = m * self.beta1 + g * (1.0 - self.beta1)
        new_v = v * self.beta2 + ew.square(g) * (1.0 - self.beta2)
        denom = ew.sqrt(new_v) / bc2_sqrt + self.epsilon
        step_size = lr / bc1
        new_w = w - new_m / denom * step_size
        return [Assign([m.operation, v.operation, var], [new_m, new_v, new_w], name=f"{var.name}/adam_update")]


class AdamWOptimizer(AdamOptimizer):
    """AdamW as ``torch.optim.AdamW``: weight decay decoupled from the gradient, ``w <- w (1 - lr wd)``.

    Same arguments as :class:`AdamOptimizer`; ``weight_decay`` defaults to 1e-2 as in torch.
    """

    decoupled = True

    def __init__(self, learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=1e-2,
                 fused: bool | None = None):
        super().__init__(learning_rate, beta1, beta2, epsilon, weight_decay, fused)

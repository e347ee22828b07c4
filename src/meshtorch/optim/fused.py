"""Fused optimizer updates: one kernel per variable slice instead of a chain of elementwise ops.

An optimizer's update is elementwise in the variable, its gradient and its slots, so it runs on each
processor's slices under any layout (compute or storage) with no communication. Written as graph ops
(:mod:`meshtorch.optim.adam`) it is about a dozen elementwise steps, each reading and writing the
whole slice; :class:`FusedAdamUpdate` is one step whose kernel calls PyTorch's fused Adam/AdamW
kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``, the kernels behind
``torch.optim.AdamW(fused=True)``) on fresh copies of the variable and its moments (a run's
assignments take effect at its end, so the old values are never modified in place).

Source: PyTorch ``torch.optim.AdamW(fused=True)``; the graph-op formulas it replaces are those of
:mod:`meshtorch.optim.adam`.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._kernels import align_spec, aligned, apply_aligned

__all__ = ["FusedAdamGroupUpdate", "FusedAdamUpdate", "UpdateOperation", "fused_adam_available"]


def fused_adam_available() -> bool:
    """Does this PyTorch build have the fused Adam/AdamW kernels (``torch._fused_adamw_``, torch >= 2.4)?"""
    return hasattr(torch, "_fused_adamw_") and hasattr(torch, "_fused_adam_")


def _k_fused_adam(w, g, m, v, step, *lr_tensor, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, decoupled: bool, donate: bool = False):
    """New (w, m, v) in float32 of one slice: torch's fused Adam (``decoupled``: AdamW) on copies.

    ``step``: the int number of completed updates (0-dim); the learning rate is ``lr_tensor[0]`` (a
    0-dim scheduled rate) if given, else ``lr``. ``donate``: the plan found no later reader of ``w``,
    ``m``, ``v`` (:mod:`meshtorch.lowering.donate`): float32 contiguous ones are updated in place
    (``torch.optim.AdamW(fused=True)``'s own ``step``), so no new buffers are allocated; under
    ``torch.compile`` the same in-place writes are ``copy_`` s of the fused formula's results.
    """
    f32 = torch.float32
    if torch.compiler.is_compiling():  # inductor cannot functionalize the in-place kernel; it fuses this instead
        new = _adam_formula(w.to(f32), g.to(f32), m, v, step, *lr_tensor, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, decoupled=decoupled)
        if not donate:
            return new
        # donated: the results are written into w, m, v (graph-input mutations inductor stores in place), so
        # the compiled step allocates no new weight or moment buffers and the commit copies nothing
        return tuple(t.copy_(n) if t.dtype == f32 and t.is_contiguous() else n
                     for t, n in zip((w, m, v), new, strict=True))

    def own(t):
        in_place = donate and t.dtype == f32 and t.is_contiguous()
        return t if in_place else t.to(f32, memory_format=torch.contiguous_format, copy=True)
    w, m, v = own(w), own(m), own(v)
    g = g.to(f32).contiguous()
    fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    rate = lr_tensor[0].to(f32).reshape(()) if lr_tensor else lr
    fn([w], [g], [m], [v], [], [step.to(f32).reshape(()) + 1], lr=rate, beta1=beta1,
       beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    return w, m, v


def _k_fused_adam_group(*xs, n: int, aligns, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, decoupled: bool, skippable: bool = False, donate: bool = False):
    """New ``(w_1..w_n, m_1..m_n, v_1..v_n)`` in float32 of ``n`` slices, in ONE fused Adam(W) call.

    ``xs``: ``w_1..w_n, m_1..m_n, v_1..v_n, g_1..g_n, step[, lr]`` (``step``: the int number of completed
    updates, 0-dim; ``lr``: a 0-dim scheduled rate, else the float ``lr``); ``aligns[i]``: how ``g_i``'s dims
    map onto ``w_i``'s (:func:`~meshtorch.ops._kernels.align_spec`, or None). One
    ``torch._fused_adamw_`` (``_fused_adam_``) call on the lists, as ``torch.optim.AdamW(fused=True)``'s step
    for one parameter group on one device: per-element math identical to :func:`_k_fused_adam` per slice.
    ``donate``: the float32 contiguous ``w``, ``m``, ``v`` are updated in place (see :func:`_k_fused_adam`);
    a tuple of ``3 n`` bools: only those marked (:func:`meshtorch.lowering.donate.donate_inputs` per tensor).
    ``skippable``: ``xs`` ends with ``found_inf`` (float32 0-dim, 1.0: a gradient overflowed), passed to the
    kernel as ``torch.amp.GradScaler`` passes it to ``AdamW(fused=True)``: on 1.0 nothing changes.
    """
    f32 = torch.float32
    if skippable:
        xs, found_inf = xs[:-1], xs[-1]
    else:
        found_inf = None
    ws, ms, vs, gs = (list(xs[k * n:(k + 1) * n]) for k in range(4))
    step, lr_tensor = xs[4 * n], xs[4 * n + 1:]
    gs = [aligned(g, a) for g, a in zip(gs, aligns, strict=True)]
    flags = tuple(donate) if isinstance(donate, tuple) else (bool(donate),) * (3 * n)
    if torch.compiler.is_compiling():  # inductor fuses the formula; it cannot functionalize the fused kernel
        new = [_adam_formula(w.to(f32), g.to(f32), m, v, step, *lr_tensor, lr=lr, beta1=beta1, beta2=beta2,
                             eps=eps, weight_decay=weight_decay, decoupled=decoupled)
               for w, g, m, v in zip(ws, gs, ms, vs, strict=True)]
        outs = [t[k] for k in range(3) for t in new]
        if found_inf is not None:  # a skipped step keeps the old values
            outs = [torch.where(found_inf > 0, old.to(f32), o) for old, o in zip(ws + ms + vs, outs, strict=True)]
        return tuple(t.copy_(o) if d and t.dtype == f32 and t.is_contiguous() else o
                     for t, o, d in zip(ws + ms + vs, outs, flags, strict=True))

    def own(t, d):
        in_place = d and t.dtype == f32 and t.is_contiguous()
        return t if in_place else t.to(f32, memory_format=torch.contiguous_format, copy=True)
    ws, ms, vs = ([own(t, d) for t, d in zip(ts, flags[k * n:(k + 1) * n], strict=True)]
                  for k, ts in enumerate((ws, ms, vs)))
    gs = [g if g.dtype == f32 and g.is_contiguous() else g.to(f32).contiguous() for g in gs]  # no no-op aten calls
    fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    rate = (lr_tensor[0] if lr_tensor[0].dtype == f32 else lr_tensor[0].to(f32)) if lr_tensor else lr  # 0-dim
    t = step.to(f32) + 1
    fn(ws, gs, ms, vs, [], [t] * n, lr=rate, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
       amsgrad=False, maximize=False, found_inf=found_inf)
    return (*ws, *ms, *vs)


def _group_donates(*, n: int, **_):
    """Inputs of :func:`_k_fused_adam_group` it may update in place: all ``w``, ``m``, ``v`` (outputs in order)."""
    return tuple(range(3 * n))


_k_fused_adam_group.donates = _group_donates  # a function of the step's parameters (meshtorch.lowering.donate)
_k_fused_adam_group.fresh_outputs = True
_k_fused_adam.donates = (0, 2, 3)  # w, m, v may be updated in place (meshtorch.lowering.donate)
_k_fused_adam.fresh_outputs = True  # without donate=True its outputs are new tensors


def _adam_formula(w, g, m, v, step, *lr_tensor, lr, beta1, beta2, eps, weight_decay, decoupled):
    """The fused kernel's arithmetic as elementwise torch ops (what ``torch.compile`` fuses into one loop).

    PyTorch's ``_fused_adam_utils``: ``m = lerp(m, g, 1 - beta1)``, ``v = beta2 v + (1 - beta2) g^2``,
    ``w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``, weight decay decoupled (AdamW:
    ``w *= 1 - lr * wd``) or added to the gradient (Adam).
    """
    t = step.to(torch.float32).reshape(()) + 1
    rate = lr_tensor[0].to(torch.float32).reshape(()) if lr_tensor else lr
    if weight_decay:
        if decoupled:
            w = w * (1 - rate * weight_decay)
        else:
            g = g + weight_decay * w
    m = torch.lerp(m, g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2 ** t).sqrt() + eps
    return w - (rate / (1 - beta1 ** t)) * m / denom, m, v


class UpdateOperation(Operation):
    """Base of the fused optimizer updates: an update is not differentiated (no gradient flows back)."""

    @property
    def has_gradient(self):
        return False

    def gradient(self, grad_ys):
        return [None] * len(self.inputs)


class FusedAdamUpdate(UpdateOperation):
    """The new value, first and second moment of one variable after an Adam/AdamW step, in one kernel.

    Inputs: ``var`` (any float dtype, shape ``S``), ``grad`` (the same dims as ``var``, any order),
    slots ``m``, ``v`` (float32, shape ``S``), the int step count (0-dim, updates before this one) and
    the learning rate (a float, or a 0-dim Tensor from a schedule).
    Outputs: new ``var`` value, ``m``, ``v``: float32, shape ``S``. Numerically PyTorch's fused kernel
    (``torch.optim.AdamW(fused=True)``): equal to the graph-op formulas to float32 rounding.
    Not differentiable (an update, as every optimizer op).
    """

    def __init__(self, var: Tensor, grad: Tensor, m: Tensor, v: Tensor, step: Tensor, lr, *, beta1: float,
                 beta2: float, epsilon: float, weight_decay: float, decoupled: bool, name: str | None = None):
        scheduled = isinstance(lr, Tensor)
        super().__init__([var, grad, m, v, step] + ([lr] if scheduled else []), name=name or "fused_adam_update")
        self.params = {"lr": 0.0 if scheduled else float(lr), "beta1": float(beta1), "beta2": float(beta2),
                       "eps": float(epsilon), "weight_decay": float(weight_decay), "decoupled": bool(decoupled)}
        self.outputs = [Tensor(self, var.shape, torch.float32, index=i) for i in range(3)]

    def lower(self, lw):
        shape = self.outputs[0].shape
        aligns = tuple(align_spec(x.shape, shape) if x.shape.ndims else None for x in self.inputs)
        kernel = functools.partial(_k_fused_adam, **self.params)
        if any(a is not None for a in aligns):
            kernel = functools.partial(apply_aligned, fn=kernel, aligns=aligns)
        outs = lw.slicewise(kernel, *[lw.get(x) for x in self.inputs], num_outputs=3)
        for t, s in zip(self.outputs, outs, strict=True):
            lw.set(t, s)


class FusedAdamGroupUpdate(UpdateOperation):
    """New values, first and second moments of ``n`` variables after one Adam/AdamW step, in ONE kernel call.

    ``torch.optim.AdamW(fused=True)``'s multi-tensor step: per processor, one ``torch._fused_adamw_`` call on
    the lists of its slices of all ``n`` variables (instead of ``n`` calls of :class:`FusedAdamUpdate`).
    Inputs: ``variables`` (values, any float dtype, shapes ``S_i``), ``grads`` (the dims of ``S_i``, any
    order), slots ``ms``, ``vs`` (float32, ``S_i``), the int step count (0-dim) and the learning rate (float or
    0-dim Tensor); optionally ``found_inf`` (float32 0-dim, :mod:`meshtorch.optim.loss_scale`): 1.0 skips the
    step (every output equals its input), as ``torch.amp.GradScaler`` with a fused optimizer. All on one mesh.
    Outputs: ``n`` new values, then ``n`` ``m``, then ``n`` ``v``, float32, shapes ``S_i``; equal elementwise
    to :class:`FusedAdamUpdate` on each variable (the same kernel).
    Not differentiable. Source: PyTorch ``torch.optim.AdamW(fused=True)`` (``_fused_adamw``).

    Raises:
        ValueError: if the lists differ in length, are empty, or span several meshes.
    """

    def __init__(self, variables, grads, ms, vs, step: Tensor, lr, *, beta1: float, beta2: float, epsilon: float,
                 weight_decay: float, decoupled: bool, found_inf: Tensor | None = None, name: str | None = None):
        n = len(variables)
        if not n or not len(grads) == len(ms) == len(vs) == n:
            raise ValueError(f"FusedAdamGroupUpdate: {n} variables, {len(grads)} gradients, {len(ms)} m and "
                             f"{len(vs)} v slots; give the same positive number of each.")
        if len({x.mesh for x in [*variables, *grads, *ms, *vs]}) != 1:
            raise ValueError("FusedAdamGroupUpdate: the variables span several meshes; build one group per mesh.")
        scheduled = isinstance(lr, Tensor)
        super().__init__([*variables, *ms, *vs, *grads, step] + ([lr] if scheduled else [])
                         + ([found_inf] if found_inf is not None else []), name=name or "fused_adam_group_update")
        self.n = n
        self.params = {"lr": 0.0 if scheduled else float(lr), "beta1": float(beta1), "beta2": float(beta2),
                       "eps": float(epsilon), "weight_decay": float(weight_decay), "decoupled": bool(decoupled),
                       "skippable": found_inf is not None}
        self.outputs = [Tensor(self, x.shape, torch.float32, index=i)
                        for i, x in enumerate([*variables, *variables, *variables])]

    def lower(self, lw):
        n = self.n
        aligns = tuple(align_spec(g.shape, w.shape) for g, w in zip(self.inputs[3 * n:4 * n], self.inputs[:n],
                                                                     strict=True))
        kernel = functools.partial(_k_fused_adam_group, n=n, aligns=aligns, **self.params)
        outs = lw.slicewise(kernel, *[lw.get(x) for x in self.inputs], num_outputs=3 * n)
        for t, s in zip(self.outputs, outs, strict=True):
            lw.set(t, s)

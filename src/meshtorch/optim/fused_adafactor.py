"""Fused Adafactor update: a few kernels per variable slice instead of about twenty elementwise ops.

:class:`FusedAdafactorUpdate` computes what :meth:`meshtorch.optim.adafactor.AdafactorOptimizer.apply_grad`
writes as graph ops (the formulas are in that module's docstring), as four kernels on each
processor's slices with the only communication the update needs in between: an all-reduce of each
partial statistic over the mesh axes splitting the dims it reduces (the row and column sums of the
squared gradient, the parameter RMS, the long-term row mean, the update RMS). With no reduced dim
split (data parallelism, or storage rules on other dims) there is no collective and the kernels run
back to back. Intermediate statistics keep the reduced dims with size 1 (``keepdim``) so they
broadcast against the slice.

Source: Shazeer & Stern 2018 (Adafactor); Mesh TF ``AdafactorOptimizer`` (mesh_tensorflow/optimize.py).
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.graph import Tensor
from meshtorch.lowering.layout import slice_nbytes
from meshtorch.ops._kernels import align_spec, apply_aligned
from meshtorch.optim.fused import UpdateOperation

__all__ = ["FusedAdafactorUpdate"]

_F32 = torch.float32


def _k_stats_factored(w, g, *, i0: int, i1: int, w_dims: tuple, eps1: float, param_scale: bool):
    """Partial sums: of ``g^2 + eps1`` over d0 and over d1, and of ``w^2`` over ``w_dims`` (keepdim)."""
    g2 = torch.square(g.to(_F32)) + eps1
    ws = torch.square(w.to(_F32)).sum(w_dims, keepdim=True) if param_scale else torch.zeros(())
    return g2.sum(i0, keepdim=True), g2.sum(i1, keepdim=True), ws


def _k_moments(vr, vc, s0, s1, decay, *, i0: int, i1: int, n0: int, n1: int):
    """New row / column moments and the local sum of the new row moment over d1 (vr coordinates)."""
    new_vr = vr * decay + (s0.squeeze(i0) / n0) * (1.0 - decay)
    new_vc = vc * decay + (s1.squeeze(i1) / n1) * (1.0 - decay)
    return new_vr, new_vc, new_vr.sum(i1 - (i1 > i0), keepdim=True)


def _k_x_factored(g, new_vr, new_vc, row_sum, *, i0: int, i1: int, n1: int, clip: bool):
    """``x = g rsqrt(vr / mean_d1(vr)) rsqrt(vc)`` and the local sum of ``x^2``."""
    x = g.to(_F32) * torch.rsqrt(new_vr / (row_sum / n1)).unsqueeze(i0) * torch.rsqrt(new_vc).unsqueeze(i1)
    return x, (torch.square(x).sum() if clip else torch.zeros(()))


def _k_unfactored(w, g, v, decay, *, w_dims: tuple, eps1: float, param_scale: bool, clip: bool):
    """New second moment ``v``, ``x = g rsqrt(v)``, and the local sums of ``x^2`` and ``w^2``."""
    g = g.to(_F32)
    new_v = v * decay + (torch.square(g) + eps1) * (1.0 - decay)
    x = g * torch.rsqrt(new_v)
    ws = torch.square(w.to(_F32)).sum(w_dims, keepdim=True) if param_scale else torch.zeros(())
    return new_v, x, (torch.square(x).sum() if clip else torch.zeros(())), ws


def _k_apply(w, x, xs, ws, lr, *m, n_all: int, n_w: int, clip: float, param_scale: bool, eps2: float,
             beta1: float):
    """Clip ``x`` by its RMS, scale by ``lr`` (times the parameter RMS), momentum; (new w[, new m])."""
    if clip:
        x = x / torch.clamp_min(torch.sqrt(xs / n_all) / clip, 1.0)
    scale = torch.clamp_min(torch.sqrt(ws / n_w), eps2) * lr if param_scale else lr
    sub = x * scale
    if beta1:
        sub = m[0] * beta1 + sub * (1.0 - beta1)
        return w.to(_F32) - sub, sub
    return w.to(_F32) - sub


class FusedAdafactorUpdate(UpdateOperation):
    """New value and slots of one variable after an Adafactor step (Mesh TF's formulas), fused.

    Inputs: ``var`` (float, shape ``S``), ``grad`` (``S``'s dims in any order), ``decay`` and ``lr``
    (float32 scalars), then the slots: ``vr`` (``S - d0``) and ``vc`` (``S - d1``) if ``factored_dims``
    is ``(d0, d1)``, else ``v`` (``S``); then ``m`` (``S``) if ``beta1``. Outputs (float32): new var
    value, new ``vr``, ``vc`` (or ``v``), new ``m`` if ``beta1``. ``stacked``: dims the parameter
    RMS is taken per index of. Not differentiable (an update).
    """

    def __init__(self, var: Tensor, grad: Tensor, decay: Tensor, lr: Tensor, slots, *, factored_dims, stacked=(),
                 beta1: float = 0.0, clipping_threshold=1.0, epsilon1: float = 1e-30, epsilon2: float = 1e-3,
                 param_scale: bool = True, name: str | None = None):
        super().__init__([var, grad, decay, lr, *slots], name=name or "fused_adafactor_update")
        names = var.shape.dimension_names
        self.factored = factored_dims is not None
        self.i0, self.i1 = (names.index(factored_dims[0].name), names.index(factored_dims[1].name)) \
            if self.factored else (None, None)
        self.stacked = tuple(d if isinstance(d, str) else d.name for d in stacked)
        self.beta1, self.clip = float(beta1), (None if clipping_threshold is None else float(clipping_threshold))
        self.eps1, self.eps2, self.param_scale = float(epsilon1), float(epsilon2), bool(param_scale)
        self.outputs = [Tensor(self, var.shape, _F32, index=0)] + [
            Tensor(self, s.shape, _F32, index=i + 1) for i, s in enumerate(slots)]

    def lower(self, lw):
        w_t, g_t = self.inputs[0], self.inputs[1]
        shape = w_t.shape
        lay = lw.tensor_layout(w_t)
        local = lw.slice_shape(w_t)
        w_dims = tuple(i for i, d in enumerate(shape.dims) if d.name not in self.stacked)
        n_w = 1
        for i in w_dims:
            n_w *= shape.dims[i].size

        def axes(dims):  # mesh axes splitting any of these dims of the variable
            return sorted({lay[i] for i in dims if lay[i] is not None})

        def reduce(slot, dims, keep_shape):  # all-reduce a partial sum over the axes splitting ``dims``
            s = lw.allreduce(slot, axes(dims), "SUM", w_t, keep_shape)
            lw.slot_bytes.setdefault(s, slice_nbytes(keep_shape, _F32))
            return s

        def kept(dims):
            return [1 if i in dims else n for i, n in enumerate(local)]

        align = align_spec(g_t.shape, shape)
        slots = [lw.get(x) for x in self.inputs]
        w, g, decay, lr = slots[:4]
        clip = self.clip is not None
        if self.factored:
            i0, i1 = self.i0, self.i1
            vr, vc = slots[4:6]
            k = functools.partial(_k_stats_factored, i0=i0, i1=i1, w_dims=w_dims, eps1=self.eps1,
                                  param_scale=self.param_scale)
            if align is not None:
                k = functools.partial(apply_aligned, fn=k, aligns=(None, align))
            s0, s1, ws = lw.slicewise(k, w, g, num_outputs=3)
            s0, s1 = reduce(s0, [i0], kept([i0])), reduce(s1, [i1], kept([i1]))
            n0, n1 = shape.dims[i0].size, shape.dims[i1].size
            new_vr, new_vc, row_sum = lw.slicewise(
                functools.partial(_k_moments, i0=i0, i1=i1, n0=n0, n1=n1), vr, vc, s0, s1, decay, num_outputs=3)
            row_sum = reduce(row_sum, [i1], [1 if i == i1 else n for i, n in enumerate(local) if i != i0])
            k = functools.partial(_k_x_factored, i0=i0, i1=i1, n1=n1, clip=clip)
            if align is not None:
                k = functools.partial(apply_aligned, fn=k, aligns=(align, None, None, None))
            x, xs = lw.slicewise(k, g, new_vr, new_vc, row_sum, num_outputs=2)
            new_slots = [new_vr, new_vc]
        else:
            v = slots[4]
            k = functools.partial(_k_unfactored, w_dims=w_dims, eps1=self.eps1, param_scale=self.param_scale,
                                  clip=clip)
            if align is not None:
                k = functools.partial(apply_aligned, fn=k, aligns=(None, align, None, None))
            new_v, x, xs, ws = lw.slicewise(k, w, g, v, decay, num_outputs=4)
            new_slots = [new_v]
        lw.slot_bytes.setdefault(x, slice_nbytes(local, _F32))
        if clip:
            xs = reduce(xs, range(len(local)), [])
        if self.param_scale:
            ws = reduce(ws, w_dims, kept(w_dims))
        apply = functools.partial(_k_apply, n_all=shape.size, n_w=n_w, clip=self.clip or 0.0,
                                  param_scale=self.param_scale, eps2=self.eps2, beta1=self.beta1)
        m = slots[4 + len(new_slots):]
        if self.beta1:
            new_w, new_m = lw.slicewise(apply, w, x, xs, ws, lr, *m, num_outputs=2)
            new_slots.append(new_m)
        else:
            new_w = lw.slicewise(apply, w, x, xs, ws, lr)
        for t, s in zip(self.outputs, [new_w, *new_slots], strict=True):
            lw.set(t, s)

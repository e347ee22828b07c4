"""SGD and momentum for all variables of a mesh in one multi-tensor step (``torch._foreach_*`` kernels).

``torch.optim.SGD(foreach=True)``'s step: per processor, each elementwise stage of the update is one
``torch._foreach_*`` call on the lists of all its variables' slices, instead of one kernel per variable and
stage. The stages are those of :mod:`meshtorch.optim.sgd`'s graph ops, in the same order and with the same
roundings (``g + w wd``, ``v m + g`` or ``g lr + v m``, ``w - v lr`` or ``w - v``), so the values are
bit-identical to the per-variable graph ops.

Source: PyTorch ``torch.optim.SGD`` (``_multi_tensor_sgd``); the formulas are :mod:`meshtorch.optim.sgd`'s.
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.graph import Tensor
from meshtorch.ops._kernels import align_spec, aligned
from meshtorch.optim.fused import UpdateOperation

__all__ = ["ForeachSgdGroupUpdate"]


def _k_sgd_group(*xs, n: int, aligns, momentum: float | None, weight_decay: float, fold: bool, lr: float,
                 donate=False):
    """New ``(w_1..w_n[, v_1..v_n])`` of ``n`` slices: ``xs`` = ``w_1..w_n[, v_1..v_n], g_1..g_n[, lr]``.

    ``momentum`` None: plain SGD (no ``v``). ``lr``: the float rate unless a 0-dim rate tensor ends ``xs``.
    ``donate``: True, or a tuple of bools per ``w``/``v``: update those in place
    (:mod:`meshtorch.lowering.donate`); the others are copied first, then the same in-place multi-tensor calls
    run on all (one call per stage, as ``torch.optim.SGD(foreach=True)``'s step). Nothing donated: new tensors.
    """
    k = 2 if momentum is not None else 1
    ws, vs = list(xs[:n]), list(xs[n:2 * n]) if momentum is not None else []
    gs = [aligned(g, a) for g, a in zip(xs[k * n:(k + 1) * n], aligns, strict=True)]
    rate = xs[(k + 1) * n] if len(xs) > (k + 1) * n else lr
    flags = tuple(donate) if isinstance(donate, tuple) else (bool(donate),) * (k * n)
    if ws[0].dtype == torch.float32 and not torch.compiler.is_compiling():
        # float factors as 0-dim float32 tensors: the CPU multi-tensor fallback wraps a Python scalar into a
        # tensor per list element (4 aten calls each); a float32 kernel rounds the scalar to float32 either way
        momentum, rate = (torch.full((), x, dtype=torch.float32) if isinstance(x, float) else x
                          for x in (momentum, rate))
        weight_decay = torch.full((), weight_decay, dtype=torch.float32) if weight_decay else 0.0
    if isinstance(weight_decay, torch.Tensor) or weight_decay:
        gs = torch._foreach_add(gs, torch._foreach_mul(ws, weight_decay))
    if any(flags) and not torch.compiler.is_compiling():  # in place, as torch's step; undonated ones on copies
        ws, vs = ([t if d else t.clone() for t, d in zip(ts, flags[j * n:(j + 1) * n], strict=True)]
                  for j, ts in enumerate((ws, vs)))
        if momentum is not None:
            torch._foreach_mul_(vs, momentum)
            torch._foreach_add_(vs, torch._foreach_mul(gs, rate) if fold else gs)  # v m + g lr == g lr + v m
        torch._foreach_sub_(ws, vs if fold and momentum is not None else torch._foreach_mul(
            vs if momentum is not None else gs, rate))
        return _results([*ws, *vs])
    if momentum is None:
        steps = torch._foreach_mul(gs, rate)
    elif fold:
        new_vs = torch._foreach_add(torch._foreach_mul(gs, rate), torch._foreach_mul(vs, momentum))
        steps = new_vs
    else:
        new_vs = torch._foreach_add(torch._foreach_mul(vs, momentum), gs)
        steps = torch._foreach_mul(new_vs, rate)
    new_ws = torch._foreach_sub(ws, steps)
    outs = list(new_ws) + (list(new_vs) if momentum is not None else [])
    if any(flags):  # compiled: the new values copied into the donated storage (graph-input mutations)
        olds = ws + vs
        for i, f in enumerate(flags):
            if f:
                outs[i] = olds[i].copy_(outs[i])
    return _results(outs)


def _results(outs):
    """A slicewise kernel's results: a tuple, or the one tensor when there is one output."""
    return tuple(outs) if len(outs) > 1 else outs[0]


def _sgd_donates(*, n: int, momentum=None, **_):
    """Inputs of :func:`_k_sgd_group` it may update in place: the ``w`` (and ``v``), outputs in that order."""
    return tuple(range(2 * n if momentum is not None else n))


_k_sgd_group.donates = _sgd_donates
_k_sgd_group.fresh_outputs = True


class ForeachSgdGroupUpdate(UpdateOperation):
    """New values (and momentum slots) of ``n`` variables after one SGD / momentum step, multi-tensor.

    Inputs: ``variables`` (value tensors, shapes ``S_i``, any float dtype), ``slots`` (momentum, shapes
    ``S_i``, the variable's dtype; empty for plain SGD), ``grads`` (the dims of ``S_i``, any order, the
    variable's dtype), the learning rate: a float, or a 0-dim Tensor in the variables' dtype (as
    :meth:`Optimizer.lr_for`; a group holds variables of one dtype). Outputs: ``n`` new values, then ``n`` new
    slots, each in its variable's dtype. Not differentiable.

    Raises:
        ValueError: if the lists differ in length, are empty, or span several meshes.
    """

    def __init__(self, variables, slots, grads, lr, *, momentum: float | None, weight_decay: float, fold: bool,
                 name: str | None = None):
        n = len(variables)
        if not n or len(grads) != n or len(slots) not in (0, n) or (momentum is None) != (not slots):
            raise ValueError(f"ForeachSgdGroupUpdate: {n} variables, {len(slots)} slots, {len(grads)} gradients; "
                             "give one gradient (and one momentum slot with momentum) per variable.")
        if len({x.mesh for x in [*variables, *slots, *grads]}) != 1 or len({x.dtype for x in variables}) != 1:
            raise ValueError("ForeachSgdGroupUpdate: the variables span several meshes or dtypes; build one group "
                             "per mesh and dtype.")
        scheduled = isinstance(lr, Tensor)
        super().__init__([*variables, *slots, *grads] + ([lr] if scheduled else []), name=name or "sgd_group_update")
        self.n = n
        self.params = {"momentum": None if momentum is None else float(momentum),
                       "weight_decay": float(weight_decay), "fold": bool(fold), "lr": 0.0 if scheduled else float(lr)}
        self.outputs = [Tensor(self, x.shape, x.dtype, index=i) for i, x in enumerate([*variables, *slots])]

    def lower(self, lw):
        n, k = self.n, 2 if self.params["momentum"] is not None else 1
        aligns = tuple(align_spec(g.shape, w.shape) for g, w in zip(self.inputs[k * n:(k + 1) * n], self.inputs[:n],
                                                                     strict=True))
        kernel = functools.partial(_k_sgd_group, n=n, aligns=aligns, **self.params)
        outs = lw.slicewise(kernel, *[lw.get(x) for x in self.inputs], num_outputs=len(self.outputs))
        outs = outs if len(self.outputs) > 1 else [outs]  # one output: slicewise returns its slot alone
        for t, s in zip(self.outputs, outs, strict=True):
            lw.set(t, s)

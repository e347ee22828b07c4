"""Adafactor for all variables of a mesh in one multi-tensor step (``torch._foreach_*`` kernels).

:class:`ForeachAdafactorGroupUpdate` computes what :class:`~meshtorch.optim.fused_adafactor.FusedAdafactorUpdate`
computes for one variable (the formulas are :mod:`meshtorch.optim.adafactor`'s), for ``n`` variables at once:
per processor, each elementwise stage of the update is one ``torch._foreach_*`` call on the lists of all the
variables' slices (``torch.optim.Adafactor(foreach=True)``'s way), and the statistics' reductions over dims (row
and column sums, the parameter's and the update's sums of squares) stay one ``sum`` per slice, as they differ in
shape per variable. The step is four kernels with the statistics' all-reduces in between, for all variables:

1. ``stats``: of the factored variables the row and column sums of ``g^2 + eps1``, of every parameter-scaled one
   the sum of ``w^2``;
2. ``moments``: the new ``vr``, ``vc`` (factored) and ``v`` (unfactored), in place where the plan donates them;
   the sum of ``vr`` over ``d1``; of the unfactored ones ``x = g rsqrt(v)`` and its sum of squares;
3. ``x`` (factored): ``x = g rsqrt(vr / mean_d1(vr)) rsqrt(vc)`` and its sum of squares;
4. ``apply``: update clipping, parameter scale, momentum, ``w - u`` (``w`` and ``m`` in place where donated).

Each statistic is all-reduced over the mesh axes splitting the dims it reduces, as in the per-variable op; the
all-reduces after one stage are consecutive steps with no kernel between them, so the plan's reduction buckets
(:func:`meshtorch.lowering.schedule.bucket_reductions`, on by default for process-group meshes) issue each
stage's statistics over the same mesh axes as one collective call, not one per variable and statistic.

Per element the stages use the per-variable op's operations in the same order with the same operands, so on the
CPU (whose multi-tensor kernels call the per-tensor ones) the values are bitwise equal to it. On CUDA the
``_foreach`` fast path uses its own kernels (equal to float32 rounding). On the CPU the float factors go in as
cached 0-dim float32 tensors (:func:`_scalar`), squares as ``t * t`` and squeezes as views: per element the same
operations, fewer aten calls (PyTorch's CPU fallback wraps a Python scalar once per list element).

Source: Shazeer & Stern 2018 (Adafactor); Mesh TF ``AdafactorOptimizer``; PyTorch ``torch.optim.Adafactor``
(``_multi_tensor_adafactor``).
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.graph import Tensor
from meshtorch.lowering.layout import slice_nbytes
from meshtorch.ops._kernels import align_spec, aligned
from meshtorch.optim.foreach_sgd import _results
from meshtorch.optim.fused import UpdateOperation

__all__ = ["ForeachAdafactorGroupUpdate"]

_F32 = torch.float32


def _f32(ts):
    return [t if t.dtype == _F32 else t.to(_F32) for t in ts]


_SCALARS: dict = {}


def _scalar(x: float, like: torch.Tensor | None):
    """``x`` as the float operand of a multi-tensor call on a list of ``like``'s device: on the CPU (eager) a
    cached 0-dim float32 tensor, else the Python float.

    PyTorch's CPU multi-tensor fallback calls the per-tensor op per element and wraps a Python scalar into a
    tensor each time (``to``, ``_to_copy``, ``empty_strided``, ``copy_``: 4 aten calls per element); a 0-dim
    float32 operand is the float32 value a float32 kernel rounds the scalar to, so the results are the same bits.
    On CUDA the scalar-list overloads are one fused launch (and under ``torch.compile`` constants), so the floats
    stay."""
    if like is None or like.device.type != "cpu" or torch.compiler.is_compiling():
        return x
    key = float(x)
    t = _SCALARS.get(key)
    if t is None:
        t = _SCALARS[key] = torch.full((), key, dtype=_F32)
    return t


def _scalars(xs, like: torch.Tensor | None) -> list:
    """:func:`_scalar` of each of ``xs`` (one per list element)."""
    return [_scalar(x, like) for x in xs]


def _first(ts):
    return ts[0] if len(ts) else None


def _sums(ts, dims):
    """``t.sum(d, keepdim=True)`` per tensor (``d``: an int or a tuple of dims per tensor)."""
    return [t.sum(d, keepdim=True) for t, d in zip(ts, dims, strict=True)]


def _drop(t, i: int):
    """``t.squeeze(i)`` as one ``view`` (``squeeze`` is two aten calls; the same tensor)."""
    return t.view(t.shape[:i] + t.shape[i + 1:])


def _insert(t, i: int):
    """``t.unsqueeze(i)`` as one ``view`` (``t`` contiguous: a fresh kernel result)."""
    return t.view(t.shape[:i] + (1,) + t.shape[i:])


def _written_back(olds, news, flags):
    """``news``, where ``flags`` marks a donated float32 contiguous input (compiled: the kernel computes out of
    place), copied into that input's storage (a graph-input mutation inductor stores in place) and returned."""
    if not any(flags):
        return news
    return [o.copy_(t) if f and o.dtype == _F32 and o.is_contiguous() else t
            for o, t, f in zip(olds, news, flags, strict=True)]


def _plus(fresh, other):
    """``fresh + other`` written into ``fresh`` (new tensors of the kernel's own): one list of temporaries.
    A 0-dim tensor ``other`` goes in as a list (the CPU fallback of the one-tensor overload reads it back with
    ``item()`` and wraps it per element)."""
    torch._foreach_add_(fresh, [other] * len(fresh) if isinstance(other, torch.Tensor) else other)
    return fresh


def _times(x, factors, in_place: bool):
    """``x * factors`` (per tensor), in ``x`` if ``in_place`` (``x`` fresh in the kernel)."""
    if in_place:
        torch._foreach_mul_(x, factors)
        return x
    return torch._foreach_mul(x, factors)


def _sq_sums(ts):
    """The sum of ``t^2`` of each tensor, keepdim (all dims of size 1): ``t * t`` is ``square(t)`` (one aten call
    for three), and the full sum with ``keepdim`` one call fewer than ``sum()``; the same bits."""
    return [torch.mul(t, t).sum(tuple(range(t.dim())), keepdim=True) for t in ts]


def _k_stats(*xs, nf: int, i0s, i1s, wdims, aligns, eps1: float):
    """Stage 1. ``xs``: ``w_F, g_F, w_U`` (``F``: the ``nf`` factored variables, ``U`` the others; ``aligns``:
    the ``g_F``'s :func:`~meshtorch.ops._kernels.align_spec`); ``wdims``: per variable (F then U) the dims of
    ``w^2`` to sum, or None (no parameter scale). Returns ``s0_F, s1_F, ws``: the sums of ``g^2 + eps1`` over
    ``d0`` / ``d1`` and (the scaled variables) of ``w^2`` over ``wdims``, all keepdim."""
    wf, gf, wu = xs[:nf], xs[nf:2 * nf], xs[2 * nf:]
    gf = _f32([aligned(g, a) for g, a in zip(gf, aligns, strict=True)])
    g2 = _plus(torch._foreach_mul(gf, gf), _scalar(eps1, _first(gf))) if nf else []
    sums = [*_sums(g2, i0s), *_sums(g2, i1s)]
    del g2  # freed before the list of w^2: one full-size list of temporaries at a time
    ws = _f32([w for w, d in zip([*wf, *wu], wdims, strict=True) if d is not None])
    ws_sums = _sums(torch._foreach_mul(ws, ws), [d for d in wdims if d is not None]) if ws else []
    return _results([*sums, *ws_sums])


def _k_moments(*xs, nf: int, nu: int, i0s, i1s, n0s, n1s, aligns, eps1: float, clip: bool, donate=False):
    """Stage 2: the new second moments. ``xs``: ``vr_F, vc_F, v_U, s0_F, s1_F, g_U, decay`` (the sums
    all-reduced; ``aligns``: the ``g_U``'s). Returns ``new vr_F, vc_F, v_U``, ``row_sum_F``, ``x_U`` and (clip)
    their sums of squares: ``vr decay + (s0 / n0)(1 - decay)`` (``vc`` likewise), the sum of the new ``vr`` over
    ``d1`` (keepdim), ``v decay + (g^2 + eps1)(1 - decay)`` and ``x = g rsqrt(v)``.
    ``donate``: True or a tuple of ``2 nf + nu`` bools: those ``vr``/``vc``/``v`` are updated in place."""
    k = 2 * nf + nu
    olds, s0, s1 = list(xs[:k]), xs[k:k + nf], xs[k + nf:k + 2 * nf]
    gu = _f32([aligned(g, a) for g, a in zip(xs[k + 2 * nf:-1], aligns, strict=True)])
    decay = xs[-1]
    one = _scalar(1.0, decay)
    mix = torch.sub(one, decay) if isinstance(one, torch.Tensor) else 1.0 - decay  # rsub: 6 aten calls
    like = _first(olds)
    adds = [*(torch._foreach_div([_drop(s, i) for s, i in zip(s0, i0s, strict=True)], _scalars(n0s, like))
              if nf else []),
            *(torch._foreach_div([_drop(s, i) for s, i in zip(s1, i1s, strict=True)], _scalars(n1s, like))
              if nf else []),
            *(_plus(torch._foreach_mul(gu, gu), _scalar(eps1, like)) if nu else [])]
    torch._foreach_mul_(adds, mix)  # fresh tensors: scaled in place (the same rounding)
    flags = tuple(donate) if isinstance(donate, tuple) else (bool(donate),) * k
    if any(flags) and not torch.compiler.is_compiling():  # in place, the same two roundings
        new = [t if d and t.dtype == _F32 and t.is_contiguous() else t.clone() for t, d in zip(olds, flags,
                                                                                                strict=True)]
        torch._foreach_mul_(new, decay)
        torch._foreach_add_(new, adds)
    else:
        new = _written_back(olds, torch._foreach_add(torch._foreach_mul(olds, decay), adds), flags)
    row_sum = _sums(new[:nf], [i1 - (i1 > i0) for i0, i1 in zip(i0s, i1s, strict=True)])
    x = torch._foreach_rsqrt(new[2 * nf:]) if nu else []
    if nu:
        torch._foreach_mul_(x, gu)  # rsqrt(v) g == g rsqrt(v)
    return _results([*new, *row_sum, *x, *(_sq_sums(x) if clip else [])])


def _k_x(*xs, nf: int, i0s, i1s, n1s, aligns, clip: bool):
    """Stage 3. ``xs``: ``g_F, new vr_F, new vc_F, row_sum_F`` (all-reduced). Returns ``x_F`` and (clip) the
    sums of ``x^2``: ``x = g rsqrt(vr / (row_sum / n1)) rsqrt(vc)``, the factors unsqueezed to ``g``'s dims."""
    g, vr, vc, row_sum = (list(xs[k * nf:(k + 1) * nf]) for k in range(4))
    g = _f32([aligned(t, a) for t, a in zip(g, aligns, strict=True)])
    r = torch._foreach_rsqrt(torch._foreach_div(vr, torch._foreach_div(row_sum, _scalars(n1s, _first(vr)))))
    c = torch._foreach_rsqrt(vc)
    x = torch._foreach_mul(g, [_insert(t, i) for t, i in zip(r, i0s, strict=True)])
    torch._foreach_mul_(x, [_insert(t, i) for t, i in zip(c, i1s, strict=True)])  # one full-size list
    return _results([*x, *(_sq_sums(x) if clip else [])])


def _k_apply(*xs, n: int, n_alls, n_ws, scaled, clip: float, eps2: float, beta1: float, donate=False):
    """Stage 4. ``xs``: ``w, m (if beta1), x, xs (if clip), ws (the scaled ones), lr`` (sums all-reduced).

    ``x /= max(sqrt(xs / n_all) / clip, 1)``; ``u = x max(sqrt(ws / n_w), eps2) lr`` (``x lr`` unscaled);
    ``u = m beta1 + u (1 - beta1)`` (beta1); returns ``w - u`` and (beta1) the new ``m`` (= ``u``), float32.
    ``donate``: True or a tuple of bools per ``w`` and ``m``: those are updated in place.
    """
    k = 2 if beta1 else 1
    ws, ms = list(xs[:n]), list(xs[n:2 * n]) if beta1 else []
    x = list(xs[k * n:(k + 1) * n])
    rest = list(xs[(k + 1) * n:])
    lr = rest.pop()
    like = ws[0]
    if clip:
        sq, rest = rest[:n], rest[n:]
        d = torch._foreach_clamp_min(torch._foreach_div(torch._foreach_sqrt(torch._foreach_div(
            sq, _scalars(n_alls, like))), _scalar(clip, like)), 1.0)
        x = torch._foreach_div(x, d)  # fresh: scaled in place below
    if rest:
        s = torch._foreach_mul(torch._foreach_clamp_min(torch._foreach_sqrt(torch._foreach_div(
            rest, _scalars([n_ws[i] for i in range(n) if scaled[i]], like))), eps2), lr)
        it = iter(s)
        sub = _times(x, [next(it) if scaled[i] else lr for i in range(n)], in_place=bool(clip))
    else:
        sub = _times(x, lr, in_place=bool(clip))
    flags = tuple(donate) if isinstance(donate, tuple) else (bool(donate),) * (k * n)
    if any(flags) and not torch.compiler.is_compiling():  # in place, as torch's step; undonated ones on copies
        olds = ws + ms
        new = [t if d and t.dtype == _F32 and t.is_contiguous() else t.clone() if t.dtype == _F32 else t.to(_F32)
               for t, d in zip(olds, flags, strict=True)]
        new_w, new_m = new[:n], new[n:]
        if beta1:
            torch._foreach_mul_(new_m, _scalar(beta1, like))
            torch._foreach_add_(new_m, torch._foreach_mul(sub, _scalar(1.0 - beta1, like)))
            sub = new_m
        torch._foreach_sub_(new_w, sub)
        return _results([*new_w, *new_m])
    if beta1:
        torch._foreach_mul_(sub, _scalar(1.0 - beta1, like))  # a fresh list
        sub = _plus(torch._foreach_mul(ms, _scalar(beta1, like)), sub)
    return _results(_written_back(ws + ms, [*torch._foreach_sub(_f32(ws), sub), *(sub if beta1 else [])], flags))


def _moments_donates(*, nf: int, nu: int, **_):
    return tuple(range(2 * nf + nu))


def _apply_donates(*, n: int, beta1: float, **_):
    return tuple(range(2 * n if beta1 else n))


for _k, _d in ((_k_moments, _moments_donates), (_k_apply, _apply_donates)):
    _k.donates = _d  # inputs updated in place under donate=True (meshtorch.lowering.donate), outputs first
for _k in (_k_stats, _k_moments, _k_x, _k_apply):
    _k.fresh_outputs = True  # without donate its outputs are new tensors


def _tuple(out, k: int) -> tuple:
    return (out,) if k == 1 else tuple(out)


class ForeachAdafactorGroupUpdate(UpdateOperation):
    """New values and slots of ``n`` variables after one Adafactor step (Mesh TF's formulas), multi-tensor.

    Inputs: ``variables`` (value tensors, any float dtype, shapes ``S_i``), ``grads`` (the dims of ``S_i``, any
    order), ``decay`` and ``lr`` (float32 scalars), ``slots[i]``: variable ``i``'s ``[vr, vc]`` (``S_i - d0``,
    ``S_i - d1``) if ``factored_dims[i]`` is ``(d0, d1)``, else ``[v]`` (``S_i``), then ``m`` (``S_i``) if
    ``beta1``. ``param_scale[i]``: scale variable ``i``'s update by its RMS (per index of the ``stacked`` dims).
    Outputs (float32): the ``n`` new values, then the new slots in the order given. Per element equal to
    :class:`~meshtorch.optim.fused_adafactor.FusedAdafactorUpdate` on each variable. Not differentiable.

    Raises:
        ValueError: if the lists differ in length, are empty, or span several meshes.
    """

    def __init__(self, variables, grads, decay: Tensor, lr: Tensor, slots, *, factored_dims, param_scale,
                 stacked=(), beta1: float = 0.0, clipping_threshold=1.0, epsilon1: float = 1e-30,
                 epsilon2: float = 1e-3, name: str | None = None):
        n = len(variables)
        if not n or not len(grads) == len(slots) == len(factored_dims) == len(param_scale) == n:
            raise ValueError(f"ForeachAdafactorGroupUpdate: {n} variables, {len(grads)} gradients, {len(slots)} slot "
                             f"lists, {len(factored_dims)} factored dims, {len(param_scale)} parameter-scale flags; "
                             "give one of each per variable.")
        flat = [s for ss in slots for s in ss]
        if len({x.mesh for x in [*variables, *grads, *flat]}) != 1:
            raise ValueError("ForeachAdafactorGroupUpdate: the variables span several meshes; build one group per "
                             "mesh.")
        super().__init__([*variables, *grads, decay, lr, *flat], name=name or "adafactor_group_update")
        self.n = n
        self.n_slots = [len(ss) for ss in slots]
        self.factored = [None if fd is None else (v.shape.dimension_names.index(fd[0].name),
                                                  v.shape.dimension_names.index(fd[1].name))
                         for v, fd in zip(variables, factored_dims, strict=True)]
        self.param_scale = [bool(p) for p in param_scale]
        self.stacked = tuple(d if isinstance(d, str) else d.name for d in stacked)
        self.beta1, self.clip = float(beta1), (None if clipping_threshold is None else float(clipping_threshold))
        self.eps1, self.eps2 = float(epsilon1), float(epsilon2)
        self.outputs = [Tensor(self, x.shape, _F32, index=i) for i, x in enumerate([*variables, *flat])]

    def lower(self, lw):
        n = self.n
        wt, gt = self.inputs[:n], self.inputs[n:2 * n]
        w, g = [lw.get(x) for x in wt], [lw.get(x) for x in gt]
        decay, lr = lw.get(self.inputs[2 * n]), lw.get(self.inputs[2 * n + 1])
        slot_vals, at = [], 2 * n + 2
        for k in self.n_slots:
            slot_vals.append([lw.get(x) for x in self.inputs[at:at + k]])
            at += k
        layout = [lw.tensor_layout(t) for t in wt]
        local = [lw.slice_shape(t) for t in wt]
        wdims = [tuple(j for j, d in enumerate(t.shape.dims) if d.name not in self.stacked) for t in wt]
        n_w = [functools.reduce(lambda a, j, t=t: a * t.shape.dims[j].size, dims, 1) for t, dims in zip(wt, wdims,
                                                                                                        strict=True)]
        aligns = [align_spec(a.shape, b.shape) for a, b in zip(gt, wt, strict=True)]

        def reduce(slots, i_vars, dims_of, keep_of):
            """All-reduce partial sums ``slots`` (of variables ``i_vars``) over the axes splitting ``dims_of(i)``:
            consecutive steps, so the plan's buckets merge those over the same axes into one call."""
            out = []
            for s, i in zip(slots, i_vars, strict=True):
                axes = sorted({layout[i][j] for j in dims_of(i) if layout[i][j] is not None})
                keep = keep_of(i)
                r = lw.allreduce(s, axes, "SUM", wt[i], keep)
                lw.slot_bytes.setdefault(r, slice_nbytes(keep, _F32))
                out.append(r)
            return out

        def kept(i, dims):
            return [1 if j in dims else m for j, m in enumerate(local[i])]

        def without(i, dim):
            return [m for j, m in enumerate(local[i]) if j != dim]

        def ones(i):  # the shape of a full sum kept with keepdim
            return [1] * len(local[i])

        def row_kept(i):
            i0, i1 = self.factored[i]
            return [1 if j == i1 else m for j, m in enumerate(local[i]) if j != i0]

        def record(slots, shapes):
            """The outputs' per-processor bytes, so the memory walk estimates none (a multi-output kernel's
            output would be guessed as large as its largest input)."""
            for s, shape in zip(slots, shapes, strict=True):
                lw.slot_bytes.setdefault(s, slice_nbytes(shape, _F32))
            return slots

        F = [i for i in range(n) if self.factored[i] is not None]
        U = [i for i in range(n) if self.factored[i] is None]
        S = [i for i in [*F, *U] if self.param_scale[i]]
        nf, nu = len(F), len(U)
        i0s = tuple(self.factored[i][0] for i in F)
        i1s = tuple(self.factored[i][1] for i in F)
        clip = self.clip is not None
        k1 = 2 * nf + len(S)
        out = _tuple(lw.slicewise(functools.partial(
            _k_stats, nf=nf, i0s=i0s, i1s=i1s, wdims=tuple(wdims[i] if self.param_scale[i] else None for i in [*F, *U]),
            aligns=tuple(aligns[i] for i in F), eps1=self.eps1),
            *[w[i] for i in F], *[g[i] for i in F], *[w[i] for i in U], num_outputs=k1), k1)
        record(out, [kept(i, [i0]) for i, i0 in zip(F, i0s, strict=True)]
               + [kept(i, [i1]) for i, i1 in zip(F, i1s, strict=True)] + [kept(i, wdims[i]) for i in S])
        # the statistics of stage 1, each over the axes splitting the dims it sums
        s0 = reduce(out[:nf], F, lambda i: [self.factored[i][0]], lambda i: kept(i, [self.factored[i][0]]))
        s1 = reduce(out[nf:2 * nf], F, lambda i: [self.factored[i][1]], lambda i: kept(i, [self.factored[i][1]]))
        ws = dict(zip(S, reduce(out[2 * nf:], S, lambda i: wdims[i], lambda i: kept(i, wdims[i])), strict=True))
        k2 = 2 * nf + nu + nf + nu + (nu if clip else 0)
        out = _tuple(lw.slicewise(functools.partial(
            _k_moments, nf=nf, nu=nu, i0s=i0s, i1s=i1s,
            n0s=tuple(wt[i].shape.dims[i0].size for i, i0 in zip(F, i0s, strict=True)),
            n1s=tuple(wt[i].shape.dims[i1].size for i, i1 in zip(F, i1s, strict=True)),
            aligns=tuple(aligns[i] for i in U), eps1=self.eps1, clip=clip),
            *[slot_vals[i][0] for i in F], *[slot_vals[i][1] for i in F], *[slot_vals[i][0] for i in U], *s0, *s1,
            *[g[i] for i in U], decay, num_outputs=k2), k2)
        record(out, [without(i, i0) for i, i0 in zip(F, i0s, strict=True)]
               + [without(i, i1) for i, i1 in zip(F, i1s, strict=True)] + [local[i] for i in U]
               + [row_kept(i) for i in F] + [local[i] for i in U] + ([ones(i) for i in U] if clip else []))
        new_slots = {i: [a, b] for i, a, b in zip(F, out[:nf], out[nf:2 * nf], strict=True)}
        new_slots.update({i: [v] for i, v in zip(U, out[2 * nf:2 * nf + nu], strict=True)})
        new_vr, new_vc = out[:nf], out[nf:2 * nf]
        row_sum, out = out[2 * nf + nu:3 * nf + nu], out[3 * nf + nu:]
        x = dict(zip(U, out[:nu], strict=True))
        # stage 2's statistics: the row sums (factored), the update's sums of squares (unfactored)
        row_sum = reduce(row_sum, F, lambda i: [self.factored[i][1]], row_kept)
        xs = dict(zip(U, reduce(out[nu:], U, lambda i: range(len(local[i])), ones), strict=True)) \
            if clip else {}
        if nf:
            k3 = nf * (2 if clip else 1)
            out = _tuple(lw.slicewise(functools.partial(
                _k_x, nf=nf, i0s=i0s, i1s=i1s,
                n1s=tuple(wt[i].shape.dims[i1].size for i, i1 in zip(F, i1s, strict=True)),
                aligns=tuple(aligns[i] for i in F), clip=clip),
                *[g[i] for i in F], *new_vr, *new_vc, *row_sum, num_outputs=k3), k3)
            record(out, [local[i] for i in F] + ([ones(i) for i in F] if clip else []))
            x.update(zip(F, out[:nf], strict=True))
            if clip:
                xs.update(zip(F, reduce(out[nf:], F, lambda i: range(len(local[i])), ones), strict=True))
        m = [slot_vals[i][-1] for i in range(n)] if self.beta1 else []
        k4 = 2 * n if self.beta1 else n
        out = _tuple(lw.slicewise(functools.partial(
            _k_apply, n=n, n_alls=tuple(t.shape.size for t in wt), n_ws=tuple(n_w),
            scaled=tuple(self.param_scale), clip=self.clip or 0.0, eps2=self.eps2, beta1=self.beta1),
            *w, *m, *[x[i] for i in range(n)], *([xs[i] for i in range(n)] if clip else []),
            *[ws[i] for i in range(n) if self.param_scale[i]], lr, num_outputs=k4), k4)
        record(out, local + (local if self.beta1 else []))
        new_w, new_m = out[:n], out[n:]
        for i, nm in enumerate(new_m):
            new_slots[i].append(nm)
        flat = [*new_w, *(s for i in range(n) for s in new_slots[i])]
        for t, s in zip(self.outputs, flat, strict=True):
            lw.set(t, s)

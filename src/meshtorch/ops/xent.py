"""Softmax cross-entropy on integer targets, without a one-hot tensor (``F.cross_entropy``'s numbers).

``sparse_softmax_cross_entropy_with_logits(logits, targets, vocab_dim)`` is
``logsumexp(logits) - logits[target]`` per position, as ``torch.nn.functional.cross_entropy(...,
reduction="none")`` and TensorFlow's ``tf.nn.sparse_softmax_cross_entropy_with_logits`` compute it: the
targets stay integers, so no ``[..., vocab]`` one-hot tensor is built, multiplied and summed (Mesh TF's
``mtf.layers.softmax_cross_entropy_with_logits`` one-hot encodes; with a 50k vocabulary those dense
passes cost about as much as the logits matmul's backward on CPU). The gradient is one fused op,
``softmax(logits) * dy - one_hot(target) * dy``, written into one new tensor.

Lowering, ``vocab`` whole on each processor: one slicewise kernel (logsumexp and the target's logit).
``vocab`` split over mesh axes: the local maximum is all-reduced with MAX, the local sum of
``exp(logits - max)`` and the local target logit (zero where the target lies in another processor's
slice) are all-reduced with SUM: three all-reduces of a ``logits.shape - vocab`` tensor, as Megatron-LM's
vocab-parallel cross-entropy does. The gradient needs no communication (each processor's slice of the
softmax uses the all-reduced logsumexp and its own slice offset).
"""

from __future__ import annotations

import functools

import torch

from meshtorch.core.dims import convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._kernels import slice_begin
from meshtorch.ops._util import align_fn
from meshtorch.ops.binary import add, multiply

__all__ = ["sparse_softmax_cross_entropy_with_logits"]

_LOW = (torch.bfloat16, torch.float16)


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The outputs' dtype: float32 for bfloat16 / float16 logits (the loss is computed and kept in float32, as
    ``torch.autocast`` runs ``cross_entropy``), else the logits' dtype."""
    return torch.float32 if dtype in _LOW else dtype


class SparseSoftmaxCrossEntropyOperation(Operation):
    """Outputs ``loss`` and ``log_z`` (both ``logits.shape - vocab_dim``; the logits' dtype, float32 for
    bfloat16 / float16 logits)."""

    def __init__(self, logits: Tensor, targets: Tensor, vocab_dim, name=None):
        super().__init__([logits, targets], name=name or "sparse_softmax_cross_entropy")
        vname = vocab_dim if isinstance(vocab_dim, str) else convert_to_dimension(vocab_dim).name
        if vname not in logits.shape:
            raise ShapeError(f"sparse_softmax_cross_entropy_with_logits: logits {logits.name!r} {logits.shape} have "
                             f"no dimension {vname!r} (vocab_dim).")
        if not logits.dtype.is_floating_point:
            raise TypeError(f"sparse_softmax_cross_entropy_with_logits: logits {logits.name!r} must be floating "
                            f"point, got {logits.dtype}.")
        if targets.dtype.is_floating_point or targets.dtype == torch.bool:
            raise TypeError(f"sparse_softmax_cross_entropy_with_logits: targets {targets.name!r} must be integer "
                            f"class ids, got {targets.dtype} (use softmax_cross_entropy_with_logits for soft targets).")
        out_shape = logits.shape - [logits.shape.get_dim_by_name(vname)]
        if set(targets.shape.dimension_names) != set(out_shape.dimension_names) or any(
                targets.shape.get_dim_by_name(d.name).size != d.size for d in out_shape):
            raise ShapeError(f"sparse_softmax_cross_entropy_with_logits: targets {targets.name!r} {targets.shape} "
                             f"must have the logits' dims other than {vname!r}: {out_shape}.")
        self.vocab_dim = logits.shape.get_dim_by_name(vname)
        self.outputs = [Tensor(self, out_shape, _loss_dtype(logits.dtype)), Tensor(self, out_shape,
                                                                                    _loss_dtype(logits.dtype))]

    def lower(self, lw):
        logits, targets = self.inputs
        loss, log_z = self.outputs
        vpos = logits.shape.get_dim_index(self.vocab_dim.name)
        x, t = lw.get(logits), lw.get(targets)
        align = align_fn(targets.shape, loss.shape)
        vaxes = lw.tensor_mesh_axes(logits, [self.vocab_dim.name])
        kw = dict(vpos=vpos, align=align)
        n_elem = logits.shape.size
        if not vaxes:
            lw.set(*_pair(lw, self, lw.slicewise(functools.partial(_k_xent, **kw), x, t, num_outputs=2,
                                                 flops=4 * n_elem)))
            return
        begin = lw.pnum_constant(logits, functools.partial(
            slice_begin, sizes=tuple(logits.shape.to_integer_list()), layout=tuple(lw.tensor_layout(logits)),
            dim=vpos))
        m = lw.allreduce(lw.slicewise(functools.partial(_k_local_max, vpos=vpos), x), vaxes, "MAX", loss)
        s, picked = lw.slicewise(functools.partial(_k_local_sums, **kw), x, t, m, begin, num_outputs=2,
                                 flops=3 * n_elem)
        s = lw.allreduce(s, vaxes, "SUM", loss)
        picked = lw.allreduce(picked, vaxes, "SUM", loss)
        lw.set(*_pair(lw, self, lw.slicewise(functools.partial(_k_finish, vocab=self.vocab_dim.size, align=align),
                                             s, m, picked, t, num_outputs=2)))

    def gradient(self, grad_ys):
        dy, dz = grad_ys
        if dy is None and dz is None:
            return [None, None]
        logits, targets = self.inputs
        return [SparseSoftmaxCrossEntropyGradOperation(logits, targets, self.outputs[1], dy, dz,
                                                       self.vocab_dim, name=f"{self.name}_grad").outputs[0], None]


def _pair(lw, op, slots):
    loss, log_z = op.outputs
    lw.set(log_z, slots[1])
    return loss, slots[0]


class SparseSoftmaxCrossEntropyGradOperation(Operation):
    """``d logits = softmax(logits) * (dy + dz) - one_hot(targets) * dy`` (``dy``: the loss's gradient,
    ``dz``: log_z's; either may be None = zero); positions whose target is outside ``[0, vocab)`` get zero
    from ``dy``. Shape and dtype of ``logits``; no communication under any layout."""

    differentiable = False

    def __init__(self, logits, targets, log_z, dy, dz, vocab_dim, name=None):
        self.has_dy, self.has_dz = dy is not None, dz is not None
        super().__init__([logits, targets, log_z] + [g for g in (dy, dz) if g is not None], name=name)
        self.vocab_dim = vocab_dim
        self.outputs = [Tensor(self, logits.shape, logits.dtype)]

    def lower(self, lw):
        logits, targets, log_z = self.inputs[:3]
        vpos = logits.shape.get_dim_index(self.vocab_dim.name)
        begin = lw.pnum_constant(logits, functools.partial(
            slice_begin, sizes=tuple(logits.shape.to_integer_list()), layout=tuple(lw.tensor_layout(logits)),
            dim=vpos))
        f = functools.partial(_k_xent_grad, vpos=vpos, vocab=self.vocab_dim.size, has_dy=self.has_dy,
                              has_dz=self.has_dz, align=align_fn(targets.shape, log_z.shape))
        slots = [lw.get(t) for t in self.inputs]
        lw.set(self.outputs[0], lw.slicewise(f, slots[0], begin, *slots[1:], flops=4 * logits.shape.size))


def _up(x):
    return x.float() if x.dtype in _LOW else x


def _k_xent(x, t, *, vpos, align):
    """Local kernel, vocab whole: (loss, log_z) over dim ``vpos`` of ``x``; ``t`` aligned to the output."""
    t = t if align is None else align(t)
    xf = _up(x).movedim(vpos, -1)
    lse = torch.logsumexp(xf, -1)
    valid = (t >= 0) & (t < xf.shape[-1])
    picked = xf.gather(-1, t.clamp(0, xf.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, lse - picked, torch.zeros((), dtype=lse.dtype, device=lse.device))
    return loss, lse


def _k_local_max(x, *, vpos):
    return torch.amax(_up(x), dim=vpos)


def _k_local_sums(x, t, m, begin, *, vpos, align):
    """Local sum of ``exp(x - m)`` and the target's logit where it lies in this slice (else 0)."""
    t = t if align is None else align(t)
    xf = _up(x).movedim(vpos, -1)
    s = torch.exp(xf - m.unsqueeze(-1)).sum(-1)
    local = t - begin
    here = (local >= 0) & (local < xf.shape[-1])
    picked = xf.gather(-1, local.clamp(0, xf.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return s, torch.where(here, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def _k_finish(s, m, picked, t, *, vocab, align):
    t = t if align is None else align(t)
    lse = m + torch.log(s)
    valid = (t >= 0) & (t < vocab)
    loss = torch.where(valid, lse - picked, torch.zeros((), dtype=lse.dtype, device=lse.device))
    return loss, lse


def _k_xent_grad(x, begin, t, lse, *grads, vpos, vocab, has_dy, has_dz, align):
    """``softmax(x) * (dy + dz) - one_hot(t - begin) * dy`` on one slice (``x``'s dim order)."""
    t = t if align is None else align(t)
    dy = grads[0] if has_dy else None
    dz = grads[-1] if has_dz else None
    xf = _up(x).movedim(vpos, -1)
    p = (xf - _up(lse).unsqueeze(-1)).exp_()
    if dy is not None:
        dy = _up(dy) * ((t >= 0) & (t < vocab))
    scale = dy if dz is None else (_up(dz) if dy is None else dy + _up(dz))
    p.mul_(scale.unsqueeze(-1))
    if dy is not None:
        n = xf.shape[-1]
        local = t - begin
        here = (local >= 0) & (local < n)
        p.scatter_add_(-1, local.clamp(0, n - 1).unsqueeze(-1), (-dy * here).unsqueeze(-1))
    return p.movedim(-1, vpos).to(x.dtype)


def sparse_softmax_cross_entropy_with_logits(logits: Tensor, targets: Tensor, vocab_dim, z_loss: float = 0.0,
                                             name=None) -> Tensor:
    """Per-position softmax cross entropy of integer ``targets`` (PyTorch ``F.cross_entropy(reduction="none")``,
    TensorFlow ``tf.nn.sparse_softmax_cross_entropy_with_logits``), without a one-hot tensor.

    ``loss = logsumexp(logits) - logits[target]`` over ``vocab_dim``, plus ``z_loss * logsumexp(logits)**2``
    when ``z_loss`` is nonzero (Mesh TF's auxiliary z-loss). A target outside ``[0, vocab_dim.size)`` gives
    loss 0 and no gradient (PyTorch's ``ignore_index`` behaviour; Mesh TF's one-hot of such a target is
    all zeros, which gives the same cross-entropy term).

    Args:
        logits: ``[..., vocab_dim]`` float (float32, or bfloat16/float16 computed in float32).
        targets: integer class ids with exactly the logits' dims other than ``vocab_dim`` (any order).
        vocab_dim: the class Dimension or its name; may be split over mesh axes (three all-reduces of a
            ``logits.shape - vocab_dim`` tensor, Megatron-LM's vocab-parallel cross entropy).
        z_loss: coefficient of ``logsumexp(logits)**2``.
        name: optional name of the op.

    Returns:
        Tensor ``logits.shape - vocab_dim`` (logits' dim order), the logits' dtype; float32 for bfloat16 /
        float16 logits (the loss of a mixed-precision model is summed in float32). The logits' gradient has
        the logits' dtype.

    Raises:
        ShapeError: ``vocab_dim`` not in ``logits``; ``targets``' dims not the logits' dims minus ``vocab_dim``.
        TypeError: float logits / integer targets expected.
    """
    op = SparseSoftmaxCrossEntropyOperation(logits, targets, vocab_dim, name=name)
    loss, log_z = op.outputs
    if z_loss:
        loss = add(loss, multiply(log_z, log_z) * z_loss)
    return loss

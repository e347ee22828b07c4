"""Attention: scaled dot-product attention on named dims, and the multi-head attention layer.

``scaled_dot_product_attention`` runs ``torch.nn.functional.scaled_dot_product_attention`` on each
processor's slices. Every dimension other than the query length, memory length and the key /
value feature dims is batch-like and may be split (batch, heads, ...) with no communication;
the four attention dims are needed whole (``unsplittable_dims``). The multi-head layer's output
projection contracts ``heads``: with heads split (Megatron-style model parallelism) that is one
deferred all-reduce. Mesh TF's own signatures (no default scale) are in :mod:`meshtorch.layers.mtf_attention`.

**One attention for every model.** :func:`attention` is the implementation that the native LM
(:func:`multihead_attention_layer`), the Hugging Face models (:func:`grouped_query_attention`), Mesh TF's
``mtf.layers.dot_product_attention`` (:mod:`meshtorch.layers.mtf_attention`) and the ported
``mtf.transformer`` (:func:`meshtorch.transformer.attention.attention`) all call. Like PyTorch's
``F.scaled_dot_product_attention`` it has two backends behind one contract: the fused op
(:class:`AttentionOperation`, PyTorch's kernel on each slice) whenever the call allows it, and the
"math" composite (einsum, softmax, einsum on named dims) for what the fused kernel cannot express:
attention dropout, Mesh TF's ``extra_logit``, the z-loss's log-normaliser, float32 logits of
lower-precision activations, a query without a length dim (one decoding step), keys and values that
lack some of the query's batch-like dims (multi-query attention), or a bias over other dims.
The layers live here, below ``models`` and ``transformer`` in the package layers, so that the ported
Mesh TF layers are thin, Mesh-TF-named wrappers of them (their variables and initialisers stay
Mesh TF's; only the attention arithmetic is shared).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from meshtorch.core.dims import Dimension, Shape, convert_to_dimension
from meshtorch.core.errors import ShapeError
from meshtorch.core.graph import Operation, Tensor
from meshtorch.ops._kernels import align_spec, aligned
from meshtorch.ops.binary import greater
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast
from meshtorch.ops.initializers import VarianceScalingInitializer
from meshtorch.ops.random import dropout
from meshtorch.ops.reduce import reduce_logsumexp, softmax
from meshtorch.ops.reshape import reshape, transpose
from meshtorch.ops.sequence import mtf_range
from meshtorch.ops.shape import broadcast
from meshtorch.ops.variables import get_variable


def _name(d):
    return d if isinstance(d, str) else convert_to_dimension(d).name


class _AttentionSpec:
    """Dim bookkeeping shared by the forward and gradient ops."""

    def __init__(self, q, k, v, bias, length, memory, key, value, causal, scale):
        self.length, self.memory, self.key, self.value = length, memory, key, value
        self.causal, self.scale = causal, scale
        for t, seq, feat, what in ((q, length, key, "query"), (k, memory, key, "key"), (v, memory, value, "value")):
            for n in (seq, feat):
                if n not in t.shape:
                    raise ShapeError(f"attention: {what} tensor {t.name!r} {t.shape} has no dimension {n!r}.")
        self.batch = [d for d in q.shape if d.name not in (length, key)]
        bset = {d.name for d in self.batch}
        for t, seq, feat, what in ((k, memory, key, "key"), (v, memory, value, "value")):
            other = {d.name for d in t.shape if d.name not in (seq, feat)}
            if other != bset:
                raise ShapeError(f"attention: {what} tensor {t.name!r} {t.shape} must have the query's batch-like "
                                 f"dims {sorted(bset)} besides {seq!r} and {feat!r}.")
        lq, lk = q.shape.get_dim_by_name(length).size, k.shape.get_dim_by_name(memory).size
        if causal and lq != lk:
            raise ShapeError(f"attention: causal masking needs equal query and memory lengths, got {lq} and {lk}.")
        self.bias_mem = memory if memory != length else f"memory_{length}"
        q_order = Shape(self.batch + [q.shape.get_dim_by_name(length), q.shape.get_dim_by_name(key)])
        k_order = Shape(self.batch + [k.shape.get_dim_by_name(memory), k.shape.get_dim_by_name(key)])
        v_order = Shape(self.batch + [v.shape.get_dim_by_name(memory), v.shape.get_dim_by_name(value)])
        self.out_shape = Shape([v.shape.get_dim_by_name(value) if d.name == key else d for d in q.shape]) \
            if key != value else q.shape
        self.align = [align_spec(q.shape, q_order), align_spec(k.shape, k_order), align_spec(v.shape, v_order)]
        sdpa_out = Shape(self.batch + [q.shape.get_dim_by_name(length), v.shape.get_dim_by_name(value)])
        self.out_align = align_spec(sdpa_out, self.out_shape)
        # PyTorch's CPU flash kernel (no bias, equal key/value feature sizes) also returns the softmax
        # log-sum-exp, which the gradient reuses instead of recomputing the forward under autograd.
        self.flash = bias is None and q.shape.get_dim_by_name(key).size == v.shape.get_dim_by_name(value).size
        self.lse_shape = Shape(self.batch + [q.shape.get_dim_by_name(length)])
        self.dy_align = align_spec(self.out_shape, sdpa_out)
        self.back = [align_spec(q_order, q.shape), align_spec(k_order, k.shape), align_spec(v_order, v.shape)]
        self.bias_align = None
        if bias is not None:
            full = Shape(self.batch + [q.shape.get_dim_by_name(length), (self.bias_mem, lk)])
            for d in bias.shape:
                if d not in full.dims:
                    raise ShapeError(f"attention: bias {bias.name!r} {bias.shape} has dimension {d} that is not one "
                                     f"of {full} (name the memory dim {self.bias_mem!r}).")
            self.bias_align = align_spec(bias.shape, full)

    def params(self) -> dict:
        """Plain-data keywords of :func:`_k_attention`."""
        return {"align": tuple(self.align), "bias_align": self.bias_align, "out_align": self.out_align,
                "causal": bool(self.causal), "scale": self.scale}


def _k_attention(q, k, v, b=None, *, align, bias_align, out_align, causal: bool, scale):
    """Attention on slices: q, k, v (and bias b) aligned to ``[batch..., seq, feature]`` by ``align``."""
    q, k, v = (aligned(t, a) for a, t in zip(align, (q, k, v), strict=True))
    mask = None if b is None else aligned(b, bias_align)
    if causal and mask is not None:
        lq, lk = q.shape[-2], k.shape[-2]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        mask = mask.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale)
    return aligned(out, out_align)


def _to4(t):
    """``[batch..., seq, feature]`` -> ``[B, H, seq, feature]`` for the flash kernels: 4-D slices pass as
    they are, others become ``[prod(batch), 1, seq, feature]``; a slice whose feature dim is not
    unit-stride is copied (the kernel misreads such views, checked in torch 2.13)."""
    if t.dim() != 4:
        t = t.reshape(-1, 1, t.shape[-2], t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _cpu_flash(t: torch.Tensor) -> bool:
    """Whether ``t``'s device has ``aten._scaled_dot_product_flash_attention_for_cpu`` (the CPU only)."""
    return t.device.type == "cpu"


def _k_attention_flash(q, k, v, *, align, out_align, causal: bool, scale):
    """Attention on slices through ``aten._scaled_dot_product_flash_attention_for_cpu``: (out, logsumexp).

    Same numbers as :func:`_k_attention` without bias (``F.scaled_dot_product_attention`` dispatches
    to this kernel on CPU); the log-sum-exp ``[batch..., length]`` feeds :func:`_k_attention_flash_grad`.
    That kernel exists on the CPU only: on another device (CUDA) the output comes from
    ``F.scaled_dot_product_attention`` (the device's fused kernel) and the log-sum-exp slot holds zeros,
    which the gradient then does not read (it recomputes the forward under autograd).
    """
    q, k, v = (aligned(t, a) for a, t in zip(align, (q, k, v), strict=True))
    if not _cpu_flash(q):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return aligned(out, out_align), q.new_zeros(q.shape[:-1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _to4(q), _to4(k), _to4(v), 0.0, causal, scale=scale)
    return aligned(out.reshape(v.shape[:-2] + q.shape[-2:-1] + v.shape[-1:]), out_align), lse.reshape(q.shape[:-1])


def _k_attention_flash_grad(q, k, v, out, lse, dy, *, align, dy_align, back, causal: bool, scale):
    """Gradients w.r.t. q, k, v through ``aten._scaled_dot_product_flash_attention_for_cpu_backward``,
    from the forward's output and log-sum-exp (no recompute). On a device other than the CPU: the
    forward recomputed under autograd (``F.scaled_dot_product_attention``'s own backward)."""
    if not _cpu_flash(q):
        with torch.enable_grad():  # leaves in the inputs' own dim order: the gradients come back in it
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            qa, ka, va = (aligned(t, x) for x, t in zip(align, leaves, strict=True))
            o = F.scaled_dot_product_attention(qa, ka, va, is_causal=causal, scale=scale)
            return torch.autograd.grad(o, leaves, aligned(dy, dy_align))
    q, k, v = (aligned(t, a) for a, t in zip(align, (q, k, v), strict=True))
    out, dy = aligned(out, dy_align), aligned(dy, dy_align)
    q4 = _to4(q)
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _to4(dy), q4, _to4(k), _to4(v), _to4(out), lse.reshape(q4.shape[:-1]), 0.0, causal, scale=scale)
    return tuple(aligned(g.reshape(t.shape), b) for g, t, b in zip((gq, gk, gv), (q, k, v), back, strict=True))


def _k_attention_grad(*xs, n: int, **params):
    """Gradients w.r.t. the ``n`` inputs ``xs[:n]`` given ``dy = xs[n]``: the slice forward under autograd."""
    ins, dy = xs[:n], xs[n]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in ins]
        out = _k_attention(*leaves, **params)
        return torch.autograd.grad(out, leaves, dy)


class AttentionOperation(Operation):
    """Scaled dot-product attention on slices (see :func:`scaled_dot_product_attention`)."""

    def __init__(self, q, k, v, bias, spec: _AttentionSpec, name=None):
        super().__init__([q, k, v] + ([bias] if bias is not None else []), name=name or "attention")
        self.spec = spec
        self.unsplittable_dims = (spec.length, spec.memory, spec.key, spec.value, spec.bias_mem)
        self.outputs = [Tensor(self, spec.out_shape, q.dtype)]
        if spec.flash:  # second output: the softmax log-sum-exp, for the gradient
            self.outputs.append(Tensor(self, spec.lse_shape, q.dtype, index=1))

    @property
    def flops(self) -> int:
        """Global FLOPs of the two contractions (2 per multiply-add), as for an einsum: ``q k^T`` and
        ``softmax(.) v``, ``2 B Lq Lk (dk + dv)`` with ``B`` the product of the batch-like dims; the causal
        mask's skipped half is counted, as ``torch.utils.flop_counter``'s ``sdpa_flop_count`` does."""
        dk, dv = _size(self.inputs[0], self.spec.key), _size(self.inputs[2], self.spec.value)
        return 2 * _score_elements(self) * (dk + dv)

    def lower(self, lw):
        slots = [lw.get(t) for t in self.inputs]
        if self.spec.flash:
            s = self.spec
            fwd = functools.partial(_k_attention_flash, align=tuple(s.align), out_align=s.out_align,
                                    causal=bool(s.causal), scale=s.scale)
            out, lse = lw.slicewise(fwd, *slots, num_outputs=2, flops=self.flops)
            lw.set(self.outputs[0], out)
            lw.set(self.outputs[1], lse)
            return
        fwd = functools.partial(_k_attention, **self.spec.params())
        lw.set(self.outputs[0], lw.slicewise(fwd, *slots, flops=self.flops))

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        if dy is None:
            return [None] * len(self.inputs)
        g = AttentionGradOperation(self, dy)
        return list(g.outputs)


class AttentionGradOperation(Operation):
    """Gradients of attention w.r.t. q, k, v (and bias): recomputes the slice forward under autograd."""

    def __init__(self, fwd: AttentionOperation, dy: Tensor):
        extra = list(fwd.outputs) if fwd.spec.flash else []
        super().__init__(list(fwd.inputs) + extra + [dy], name=f"{fwd.name}_grad")
        self.fwd = fwd
        self.unsplittable_dims = fwd.unsplittable_dims
        self.outputs = [Tensor(self, t.shape, t.dtype, index=i) for i, t in enumerate(fwd.inputs)]

    @property
    def has_gradient(self):
        return False

    def gradient(self, grad_ys):
        raise NotImplementedError("attention: second derivatives are not implemented.")

    @property
    def flops(self) -> int:
        """Global FLOPs of the backward contractions (2 per multiply-add): the flash kernel recomputes the scores
        ``q k^T`` and computes ``dy v^T``, ``dv``, ``dq`` and ``dk``, ``2 B Lq Lk (3 dk + 2 dv)``
        (``torch.utils.flop_counter``'s ``sdpa_backward_flop_count``); the composite kernel (a bias) recomputes
        the whole forward under autograd, ``2 B Lq Lk (3 dk + 3 dv)``."""
        dk, dv = _size(self.fwd.inputs[0], self.fwd.spec.key), _size(self.fwd.inputs[2], self.fwd.spec.value)
        return 2 * _score_elements(self.fwd) * (3 * dk + (2 if self.fwd.spec.flash else 3) * dv)

    def lower(self, lw):
        n = len(self.fwd.inputs)
        s = self.fwd.spec
        if s.flash:
            back = functools.partial(_k_attention_flash_grad, align=tuple(s.align), dy_align=s.dy_align,
                                     back=tuple(s.back), causal=bool(s.causal), scale=s.scale)
        else:
            back = functools.partial(_k_attention_grad, n=n, **s.params())
        slots = lw.slicewise(back, *[lw.get(t) for t in self.inputs], num_outputs=n, flops=self.flops)
        slots = slots if n > 1 else (slots,)
        # a bias lacking some batch-like dims is summed over them locally: partial over their mesh axes
        for i, (t, s) in enumerate(zip(self.outputs, slots, strict=True)):
            pending = frozenset()
            if i == 3:
                bias = self.fwd.inputs[3]
                missing = [d.name for d in self.fwd.inputs[0].shape if d.name not in bias.shape]
                pending = frozenset(lw.tensor_mesh_axes(self.fwd.inputs[0], missing))
            lw.set(t, s, pending)


def _size(t: Tensor, dim: str) -> int:
    return t.shape.get_dim_by_name(dim).size


def _score_elements(op: AttentionOperation) -> int:
    """Elements of the attention scores ``[batch-like..., length, memory]`` of ``op`` (global)."""
    q, k = op.inputs[0], op.inputs[1]
    return q.shape.size // _size(q, op.spec.key) * _size(k, op.spec.memory)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, length_dim, key_dim, value_dim=None,
                          memory_length_dim=None, causal: bool = False, bias: Tensor | None = None,
                          scale: float | None = None, name=None) -> Tensor:
    """``softmax(q k^T * scale + bias) v`` with named dims, via ``F.scaled_dot_product_attention``.

    meshtorch's fused attention op (default scale ``1/sqrt(d_kv)``, as PyTorch). Mesh TF's
    ``mtf.layers.dot_product_attention(q, k, v, mask, is_training, ...)`` (no scale) is in
    :mod:`meshtorch.layers.mtf_attention`.

    Args:
        q: ``[batch-like..., length, key_dim]``.
        k: ``[batch-like..., memory_length, key_dim]``; v: ``[batch-like..., memory_length, value_dim]``.
            For self-attention the memory dim may have the same name as ``length_dim``.
        length_dim / memory_length_dim: the query and memory sequence dims (memory defaults to length).
        key_dim / value_dim: feature dims (value defaults to key).
        causal: mask memory positions after the query position (needs equal lengths).
        bias: additive float bias with dims among q's batch-like dims, ``length_dim`` and the memory
            dim (named ``memory_<length>`` when the memory dim shares the length's name); use large
            negative values for padding masks. Differentiable (e.g. T5 relative-position bias).
        scale: logit scale, default ``1/sqrt(key_dim.size)`` (T5 uses 1.0).

    Returns:
        Tensor of q's shape with ``key_dim`` replaced by ``value_dim``.

    Raises:
        ShapeError: if k/v lack q's batch-like dims, or a dim is missing.
    """
    length, key = _name(length_dim), _name(key_dim)
    value = _name(value_dim) if value_dim is not None else key
    memory = _name(memory_length_dim) if memory_length_dim is not None else length
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape.get_dim_by_name(key).size) if key in q.shape else 1.0
    spec = _AttentionSpec(q, k, v, bias, length, memory, key, value, causal, scale)
    return AttentionOperation(q, k, v, bias, spec, name).outputs[0]


def attention(q: Tensor, k: Tensor, v: Tensor, memory_length_dim, key_dim, value_dim=None, length_dim=None,
              bias: Tensor | None = None, scale: float | None = None, causal: bool = False, dropout_rate: float = 0.0,
              dropout_broadcast_dims=None, extra_logit=None, float32_logits: bool = False, return_log_z: bool = False,
              output_shape=None, name=None):
    """``dropout(softmax(q k^T * scale + bias)) v`` on named dims: the one attention every model calls.

    The fused op (:func:`scaled_dot_product_attention`, PyTorch's kernel per slice) when the call allows it;
    else the composite ``einsum -> softmax -> einsum`` (Mesh TF's ``dot_product_attention`` / ``attention``
    arithmetic, PyTorch SDPA's "math" backend). Both give the same numbers to float rounding. The composite
    serves: ``dropout_rate > 0``, ``extra_logit``, ``return_log_z``, ``float32_logits`` with non-float32
    inputs, a query without ``length_dim`` (one decoding step), keys/values lacking some of the query's
    batch-like dims (multi-query attention) and a bias over dims other than the batch-like and the two
    length dims.

    Args:
        q: ``[batch-like..., (length,) key]``; k: ``[batch-like..., memory_length, key]``;
            v: ``[batch-like..., memory_length, value]``. k and v may lack some of q's batch-like dims;
            dims of k that q lacks other than ``memory_length`` and ``key`` are summed in the logits, and
            those of v in the output (Mesh TF's ``dot_product_attention``, e.g. its 2-d local attention).
        memory_length_dim / key_dim / value_dim: Dimensions or names (value defaults to key).
        length_dim: q's sequence dim; default: the one dim of q that k lacks (besides none: no length).
        bias: additive float bias broadcastable to the logits ``q.shape - key + memory_length`` (masks:
            large negative values); cast to the logits' dtype.
        scale: logit scale; default ``1/sqrt(key.size)`` (PyTorch); Mesh TF passes 1.0 (no scale).
        causal: mask memory positions after the query position.
        dropout_rate / dropout_broadcast_dims: dropout of the attention weights (Mesh TF: rate applied
            as ``keep_prob = 1 - rate``; the mask shared over the broadcast dims). Pass 0 outside training.
        extra_logit: an extra logit in the softmax's normaliser (Mesh TF :func:`meshtorch.softmax`).
        float32_logits: compute the logits and softmax in float32 (Mesh TF's ``float32_logits``).
        return_log_z: also return ``logsumexp(logits)`` over ``memory_length`` (Mesh TF's z-loss).
        output_shape: the output's dim order (default: q's with ``key`` replaced by ``value``).

    Returns:
        The output Tensor, or ``(output, log_z)`` with ``return_log_z``; the dtype of ``v``.

    Raises:
        ShapeError: if a named dim is missing, or the memory dim also names a dim of q.
    """
    memory, key = _name(memory_length_dim), _name(key_dim)
    value = _name(value_dim) if value_dim is not None else key
    for t, n, what in ((q, key, "query"), (k, memory, "key"), (k, key, "key"), (v, memory, "value"),
                       (v, value, "value")):
        if n not in t.shape:
            raise ShapeError(f"attention: {what} tensor {t.name!r} {t.shape} has no dimension {n!r}.")
    if length_dim is not None:
        length = _name(length_dim)
    else:
        only_q = [d.name for d in q.shape if d.name != key and d.name not in k.shape]
        length = only_q[0] if len(only_q) == 1 else None
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape.get_dim_by_name(key).size)
    vd = v.shape.get_dim_by_name(value)
    out_shape = Shape(output_shape) if output_shape is not None else \
        Shape([vd if d.name == key else d for d in q.shape])
    composite = bool(dropout_rate) or extra_logit is not None or return_log_z
    if not composite and _fusable(q, k, v, bias, length, memory, key, value, float32_logits):
        if bias is not None and bias.dtype != q.dtype:
            bias = cast(bias, q.dtype)
        o = scaled_dot_product_attention(q, k, v, length, key, value, memory, causal=causal, bias=bias, scale=scale,
                                         name=name)
        return o if o.shape == out_shape else transpose(o, out_shape)
    if memory in q.shape:
        raise ShapeError(f"attention: the memory dim {memory!r} is also a dim of the query {q.name!r} {q.shape}; "
                         "rename it (e.g. memory_length).")
    if float32_logits:
        q, k = cast(q, torch.float32), cast(k, torch.float32)
    logits = einsum([q, k], output_shape=(q.shape - [key]) + [k.shape.get_dim_by_name(memory)])
    if scale != 1.0:
        logits = logits * scale
    if causal:
        mem_pos = mtf_range(q.mesh, k.shape.get_dim_by_name(memory), dtype=torch.int32)
        later = greater(mem_pos, mtf_range(q.mesh, q.shape.get_dim_by_name(length), dtype=torch.int32))
        logits = logits + cast(later, logits.dtype) * -1e9
    if bias is not None:
        logits = logits + cast(bias, logits.dtype)
    log_z = reduce_logsumexp(logits, memory) if return_log_z else None
    weights = cast(softmax(logits, memory, extra_logit=extra_logit), v.dtype)
    if dropout_rate:
        weights = dropout(weights, True, keep_prob=1.0 - dropout_rate,
                          noise_shape=weights.shape - [_name(d) for d in (dropout_broadcast_dims or [])])
    o = einsum([weights, v], output_shape=out_shape, name=name)
    return (o, log_z) if return_log_z else o


def _fusable(q, k, v, bias, length, memory, key, value, float32_logits) -> bool:
    """Whether :func:`attention` can run as the fused op: same dtypes (float32 when float32 logits are asked),
    a query length dim, equal batch-like dims of q, k, v, and a bias over those dims and the two lengths."""
    if length is None or length not in q.shape or not (q.dtype == k.dtype == v.dtype):
        return False
    if float32_logits and q.dtype != torch.float32:
        return False
    batch = {d.name for d in q.shape} - {length, key}
    if {d.name for d in k.shape} - {memory, key} != batch or {d.name for d in v.shape} - {memory, value} != batch:
        return False
    bias_memory = memory if memory != length else f"memory_{length}"  # the fused op's name for it
    return bias is None or {d.name for d in bias.shape} <= batch | {length, bias_memory}


def multihead_attention_layer(x: Tensor, heads_dim, kv_dim, length_dim, memory: Tensor | None = None,
                        memory_length_dim=None, causal: bool = False, bias: Tensor | None = None,
                        scale: float | None = None, name: str | None = None, attend=None) -> Tensor:
    """Multi-head attention layer (Vaswani et al. 2017) on :func:`scaled_dot_product_attention`.

    meshtorch's layer (default scale ``1/sqrt(d_kv)``); Mesh TF's ``mtf.layers.multihead_attention``
    signature (no scale) is in :mod:`meshtorch.layers.mtf_attention`.

    Variables ``{name}/q``, ``/k``, ``/v`` of shape ``[d_model, heads, d_kv]`` and ``{name}/o`` of
    shape ``[heads, d_kv, d_model]``, where ``d_model`` is x's last dim.

    Args:
        x: ``[batch..., length, d_model]``.
        heads_dim, kv_dim: Dimensions ``heads`` and ``d_kv`` (``heads`` may be split).
        memory: encoder output ``[batch..., memory_length, d_model]`` for encoder-decoder attention;
            None for self-attention.
        attend: causal self-attention of the projected q, k, v instead of :func:`attention`: a
            :class:`meshtorch.layers.kv_cache.FullSequence` / ``Prefill`` / ``Step`` (decoding with a KV cache;
            ``x`` may then lack ``length_dim``: one position per sequence).

    Returns:
        Tensor of x's shape.
    """
    heads, d_kv = convert_to_dimension(heads_dim), convert_to_dimension(kv_dim)
    d_model = x.shape[-1]
    name = x.graph.unique_name(name or "attention")
    mem = x if memory is None else memory
    init = VarianceScalingInitializer(1.0, "fan_in", "normal", reduced_dims=[d_model], new_dims=[heads, d_kv])
    wq, wk, wv = (get_variable(x.mesh, f"{name}/{p}", [d_model, heads, d_kv], initializer=init, dtype=x.dtype)
                  for p in "qkv")
    wo = get_variable(x.mesh, f"{name}/o", [heads, d_kv, d_model], dtype=x.dtype,
                      initializer=VarianceScalingInitializer(1.0, "fan_in", "normal", [heads, d_kv], [d_model]))
    qkv_shape = (x.shape - [d_model.name]) + [heads, d_kv]
    q = einsum([x, wq], output_shape=qkv_shape, name=f"{name}/q_proj")
    mshape = (mem.shape - [d_model.name]) + [heads, d_kv]
    k = einsum([mem, wk], output_shape=mshape, name=f"{name}/k_proj")
    v = einsum([mem, wv], output_shape=mshape, name=f"{name}/v_proj")
    if attend is not None:
        o = attend.attend(q, k, v, scale if scale is not None else 1.0 / math.sqrt(d_kv.size), name=f"{name}/sdpa")
    else:
        o = attention(q, k, v, memory_length_dim if memory_length_dim is not None else length_dim, d_kv,
                      length_dim=length_dim, causal=causal, bias=bias, scale=scale, name=f"{name}/sdpa")
    return einsum([o, wo], output_shape=x.shape, name=f"{name}/o_proj")


def grouped_query_attention(q: Tensor, k: Tensor, v: Tensor, length_dim, key_dim, heads_dim, kv_heads_dim,
                            value_dim=None, causal: bool = False, scale: float | None = None, name=None) -> Tensor:
    """Grouped-query attention (Ainslie et al. 2023, "GQA"): ``heads`` query heads share ``kv_heads`` key/value
    heads, query head ``h`` reading key/value head ``h // (heads / kv_heads)`` (``transformers``' ``repeat_kv``).

    The query's ``heads`` dim is reshaped to ``(kv_heads, kv_group)`` (row-major, so a split of ``heads`` and of
    ``kv_heads`` over the same mesh axis is the same split: no communication), keys and values are broadcast
    over ``kv_group`` and :func:`scaled_dot_product_attention` runs per ``kv_heads`` x ``kv_group``; the output
    is reshaped back. Split ``kv_heads`` (with ``heads``) for Megatron-style model parallelism.

    Args:
        q: ``[batch..., length, heads, key]``; k: ``[batch..., length, kv_heads, key]``;
            v: ``[batch..., length, kv_heads, value]`` (self-attention: one ``length`` dim).
        heads_dim / kv_heads_dim: the query-head and key/value-head dims (names or Dimensions).
        value_dim: v's feature dim (default: ``key_dim``). causal / scale: as :func:`scaled_dot_product_attention`.

    Returns:
        q's shape with ``key_dim`` replaced by ``value_dim``.

    Raises:
        ShapeError: if ``heads`` is not a multiple of ``kv_heads``, or a dim is missing.
    """
    heads, kv, key = _name(heads_dim), _name(kv_heads_dim), _name(key_dim)
    value = _name(value_dim) if value_dim is not None else key
    for t, dims, what in ((q, (heads, key), "query"), (k, (kv, key), "key"), (v, (kv, value), "value")):
        for n in dims:
            if n not in t.shape:
                raise ShapeError(f"grouped_query_attention: {what} tensor {t.name!r} {t.shape} has no dimension "
                                 f"{n!r}.")
    h, g = q.shape.get_dim_by_name(heads), k.shape.get_dim_by_name(kv)
    if h.size % g.size:
        raise ShapeError(f"grouped_query_attention: {heads!r} ({h.size}) is not a multiple of {kv!r} ({g.size}).")
    name = name or "gqa"
    i = q.shape.dims.index(h)
    grouped = Shape(q.shape.dims[:i] + [g, Dimension("kv_group", h.size // g.size)] + q.shape.dims[i + 1:])
    vd = v.shape.get_dim_by_name(value)
    v_shape = Shape([vd if d.name == key else d for d in grouped])
    o = attention(reshape(q, grouped, name=f"{name}/q_group"), broadcast(k, grouped, name=f"{name}/k_repeat"),
                  broadcast(v, v_shape, name=f"{name}/v_repeat"), length_dim, key, value_dim=value,
                  length_dim=length_dim, causal=causal, scale=scale, name=f"{name}/sdpa")
    return reshape(o, Shape([vd if d.name == key else d for d in q.shape]), name=f"{name}/heads")

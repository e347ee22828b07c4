"""The same decoder-only LM in plain PyTorch (``torch.nn``), for benchmarks and interchange.

Parameters have exactly the shapes (in the same dim order) and the names of the meshtorch
variables of :func:`meshtorch.models.transformer.build_lm`, with ``/`` replaced by ``.`` — so
``{name.replace("/", "."): lowering.variable_value(name)}`` is a valid ``state_dict``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtorch.layers.moe import expert_capacity
from meshtorch.models.transformer import LMConfig


def moe_forward(x, router, wi, wo, capacity: int, top_k: int = 2, act=F.relu):
    """Plain-PyTorch top-k MoE with capacity (the routing rules of :func:`meshtorch.layers.moe_ffn`).

    Args:
        x: ``[group, tokens, d_model]``; router ``[d_model, E]``; wi ``[E, d_model, d_ff]``; wo ``[E, d_ff, d_model]``.
        capacity: slots per expert per group; positions go in token order to first choices, then to
            second choices, ...; a choice that finds its expert full is dropped.

    Returns:
        ``(y [group, tokens, d_model], aux_loss scalar)``.
    """
    gates = torch.softmax(x.float() @ router.float(), dim=-1)  # [G, S, E]
    E = gates.shape[-1]
    vals, idx = torch.topk(gates, top_k, dim=-1)  # [G, S, k]
    weights = vals / (vals.sum(-1, keepdim=True) + 1e-9) if top_k > 1 else vals
    first = F.one_hot(idx[..., 0], E).to(gates.dtype)
    aux = (gates.mean(1) * first.mean(1)).mean() * E * E
    filled = torch.zeros(gates.shape[0], 1, E, dtype=gates.dtype)
    combine = torch.zeros(*gates.shape, capacity, dtype=gates.dtype)
    for j in range(top_k):
        mask = F.one_hot(idx[..., j], E).to(gates.dtype)  # [G, S, E]
        pos = (torch.cumsum(mask, 1) - mask + filled) * mask
        keep = mask * (pos < capacity).to(gates.dtype)
        filled = filled + keep.sum(1, keepdim=True)
        slot = F.one_hot(pos.sum(-1).long().clamp(max=capacity), capacity + 1)[..., :capacity].to(gates.dtype)
        combine = combine + keep[..., None] * slot[..., None, :] * weights[..., j, None, None]
    dispatch = (combine > 0).to(x.dtype).detach()
    expert_in = torch.einsum("gsec,gsm->egcm", dispatch, x)
    h = act(torch.einsum("egcm,emh->egch", expert_in, wi))
    out = torch.einsum("egch,ehm->egcm", h, wo)
    return torch.einsum("egcm,gsec->gsm", out, combine.to(x.dtype)), aux.to(x.dtype)


def _p(*shape):
    return nn.Parameter(torch.empty(*shape))


class _Scale(nn.Module):
    def __init__(self, d, bias):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None


class TorchLM(nn.Module):
    """Plain-PyTorch twin of the meshtorch LM (no dropout at eval; dropout masks differ in training)."""

    def __init__(self, c: LMConfig):
        super().__init__()
        self.c = c
        V = c.padded_vocab
        self.embedding = _p(V, c.d_model)
        self.pos_embedding = _p(c.length, c.d_model)
        layer_bias = c.norm == "layer"
        layers = {}
        for i in range(c.num_layers):
            att = nn.Module()
            for n in "qkv":
                setattr(att, n, _p(c.d_model, c.num_heads, c.d_kv))
            att.o = _p(c.num_heads, c.d_kv, c.d_model)
            layer = nn.Module()
            if c.is_moe_layer(i):
                moe = nn.Module()
                for n, shape in (("router", (c.d_model, c.num_experts)), ("wi", (c.num_experts, c.d_model, c.d_ff)),
                                 ("wo", (c.num_experts, c.d_ff, c.d_model))):
                    setattr(moe, n, nn.Module())
                    getattr(moe, n).kernel = _p(*shape)
                layer.moe = moe
            ffn = nn.Module()
            ffn.wi = nn.Module()
            ffn.wi.kernel = _p(c.d_model, c.d_ff)
            if c.gated:
                ffn.wi_gate = nn.Module()
                ffn.wi_gate.kernel = _p(c.d_model, c.d_ff)
            ffn.wo = nn.Module()
            ffn.wo.kernel = _p(c.d_ff, c.d_model)
            layer.attention = att
            layer.attention_norm = _Scale(c.d_model, layer_bias)
            if not c.is_moe_layer(i):
                layer.ffn = ffn
            layer.ffn_norm = _Scale(c.d_model, layer_bias)
            layers[f"layer_{i}"] = layer
        for k, v in layers.items():
            self.add_module(k, v)
        self.final_norm = _Scale(c.d_model, layer_bias)
        self.logits = nn.Module()
        self.logits.kernel = _p(c.d_model, V)
        pad = torch.zeros(V)
        pad[c.vocab_size:] = -1e9
        self.register_buffer("vocab_pad_mask", pad, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        for name, p in self.named_parameters():
            if name.endswith("scale"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif name == "pos_embedding":
                nn.init.normal_(p, std=0.02)
            elif name == "embedding":
                nn.init.normal_(p)
            elif ".moe.w" in name:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[1]))
            else:
                fan_in = p.shape[0] if not name.endswith(".o") else p.shape[0] * p.shape[1]
                nn.init.normal_(p, std=1 / math.sqrt(fan_in))

    def _norm(self, x, m: _Scale):
        if self.c.norm == "rms":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.scale
        return F.layer_norm(x, [x.shape[-1]], m.scale, m.bias, eps=1e-6)

    def _act(self, x):
        a = self.c.activation
        if a == "relu":
            return F.relu(x)
        if a == "gelu":
            return F.gelu(x)
        if a == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        if a == "silu":
            return F.silu(x)
        return x

    def block(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` on ``x`` ``[batch, length, d_model]``: ``(x after the block, its MoE aux loss or 0)``."""
        c = self.c
        layer = getattr(self, f"layer_{i}")
        h = self._norm(x, layer.attention_norm)
        a = layer.attention
        q, k, v = (torch.einsum("bld,dhk->bhlk", h, w) for w in (a.q, a.k, a.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(c.d_kv))
        x = x + torch.einsum("bhlk,hkd->bld", o, a.o)
        h = self._norm(x, layer.ffn_norm)
        if c.is_moe_layer(i):
            m = layer.moe
            cap = expert_capacity(c.length, c.num_experts, c.expert_capacity_factor, c.moe_min_capacity)
            y, aux = moe_forward(h, m.router.kernel, m.wi.kernel, m.wo.kernel, cap, c.moe_top_k, self._act)
            return x + y, aux
        f = layer.ffn
        u = h @ f.wi.kernel
        u = self._act(h @ f.wi_gate.kernel) * u if c.gated else self._act(u)
        return x + u @ f.wo.kernel, torch.zeros(())

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and logits ``[batch, length, vocab]`` of the last block's output ``x``."""
        return self._norm(x, self.final_norm) @ self.logits.kernel + self.vocab_pad_mask

    def forward(self, ids: torch.Tensor, return_aux: bool = False):
        """Logits ``[batch, length, vocab]`` for int64 ``ids`` ``[batch, length]`` (and the summed MoE aux loss)."""
        aux = torch.zeros(())
        x = self.embedding[ids] + self.pos_embedding[: ids.shape[1]]
        for i in range(self.c.num_layers):
            x, a = self.block(i, x)
            aux = aux + a
        logits = self.head(x)
        return (logits, aux) if return_aux else logits

    def loss(self, ids, targets):
        logits, aux = self.forward(ids, return_aux=True)
        c = self.c
        logp = torch.log_softmax(logits.float(), -1)
        nll = -logp.gather(-1, targets[..., None])[..., 0]
        if c.label_smoothing:
            smooth = -logp[..., : c.vocab_size].sum(-1) / c.vocab_size
            nll = (1 - c.label_smoothing) * nll + c.label_smoothing * smooth
        if c.z_loss:
            nll = nll + c.z_loss * torch.logsumexp(logits, -1) ** 2
        return nll.mean() + c.moe_aux_loss_coef * aux


def state_dict_from_lowering(lowering, model: TorchLM) -> dict:
    """``{torch name: full tensor}`` from a meshtorch lowering of the same config."""
    names = dict(model.named_parameters())
    return {n.replace("/", "."): lowering.variable_value(n) for n in lowering.variable_names
            if n.replace("/", ".") in names}

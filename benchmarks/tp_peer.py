"""The PyTorch peer of meshtorch's FSDP + tensor parallel run: meshtorch's LM as ``nn.Linear`` modules, TP + FSDP2.

:class:`TPLM` is :class:`scale_124m.BlockLM`'s architecture (RMS pre-norm, ReLU feed-forward, learned positions,
untied logits, causal scaled-dot-product attention, no biases) written with modules PyTorch's tensor parallel
API can plan: ``q``/``k``/``v``/``o``, ``wi``/``wo`` and ``logits`` are bias-free ``nn.Linear`` (weights
``[out, in]``: ``x @ W.T`` is BlockLM's ``einsum`` / ``@`` with the weight transposed), the embedding an
``nn.Embedding``. The attention reshapes ``[batch, length, heads * d_kv]`` with ``-1`` heads, so under TP
each rank sees its local ``heads / tp`` heads.

:func:`parallelize` is TorchTitan's recipe (``torchtitan/models/llama/parallelize_llama.py``: ``apply_tp`` then
``apply_fsdp``) without sequence parallelism: Megatron-style TP over ``tp`` (``ColwiseParallel`` for q/k/v/wi,
``RowwiseParallel`` for o/wo; the embedding ``RowwiseParallel`` over the vocab with a replicated output; the
logits ``ColwiseParallel`` over the vocab with ``Shard(-1)`` output, the loss under
``torch.distributed.tensor.parallel.loss_parallel``), then ``fully_shard(block, mesh=mesh["dp"])`` per block
and on the root (FSDP2 over ``dp``, on top of the TP shards). This matches meshtorch's layout
``batch:data;heads:model;d_ff:model;vocab:model`` with storage ``d_model:data``.

:func:`check_worker` (``python benchmarks/scale_124m.py --check``) compares the peer under TP + FSDP on 4 gloo
ranks with the same module unsharded in one process from the same initial weights.
"""

from __future__ import annotations

import copy
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module


def rms_norm(x, scale):
    """meshtorch's RMS norm (``Block.norm``): ``x * rsqrt(mean(x^2) + 1e-6) * scale`` over ``d_model``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


class TPBlock(nn.Module):
    """One pre-norm block (``scale_124m.Block``'s math) with ``nn.Linear`` projections TP can plan."""

    def __init__(self, c):
        super().__init__()
        self.d_kv = c.d_kv
        hk = c.num_heads * c.d_kv
        self.q, self.k, self.v = (nn.Linear(c.d_model, hk, bias=False) for _ in range(3))
        self.o = nn.Linear(hk, c.d_model, bias=False)
        self.wi = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.wo = nn.Linear(c.d_ff, c.d_model, bias=False)
        self.attention_norm = nn.Parameter(torch.ones(c.d_model))
        self.ffn_norm = nn.Parameter(torch.ones(c.d_model))
        for m, fan_in in ((self.q, c.d_model), (self.k, c.d_model), (self.v, c.d_model), (self.wi, c.d_model),
                          (self.o, hk), (self.wo, c.d_ff)):
            nn.init.normal_(m.weight, std=1 / math.sqrt(fan_in))

    def forward(self, x):
        b, n, _ = x.shape
        h = rms_norm(x, self.attention_norm)
        q, k, v = (m(h).view(b, n, -1, self.d_kv).transpose(1, 2) for m in (self.q, self.k, self.v))  # local heads
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(self.d_kv))
        x = x + self.o(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.wo(F.relu(self.wi(rms_norm(x, self.ffn_norm))))


class TPLM(nn.Module):
    """``scale_124m.BlockLM`` as modules: ``forward(ids, targets) -> mean cross entropy`` (int64 [batch, length])."""

    def __init__(self, c):
        super().__init__()
        self.embedding = nn.Embedding(c.padded_vocab, c.d_model)
        self.pos_embedding = nn.Parameter(torch.empty(c.length, c.d_model))
        self.blocks = nn.ModuleList(TPBlock(c) for _ in range(c.num_layers))
        self.final_norm = nn.Parameter(torch.ones(c.d_model))
        self.logits = nn.Linear(c.d_model, c.padded_vocab, bias=False)
        nn.init.normal_(self.embedding.weight)
        nn.init.normal_(self.pos_embedding, std=0.02)
        nn.init.normal_(self.logits.weight, std=1 / math.sqrt(c.d_model))

    def forward(self, ids, targets):
        x = self.embedding(ids) + self.pos_embedding[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.logits(rms_norm(x, self.final_norm))
        if isinstance(logits, DTensor):  # vocab-sharded logits: the loss is computed on the shards
            with loss_parallel():
                return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def backward(model: TPLM, loss):
    """``loss.backward()``, under ``loss_parallel`` when the model's logits are vocab-sharded (as PyTorch requires)."""
    if isinstance(model.logits.weight, DTensor):
        with loss_parallel():
            loss.backward()
    else:
        loss.backward()


def parallelize(model: TPLM, dp: int = 2, tp: int = 2):
    """TP over ``tp`` then FSDP2 over ``dp`` (TorchTitan's order); returns the ``(dp, tp)`` DeviceMesh.

    Raises:
        ValueError: the world size is not ``dp * tp`` or the heads / d_ff / vocab do not split over ``tp``.
    """
    if dist.get_world_size() != dp * tp:
        raise ValueError(f"parallelize: {dist.get_world_size()} ranks, need dp x tp = {dp * tp}.")
    b0 = model.blocks[0]
    for name, size in (("heads", b0.q.out_features // b0.d_kv), ("d_ff", b0.wi.out_features),
                       ("vocab", model.logits.out_features)):
        if size % tp:
            raise ValueError(f"parallelize: {name} {size} does not split over tp={tp}.")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "logits": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "wi": ColwiseParallel(), "wo": RowwiseParallel()}
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], plan)
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_worker(cfg, steps: int = 2) -> float:
    """Peer check (4 gloo ranks): TP + FSDP losses, gradients and updated weights equal the unsharded module's.

    ``cfg`` is an LMConfig with a small shape and ``batch_size`` divisible by 2. Both models start from the same
    weights (seed 0) and take ``steps`` AdamW steps (fused); the unsharded one sees the whole batch, each ``dp``
    group its half. Returns the largest absolute gradient difference seen.

    Raises:
        AssertionError: from ``torch.testing.assert_close`` naming the step and parameter that differ.
    """
    torch.manual_seed(0)
    ref = TPLM(cfg)
    model = copy.deepcopy(ref)
    mesh = parallelize(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    half = cfg.batch_size // 2
    rows = slice(mesh["dp"].get_local_rank() * half, (mesh["dp"].get_local_rank() + 1) * half)
    worst = 0.0
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:]
        ref_opt.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        opt.zero_grad()
        loss = model(x[rows], y[rows])
        backward(model, loss)
        loss = _full(loss).detach().clone()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        torch.testing.assert_close(loss / 2, ref_loss.detach(), msg=lambda m, s=s: f"step {s} loss: {m}")
        for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            got = _full(p.grad)
            worst = max(worst, (got - rp.grad).abs().max().item())
            torch.testing.assert_close(got, rp.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, s=s, n=name: f"step {s} grad {n}: {m}")
        opt.step()
        ref_opt.step()
        for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            torch.testing.assert_close(_full(p.detach()), rp.detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, s=s, n=name: f"step {s} weight {n}: {m}")
    return worst


if __name__ == "__main__":
    sys.exit("run through benchmarks/scale_124m.py --check")

"""The PyTorch peers of ``vs_dtensor.py``: DTensor tensor parallel and DDP, started from meshtorch's weights.

Each builder returns ``(module, step)``; ``step(x, y)`` runs one AdamW training step on the full batch
``x, y`` (int64 ``[batch, length]``) and returns a thunk giving the global mean loss as a float (the thunk
may communicate, so every rank must call it). Memory helpers read Linux's ``/proc/self``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from meshtorch.testing.torch_lm import TorchLM


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(module_and_opt) -> int:
    """Bytes of this rank's parameters and optimizer state (local shards of DTensors)."""
    model, opt = module_and_opt
    n = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    for s in opt.state.values():
        n += sum(_local(t).numel() * t.element_size() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return n


def _rms(x, scale):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


class LinearLM(nn.Module):
    """The meshtorch LM with ``nn.Linear`` / ``nn.Embedding`` (what ``parallelize_module`` shards).

    Same computation as :class:`meshtorch.testing.torch_lm.TorchLM` (relu FFN, RMS norm, no MoE, no gating);
    ``tp`` is the number of ranks the heads are split over (the attention works on its local heads).
    """

    def __init__(self, c, tp: int = 1):
        super().__init__()
        self.c, self.local_heads = c, c.num_heads // tp
        hk = c.num_heads * c.d_kv
        self.embedding = nn.Embedding(c.padded_vocab, c.d_model)
        self.pos_embedding = nn.Parameter(torch.empty(c.length, c.d_model))
        for i in range(c.num_layers):
            layer = nn.Module()
            att = nn.Module()
            for n in "qkv":
                setattr(att, n, nn.Linear(c.d_model, hk, bias=False))
            att.o = nn.Linear(hk, c.d_model, bias=False)
            layer.attention, layer.ffn = att, nn.Module()
            layer.ffn.wi = nn.Linear(c.d_model, c.d_ff, bias=False)
            layer.ffn.wo = nn.Linear(c.d_ff, c.d_model, bias=False)
            layer.attention_norm = nn.Parameter(torch.ones(c.d_model))
            layer.ffn_norm = nn.Parameter(torch.ones(c.d_model))
            self.add_module(f"layer_{i}", layer)
        self.final_norm = nn.Parameter(torch.ones(c.d_model))
        self.logits = nn.Linear(c.d_model, c.padded_vocab, bias=False)

    @torch.no_grad()
    def load_meshtorch(self, w: dict):
        """Copy meshtorch's full variables ``{name: tensor}`` (``[d_model, heads, d_kv]`` etc.) in."""
        c, hk = self.c, self.c.num_heads * self.c.d_kv
        self.embedding.weight.copy_(w["embedding"])
        self.pos_embedding.copy_(w["pos_embedding"])
        for i in range(c.num_layers):
            layer, p = getattr(self, f"layer_{i}"), f"layer_{i}/"
            for n in "qkv":
                getattr(layer.attention, n).weight.copy_(w[p + f"attention/{n}"].reshape(c.d_model, hk).T)
            layer.attention.o.weight.copy_(w[p + "attention/o"].reshape(hk, c.d_model).T)
            layer.ffn.wi.weight.copy_(w[p + "ffn/wi/kernel"].T)
            layer.ffn.wo.weight.copy_(w[p + "ffn/wo/kernel"].T)
            layer.attention_norm.copy_(w[p + "attention_norm/scale"])
            layer.ffn_norm.copy_(w[p + "ffn_norm/scale"])
        self.final_norm.copy_(w["final_norm/scale"])
        self.logits.weight.copy_(w["logits/kernel"].T)

    def forward(self, ids):
        c = self.c
        b, n = ids.shape
        x = self.embedding(ids) + self.pos_embedding[:n]
        for i in range(c.num_layers):
            layer = getattr(self, f"layer_{i}")
            h = _rms(x, layer.attention_norm)
            a = layer.attention
            q, k, v = (m(h).view(b, n, self.local_heads, c.d_kv).transpose(1, 2) for m in (a.q, a.k, a.v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(c.d_kv))
            x = x + a.o(o.transpose(1, 2).reshape(b, n, self.local_heads * c.d_kv))
            h = _rms(x, layer.ffn_norm)
            x = x + layer.ffn.wo(F.relu(layer.ffn.wi(h)))
        return self.logits(_rms(x, self.final_norm))


def dtensor_tp(cfg, weights: dict, world: int, compiled: bool = False):
    """LinearLM with Megatron tensor parallelism over a 1-D gloo DeviceMesh of ``world`` ranks.

    q, k, v, ffn.wi: ColwiseParallel (heads / d_ff split); o, ffn.wo: RowwiseParallel (partial sums
    all-reduced); embedding: RowwiseParallel (vocab rows split, output all-reduced); logits: ColwiseParallel
    with vocab-sharded DTensor output and ``loss_parallel`` cross entropy. Norm scales and the position
    embedding are plain replicated tensors (their gradients come out identical on every rank).
    ``compiled``: the parallelized module through ``torch.compile`` (forward and backward; the loss and
    AdamW stay eager).
    """
    if cfg.padded_vocab != cfg.vocab_size:
        raise ValueError("vs_dtensor: use a vocab the mesh divides (no padding mask in LinearLM)")
    mesh = init_device_mesh("cpu", (world,))
    model = LinearLM(cfg, tp=world)
    model.load_meshtorch(weights)
    plan = {"embedding": RowwiseParallel(input_layouts=Replicate()),
            "logits": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(cfg.num_layers):
        p = f"layer_{i}."
        plan.update({p + "attention.q": ColwiseParallel(), p + "attention.k": ColwiseParallel(),
                     p + "attention.v": ColwiseParallel(), p + "attention.o": RowwiseParallel(),
                     p + "ffn.wi": ColwiseParallel(), p + "ffn.wo": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    forward = torch.compile(model) if compiled else model

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        logits = forward(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        return lambda: float(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    return (model, opt), step


class _LossOf(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, x, y):
        return self.lm.loss(x, y)


def ddp(cfg, weights: dict, rank: int, world: int, compiled: bool = False):
    """DistributedDataParallel (default 25 MiB buckets, no buffer broadcast) around TorchLM; rank r trains
    on rows ``[r * batch / world, (r + 1) * batch / world)`` of each batch. ``compiled``: the DDP module
    through ``torch.compile`` (DDPOptimizer splits the graph at bucket boundaries; AdamW stays eager)."""
    model = TorchLM(cfg)
    model.load_state_dict({n.replace("/", "."): v for n, v in weights.items()})
    wrapped = DistributedDataParallel(_LossOf(model), broadcast_buffers=False)
    if compiled:
        wrapped = torch.compile(wrapped)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    per = cfg.batch_size // world

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = wrapped(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()

        def value():
            t = loss.detach().clone()
            dist.all_reduce(t)
            return float(t) / world

        return value

    return (model, opt), step

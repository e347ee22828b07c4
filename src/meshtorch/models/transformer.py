"""Decoder-only Transformer language model on named dimensions (pre-norm residual stack).

Dimension names (the layout language talks about these): ``batch``, ``length``, ``d_model``,
``heads``, ``d_kv``, ``d_ff``, ``vocab``, and with MoE layers ``experts`` (plus the MoE layer's
internal ``experts_unsplit``, ``expert_batch``, ``expert_capacity``; see :mod:`meshtorch.layers.moe`).
Typical layouts on a ``data:2,model:2`` mesh: ``batch:data`` (data parallel),
``heads:model;d_ff:model;vocab:model`` (Megatron-style model parallel), or both; with experts on
``all:4``, ``batch:all;experts:all`` (GShard expert parallelism: all-to-alls). Follows Mesh TF's
``transformer`` package (Unitransformer with pre-norm layers) in structure; the parameter naming is
ours and documented in :func:`build_lm`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

import meshtorch as mtf
from meshtorch.core.dims import Dimension


@dataclass(frozen=True)
class LMConfig:
    """Hyper-parameters of the decoder-only LM."""

    vocab_size: int = 256
    d_model: int = 256
    num_heads: int = 8
    d_kv: int = 32
    d_ff: int = 1024
    num_layers: int = 4
    length: int = 128
    batch_size: int = 16
    dropout: float = 0.0
    activation: str = "relu"
    gated: bool = False
    norm: str = "rms"  # "rms" or "layer"
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    vocab_multiple: int = 1  # pad the vocab to a multiple of this (so a mesh axis can split it)
    num_experts: int = 0  # > 0: Mixture-of-Experts feed-forward in every ``moe_every``-th layer
    expert_capacity_factor: float = 1.25
    moe_every: int = 2  # layers i with (i + 1) % moe_every == 0 are MoE (GShard: every other layer)
    moe_aux_loss_coef: float = 1e-2
    moe_top_k: int = 2
    moe_min_capacity: int = 4  # Mesh TF's minimum expert capacity

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has a Mixture-of-Experts feed-forward."""
        return self.num_experts > 0 and (i + 1) % max(1, self.moe_every) == 0

    @property
    def padded_vocab(self) -> int:
        m = max(1, self.vocab_multiple)
        return (self.vocab_size + m - 1) // m * m

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "tiny": LMConfig(d_model=64, num_heads=4, d_kv=16, d_ff=256, num_layers=2, length=64, batch_size=16),
    "small": LMConfig(d_model=128, num_heads=4, d_kv=32, d_ff=512, num_layers=3, length=128, batch_size=16),
    "base": LMConfig(),
}


def preset(name: str, **overrides) -> LMConfig:
    """A named configuration (tiny, small, base) with fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class LMGraph:
    """The built graph and its handles."""

    config: LMConfig
    graph: mtf.Graph
    mesh: mtf.Mesh
    inputs: mtf.Tensor  # int64 [batch, length]
    targets: mtf.Tensor  # int64 [batch, length]
    logits: mtf.Tensor  # [batch, length, vocab]
    loss: mtf.Tensor  # scalar, mean cross-entropy in nats (plus z-loss, plus coef x MoE aux losses)
    updates: list
    step: object | None = None
    aux_loss: mtf.Tensor | None = None  # sum of the MoE layers' load-balancing losses (before the coef)
    task_loss: mtf.Tensor | None = None  # ``loss`` without the MoE auxiliary term (what evaluation reports)

    def lowering(self, mesh_shape="", layout="", mesh_impl=None) -> mtf.Lowering:
        impl = mesh_impl if mesh_impl is not None else mtf.PlacementMeshImpl(mesh_shape, layout)
        return mtf.Lowering(self.graph, {self.mesh: impl})


def dims(c: LMConfig) -> dict[str, Dimension]:
    return {"batch": Dimension("batch", c.batch_size), "length": Dimension("length", c.length),
            "d_model": Dimension("d_model", c.d_model), "heads": Dimension("heads", c.num_heads),
            "d_kv": Dimension("d_kv", c.d_kv), "d_ff": Dimension("d_ff", c.d_ff),
            "vocab": Dimension("vocab", c.padded_vocab), "experts": Dimension("experts", max(1, c.num_experts))}


def _norm(c, x, d, name):
    if c.norm == "rms":
        return mtf.layers.rms_norm(x, d, name=name)
    return mtf.layers.layer_norm(x, d, name=name)


def _dropout(c, x, train):
    if not train or c.dropout <= 0:
        return x
    return mtf.dropout(x, rate=c.dropout)


def build_lm(config: LMConfig, seed: int = 0, optimizer=None, train: bool = True,
             clip_norm: float | None = None) -> LMGraph:
    """Build the LM graph: embeddings, ``num_layers`` pre-norm blocks, final norm, logits, loss.

    Variables: ``embedding`` [vocab, d_model] (std 1), ``pos_embedding`` [length, d_model]
    (std 0.02), per layer ``layer_{i}/attention/{q,k,v}`` [d_model, heads, d_kv],
    ``layer_{i}/attention/o`` [heads, d_kv, d_model], ``layer_{i}/ffn/wi/kernel`` [d_model, d_ff],
    ``layer_{i}/ffn/wo/kernel`` [d_ff, d_model] (MoE layers instead: ``layer_{i}/moe/router/kernel``
    [d_model, experts_unsplit], ``layer_{i}/moe/wi/kernel`` [experts, d_model, d_ff],
    ``layer_{i}/moe/wo/kernel`` [experts, d_ff, d_model]), norm scales ``.../scale`` [d_model], and
    ``logits/kernel`` [d_model, vocab].

    Args:
        config: the LMConfig.
        seed: graph seed (initial values and dropout).
        optimizer: an ``mtf.optim`` optimizer; its update ops go to ``LMGraph.updates``.
        train: build dropout (only when ``config.dropout > 0``).
        clip_norm: clip gradients to this global norm before the optimizer (``mtf.optim.clip_by_global_norm``).

    Raises:
        ValueError: MoE layers with ``gated=True`` (not implemented).
    """
    c = config
    if c.num_experts > 0 and c.gated:
        raise ValueError("build_lm: gated feed-forward is not implemented for MoE layers (num_experts > 0).")
    aux_losses = []
    d = dims(c)
    graph = mtf.Graph(seed=seed)
    mesh = mtf.Mesh(graph, "mesh")
    inputs = mtf.placeholder(mesh, "inputs", [d["batch"], d["length"]], dtype=torch.int64)
    targets = mtf.placeholder(mesh, "targets", [d["batch"], d["length"]], dtype=torch.int64)
    emb = mtf.get_variable(mesh, "embedding", [d["vocab"], d["d_model"]],
                           initializer=mtf.random_normal_initializer(0.0, 1.0))
    pos = mtf.get_variable(mesh, "pos_embedding", [d["length"], d["d_model"]],
                           initializer=mtf.random_normal_initializer(0.0, 0.02))
    x = _embed(inputs, emb, d) + pos
    x = _dropout(c, x, train)
    for i in range(c.num_layers):
        h = _norm(c, x, d["d_model"], f"layer_{i}/attention_norm")
        h = mtf.layers.multihead_attention_layer(h, d["heads"], d["d_kv"], "length", causal=True,
                                           scale=1.0 / math.sqrt(c.d_kv), name=f"layer_{i}/attention")
        x = x + _dropout(c, h, train)
        h = _norm(c, x, d["d_model"], f"layer_{i}/ffn_norm")
        if c.is_moe_layer(i):
            h, aux = mtf.layers.moe_ffn(h, d["experts"], d["d_ff"], capacity_factor=c.expert_capacity_factor,
                                        top_k=c.moe_top_k, min_expert_capacity=c.moe_min_capacity,
                                        activation=c.activation, name=f"layer_{i}/moe")
            aux_losses.append(aux)
        else:
            h = mtf.layers.dense_act_dense(h, d["d_ff"], activation=c.activation, gated=c.gated,
                                            name=f"layer_{i}/ffn")
        x = x + _dropout(c, h, train)
    x = _norm(c, x, d["d_model"], "final_norm")
    logits = mtf.layers.dense(x, d["vocab"], use_bias=False, name="logits",
                              kernel_initializer=mtf.VarianceScalingInitializer(1.0, "fan_in", "normal",
                                                                                [d["d_model"]], [d["vocab"]]))
    if c.padded_vocab != c.vocab_size:  # padded classes never win: -1e9 added (no gradient)
        mask = torch.zeros(c.padded_vocab)
        mask[c.vocab_size:] = -1e9
        logits = logits + mtf.import_tensor(mesh, mask, [d["vocab"]], name="vocab_pad_mask")
    soft = mtf.one_hot(targets, d["vocab"], dtype=logits.dtype)
    if c.label_smoothing:  # spread over the real (unpadded) classes only
        spread = torch.zeros(c.padded_vocab)
        spread[: c.vocab_size] = c.label_smoothing / c.vocab_size
        soft = soft * (1.0 - c.label_smoothing) + mtf.import_tensor(mesh, spread, [d["vocab"]], name="smoothing")
    xent = mtf.layers.softmax_cross_entropy_with_logits(logits, soft, d["vocab"], z_loss=c.z_loss)
    loss = task_loss = mtf.reduce_mean(xent, name="loss")
    aux_loss = None
    if aux_losses:
        aux_loss = mtf.add_n(aux_losses) if len(aux_losses) > 1 else aux_losses[0]
        loss = loss + aux_loss * c.moe_aux_loss_coef
    updates, step = [], None
    if optimizer is not None:
        variables = graph.trainable_variables
        grads = mtf.gradients([loss], variables)
        if clip_norm:
            grads, _ = mtf.optim.clip_by_global_norm(grads, clip_norm)
        updates = optimizer.apply_grads(grads, variables)
    return LMGraph(c, graph, mesh, inputs, targets, logits, loss, updates, step, aux_loss, task_loss)


def _embed(ids, table, d):
    """Embedding lookup: ``gather`` when available, else one_hot x einsum (Mesh TF's way)."""
    gather = getattr(mtf, "gather", None)
    if gather is not None:
        return gather(table, ids, d["vocab"])
    return mtf.einsum([mtf.one_hot(ids, d["vocab"]), table], reduced_dims=[d["vocab"]], name="embedding_lookup")


def flops_per_token(c: LMConfig) -> float:
    """Training FLOPs per token (6N for the weights + attention scores), PaLM appendix B convention."""
    ffn = 2 * c.d_model * c.d_ff * (1.5 if c.gated else 1)
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    n = c.num_layers * 4 * c.d_model * c.num_heads * c.d_kv + (c.num_layers - n_moe) * ffn
    n += n_moe * (c.moe_top_k * ffn + c.d_model * c.num_experts)  # active experts per token + router
    n += c.d_model * c.padded_vocab
    attn = c.num_layers * 2 * c.num_heads * c.d_kv * c.length  # QK^T and AV, causal average ~ L/2 each x2
    return 6 * n + 6 * attn

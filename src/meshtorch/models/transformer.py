"""Decoder-only Transformer language model on named dimensions (pre-norm residual stack).

Dimension names (the layout language talks about these): ``batch``, ``length``, ``d_model``,
``heads``, ``d_kv``, ``d_ff``, ``vocab``, and with MoE layers ``experts`` (plus the MoE layer's
internal ``experts_unsplit``, ``expert_batch``, ``expert_capacity``; see :mod:`meshtorch.layers.moe`).
Typical layouts on a ``data:2,model:2`` mesh: ``batch:data`` (data parallel),
``heads:model;d_ff:model;vocab:model`` (Megatron-style model parallel), or both; with experts on
``all:4``, ``batch:all;experts:all`` (GShard expert parallelism: all-to-alls). Pipelined
(``LMConfig.pipeline_stages`` > 1) the blocks' weights carry ``stage`` (and ``repeat``) dims and the batch
a ``microbatches`` dim: on ``pipe:2,data:2``, ``stage:pipe;batch:data`` (pipeline parallelism: neighbour
exchanges over ``pipe``; :mod:`meshtorch.layers.pipeline`). Follows Mesh TF's
``transformer`` package (Unitransformer with pre-norm layers) in structure; the parameter naming is
ours and documented in :func:`build_lm`. The blocks are :func:`meshtorch.models.blocks.block` (the one block
builder of the decoder-only models) with :func:`block_spec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from meshtorch import layers, optim
from meshtorch.autodiff import gradients, recompute_grad
from meshtorch.core.dims import Dimension, Shape
from meshtorch.core.graph import Graph, Mesh, Tensor
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.core.pipeline import LM_STACKED_NAMES, PipelineSchedule, StackedNames
from meshtorch.layers.attention import AttentionOperation
from meshtorch.lowering import Lowering
from meshtorch.models.blocks import FULL_SEQUENCE, NATIVE_NAMES, BlockSpec, MoEOptions, block, norm
from meshtorch.models.config_base import TransformerSizes
from meshtorch.ops.einsum import EinsumOperation
from meshtorch.ops.elementwise import cast
from meshtorch.ops.indexing import one_hot
from meshtorch.ops.initializers import VarianceScalingInitializer, random_normal_initializer
from meshtorch.ops.precision import PrecisionPolicy
from meshtorch.ops.random import dropout
from meshtorch.ops.reduce import reduce_mean
from meshtorch.ops.reshape import reshape
from meshtorch.ops.shape import add_n
from meshtorch.ops.variables import get_variable, import_tensor, placeholder
from meshtorch.optim.loss_scale import DynamicLossScale, unscale_gradients


@dataclass(frozen=True)
class LMConfig(TransformerSizes):
    """Hyper-parameters of the decoder-only LM (the sizes first:
    :class:`~meshtorch.models.config_base.TransformerSizes`)."""

    num_layers: int = 4
    length: int = 128
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
    remat: str = "none"  # activation checkpointing of the (dense) blocks: "none", "block" or "selective"
    pipeline_stages: int = 0  # S > 1: the blocks run as an S-stage pipeline on a ``stage`` dim (0 or 1: no pipeline)
    microbatches: int = 1  # M: the batch is cut into M microbatches that flow through the pipeline
    pipeline_repeats: int = 1  # R > 1: circular pipeline, stage s runs layers s, S + s, ..., (R - 1) * S + s
    pipeline_remat: bool = True  # recompute each pipeline iteration's block in the backward pass (pipelines
    # use this instead of ``remat``; ``remat="selective"`` then keeps the matmul and attention outputs)
    pipeline_poison_bubbles: bool = False  # tests only: bubbles hold NaN (not zeros) before they are masked

    def __post_init__(self):
        check_pipeline_config(self)

    @property
    def pipelined(self) -> bool:
        """Whether the blocks run as a pipeline (``pipeline_stages > 1``)."""
        return self.pipeline_stages > 1

    @property
    def pipeline_schedule(self) -> PipelineSchedule | None:
        """The :class:`~meshtorch.core.pipeline.PipelineSchedule` of a pipelined config, else None."""
        if not self.pipelined:
            return None
        return PipelineSchedule(self.pipeline_stages, self.microbatches, self.pipeline_repeats)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has a Mixture-of-Experts feed-forward."""
        return self.num_experts > 0 and (i + 1) % max(1, self.moe_every) == 0


def check_pipeline_config(c: LMConfig) -> None:
    """Check the pipeline fields of ``c`` (called when an LMConfig is made).

    Raises:
        ValueError: one line naming the field and what to do: ``pipeline_stages`` negative or not dividing
            ``num_layers`` as ``num_layers == pipeline_stages * pipeline_repeats``; ``microbatches`` not dividing
            ``batch_size``, or fewer than ``pipeline_stages`` with ``pipeline_repeats > 1``; ``microbatches`` or
            ``pipeline_repeats`` other than 1 without a pipeline; MoE layers in a pipeline.
    """
    S, M, R = c.pipeline_stages, c.microbatches, c.pipeline_repeats
    for field, v, low in (("pipeline_stages", S, 0), ("microbatches", M, 1), ("pipeline_repeats", R, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"LMConfig: {field} must be an int >= {low}, got {v!r}.")
    if S <= 1:
        if M != 1 or R != 1:
            raise ValueError(f"LMConfig: microbatches={M} / pipeline_repeats={R} need a pipeline; set pipeline_stages "
                             "> 1 (or leave them at 1).")
        return
    if c.num_layers != S * R:
        raise ValueError(f"LMConfig: num_layers ({c.num_layers}) must equal pipeline_stages x pipeline_repeats "
                         f"({S} x {R}); change num_layers or pipeline_repeats.")
    if c.batch_size % M:
        raise ValueError(f"LMConfig: batch_size ({c.batch_size}) must be a multiple of microbatches ({M}).")
    if R > 1 and M < S:
        raise ValueError(f"LMConfig: microbatches ({M}) must be >= pipeline_stages ({S}) with pipeline_repeats > 1 "
                         "(circular schedule); raise microbatches.")
    if c.num_experts > 0 and any(c.is_moe_layer(i) for i in range(c.num_layers)):
        raise ValueError("LMConfig: MoE layers (num_experts > 0) cannot be pipelined (the pipeline stacks identical "
                         "layers' weights on 'stage', and MoE and dense feed-forwards differ); set num_experts=0 or "
                         "pipeline_stages=0.")


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
    graph: Graph
    mesh: Mesh
    inputs: Tensor  # int64 [batch, length]
    targets: Tensor  # int64 [batch, length]
    logits: Tensor  # [batch, length, vocab]
    loss: Tensor  # scalar, mean cross-entropy in nats (plus z-loss, plus coef x MoE aux losses)
    updates: list
    step: object | None = None
    aux_loss: Tensor | None = None  # sum of the MoE layers' load-balancing losses (before the coef)
    task_loss: Tensor | None = None  # ``loss`` without the MoE auxiliary term (what evaluation reports)
    pipeline: PipelineSchedule | None = None  # the schedule of a pipelined LM (also ``graph.pipeline_schedule``)

    def lowering(self, mesh_shape="", layout="", mesh_impl=None) -> Lowering:
        """Lower the graph on ``mesh_impl`` (any ``MeshImpl``, e.g. from :func:`meshtorch.mesh.make_mesh_impl`,
        or a :class:`~meshtorch.core.mesh_spec.MeshSpec`) or, for convenience, on ``MeshSpec(mesh_shape, layout)``
        simulated in this process (a :class:`~meshtorch.mesh.placement.PlacementMeshImpl`).

        Raises:
            LayoutError: naming the tensor and dimension if the layout is illegal for this model.
        """
        impl = mesh_impl if mesh_impl is not None else MeshSpec(mesh_shape, layout)
        return Lowering(self.graph, {self.mesh: impl})


def dims(c: LMConfig) -> dict[str, Dimension]:
    return {"batch": Dimension("batch", c.batch_size), "length": Dimension("length", c.length),
            "d_model": Dimension("d_model", c.d_model), "heads": Dimension("heads", c.num_heads),
            "d_kv": Dimension("d_kv", c.d_kv), "d_ff": Dimension("d_ff", c.d_ff),
            "vocab": Dimension("vocab", c.padded_vocab), "experts": Dimension("experts", max(1, c.num_experts))}


def block_spec(c: LMConfig) -> BlockSpec:
    """The native LM's :class:`~meshtorch.models.blocks.BlockSpec`: :data:`~meshtorch.models.blocks.NATIVE_NAMES`,
    ``c.norm`` (epsilon 1e-6), no positions in the block (learned ``pos_embedding``), multi-head attention and
    MLP without biases, variance-scaling (fan-in) initialisers, ``c.activation`` / ``c.gated`` / ``c.dropout``, and
    MoE settings when ``c.num_experts`` > 0."""
    moe = MoEOptions(c.expert_capacity_factor, c.moe_top_k, c.moe_min_capacity) if c.num_experts > 0 else None
    return BlockSpec(NATIVE_NAMES, norm=c.norm, activation=c.activation, gated=c.gated, dropout=c.dropout, moe=moe)


def _norm(c, x, d, name):
    """``c.norm`` of ``x`` over the Dimension ``d`` (:func:`meshtorch.models.blocks.norm`)."""
    return norm(x, d, block_spec(c), name)


def _dropout(c, x, train):
    if not train or c.dropout <= 0:
        return x
    return dropout(x, rate=c.dropout)


def build_lm(config: LMConfig, seed: int = 0, optimizer=None, train: bool = True,
             clip_norm: float | None = None, precision: PrecisionPolicy | str | None = None,
             loss_scale: DynamicLossScale | None = None) -> LMGraph:
    """Build the LM graph: embeddings, ``num_layers`` pre-norm blocks, final norm, logits, loss.

    Variables: ``embedding`` [vocab, d_model] (std 1), ``pos_embedding`` [length, d_model]
    (std 0.02), per layer ``layer_{i}/attention/{q,k,v}`` [d_model, heads, d_kv],
    ``layer_{i}/attention/o`` [heads, d_kv, d_model], ``layer_{i}/ffn/wi/kernel`` [d_model, d_ff],
    ``layer_{i}/ffn/wo/kernel`` [d_ff, d_model] (MoE layers instead: ``layer_{i}/moe/router/kernel``
    [d_model, experts_unsplit], ``layer_{i}/moe/wi/kernel`` [experts, d_model, d_ff],
    ``layer_{i}/moe/wo/kernel`` [experts, d_ff, d_model]), norm scales ``.../scale`` [d_model], and
    ``logits/kernel`` [d_model, vocab].

    Pipelined (``pipeline_stages`` S > 1, :func:`meshtorch.layers.pipeline.pipeline`): the per-layer variables
    are replaced by stacked ones, ``stack/{kind}`` of shape ``[stage, kind's shape]`` (``[stage, repeat, ...]``
    when ``pipeline_repeats`` R > 1) for each ``layer_{i}/{kind}`` above (``stack/attention/q``
    [stage, d_model, heads, d_kv], ``stack/ffn/wi/kernel``, ``stack/attention_norm/scale``, ...): row ``[s, r]``
    is layer ``r * S + s`` and starts from exactly that layer's initial values. Embeddings, final norm and
    logits keep their names. Checkpoints cross: an unpipelined (or stage executor's) checkpoint restores into a
    pipelined model and the reverse, row ``[s, r]`` from ``layer_{r S + s}`` (``graph.stacked_names``, a
    :class:`~meshtorch.core.pipeline.StackedNames`; optimizer slots too). The batch is cut into ``microbatches``
    (rows m, M + m, ... form microbatch m), so dropout masks differ from the unpipelined model's; without dropout
    the losses and gradients are the same.

    Args:
        config: the LMConfig.
        seed: graph seed (initial values and dropout).
        optimizer: an ``meshtorch.optim`` optimizer; its update ops go to ``LMGraph.updates``.
        train: build dropout (only when ``config.dropout > 0``).
        clip_norm: clip gradients to this global norm before the optimizer (``meshtorch.optim.clip_by_global_norm``).
        precision: a :class:`~meshtorch.ops.precision.PrecisionPolicy` (or its name, ``fp32``/``tf32``/``bf16``;
            None: float32): bf16 keeps float32 masters and optimizer state and computes in bfloat16, with
            softmax, loss and norms' statistics in float32 (``loss`` is float32). A float16 policy
            (``PrecisionPolicy(torch.float16)``) trains with dynamic loss scaling (``loss_scale``).
        loss_scale: the :class:`~meshtorch.optim.loss_scale.DynamicLossScale` of a float16 policy (default:
            ``torch.amp.GradScaler``'s defaults); the optimizer must then be (fused) Adam or AdamW.

    Raises:
        ValueError: MoE layers with ``gated=True`` (not implemented); bad pipeline fields (see
            :func:`check_pipeline_config`, run when the config is made).
    """
    policy = PrecisionPolicy.of(precision)
    if policy.mixed:
        if policy.compute_dtype == torch.float16 and optimizer is not None:
            loss_scale = loss_scale or DynamicLossScale()
        with policy.scope():
            return build_lm(config, seed, optimizer, train, clip_norm, loss_scale=loss_scale)
    c = config
    if c.remat not in REMAT_POLICIES:
        raise ValueError(f"build_lm: remat must be one of {', '.join(REMAT_POLICIES)}, got {c.remat!r}.")
    if c.num_experts > 0 and c.gated:
        raise ValueError("build_lm: gated feed-forward is not implemented for MoE layers (num_experts > 0).")
    aux_losses = []
    d = dims(c)
    graph = Graph(seed=seed)
    graph.stacked_names = LM_STACKED_NAMES  # checkpoints of the other (un)pipelined naming restore too
    mesh = Mesh(graph, "mesh")
    inputs = placeholder(mesh, "inputs", [d["batch"], d["length"]], dtype=torch.int64)
    targets = placeholder(mesh, "targets", [d["batch"], d["length"]], dtype=torch.int64)
    x = _embeddings(mesh, inputs, d)
    x = _dropout(c, x, train)
    if c.pipelined:
        x = _pipelined_blocks(c, d, x, train)
    for i in range(0 if c.pipelined else c.num_layers):
        moe = c.is_moe_layer(i)
        if c.remat == "none" or moe:
            x = _block(c, d, x, f"layer_{i}", train, aux_losses, moe)
        else:  # activation checkpointing: the block's activations are recomputed in the backward pass
            x = recompute_grad(lambda t, i=i: _block(c, d, t, f"layer_{i}", train, aux_losses), [x],
                               keep=keeps_matmuls if c.remat == "selective" else None)
    logits = lm_logits(c, d, x)
    soft, xlogits = targets, logits  # integer ids: a sparse cross entropy, no [batch, length, vocab] one-hot tensor
    if c.label_smoothing:  # spread over the real (unpadded) classes only; softmax and loss in float32
        xlogits = cast(logits, torch.float32)
        spread = torch.zeros(c.padded_vocab)
        spread[: c.vocab_size] = c.label_smoothing / c.vocab_size
        soft = one_hot(targets, d["vocab"], dtype=xlogits.dtype) * (1.0 - c.label_smoothing) + import_tensor(
            mesh, spread, [d["vocab"]], name="smoothing")
    xent = layers.softmax_cross_entropy_with_logits(xlogits, soft, d["vocab"], z_loss=c.z_loss)
    loss = task_loss = reduce_mean(xent, name="loss")
    aux_loss = None
    if aux_losses:
        aux_loss = add_n(aux_losses) if len(aux_losses) > 1 else aux_losses[0]
        loss = loss + cast(aux_loss, loss.dtype) * c.moe_aux_loss_coef
    updates, step = training_updates(graph, loss, optimizer, clip_norm, loss_scale), None
    lm = LMGraph(c, graph, mesh, inputs, targets, logits, loss, updates, step, aux_loss, task_loss)
    lm.pipeline = graph.pipeline_schedule = c.pipeline_schedule
    return lm


def _pipelined_blocks(c, d, x, train):
    """The native blocks as a pipeline (:func:`pipelined_stack` with :data:`LM_STACKED_NAMES`)."""
    return pipelined_stack(c, d, x, lambda h, name: _block(c, d, h, name, train, []), LM_STACKED_NAMES)


def pipelined_stack(c, d: dict, x: Tensor, stage_fn, names: StackedNames, side_inputs=(),
                    name: str = "pipeline") -> Tensor:
    """The blocks as a ``c.pipeline_stages``-stage pipeline (:func:`meshtorch.layers.pipeline.pipeline`), shared by
    the native LM and the imported Hugging Face models (``c``: an ``LMConfig`` or ``HFModelConfig`` with its
    pipeline fields; ``stage_fn(h, name, *sides)``: one block named ``name``; ``names``: the stacked variables'
    naming): ``x`` ``[batch, length, d_model]`` is read as ``[batch / M, microbatches, length, d_model]``
    (row-major, so a split of ``batch`` stays local: microbatch m holds rows m, M + m, 2M + m, ...), the M
    microbatches run through the stages, and the outputs are put back in ``x``'s row order. ``side_inputs``
    ``[batch, ...]`` (an encoder's output and masks) are cut into the same microbatches; each block gets its
    microbatch's slices (``sides``). ``name`` names the pipeline's ops."""
    sched = c.pipeline_schedule
    M = sched.microbatches

    def micro(t: Tensor, what: str) -> Tensor:
        rest = t.shape.dims[1:]
        shape = Shape([Dimension("batch", c.batch_size // M), Dimension("microbatches", M)] + rest)
        return reshape(t, shape, name=f"{name}/microbatch{what}")

    sides = [micro(t, f"_side_{i}") for i, t in enumerate(side_inputs)]
    ys = layers.pipeline(stage_fn, micro(x, ""), sched, remat=getattr(c, "pipeline_remat", True),
                         remat_keep=keeps_matmuls if c.remat == "selective" else None,
                         bubble_fill=math.nan if getattr(c, "pipeline_poison_bubbles", False) else 0.0,
                         variable_prefix=names.prefix, layer_names=names.layer_name, side_inputs=sides,
                         name=name)
    return reshape(ys, x.shape, name=f"{name}/unbatch")


def lm_logits(c: LMConfig, d: dict, x: Tensor) -> Tensor:
    """Final norm and logits ``[..., vocab]`` of the last block's output ``x`` ``[..., d_model]``; padded classes
    (``vocab_multiple``) get -1e9 added (never win, no gradient)."""
    x = _norm(c, x, d["d_model"], "final_norm")
    logits = layers.dense(x, d["vocab"], use_bias=False, name="logits",
                              kernel_initializer=VarianceScalingInitializer(1.0, "fan_in", "normal",
                                                                                [d["d_model"]], [d["vocab"]]))
    if c.padded_vocab != c.vocab_size:
        mask = torch.zeros(c.padded_vocab)
        mask[c.vocab_size:] = -1e9
        logits = logits + import_tensor(x.mesh, mask.to(logits.dtype), [d["vocab"]], name="vocab_pad_mask")
    return logits


def decoder_block(c: LMConfig, d: dict, x: Tensor, name: str, attend) -> Tensor:
    """Block ``name`` for decoding (no dropout, dense feed-forward), its self-attention through ``attend`` (a
    :mod:`meshtorch.layers.kv_cache` ``Prefill`` or ``Step``; ``x`` ``[batch, d_model]`` in a step)."""
    return _block(c, d, x, name, False, [], attend=attend)


def _block(c, d, x, name, train, aux_losses, moe=False, attend=None):
    """One pre-norm block named ``name``: self-attention and feed-forward (or MoE) sublayers with residuals
    (:func:`meshtorch.models.blocks.block` with :func:`block_spec`). ``x`` ``[..., length, d_model]`` may carry
    leading dims (a pipeline's ``stage``): every op treats them as batch."""
    return block(x, d, block_spec(c), f"{name}/", attend if attend is not None else FULL_SEQUENCE, train, moe,
                 aux_losses)


#: ``LMConfig.remat`` / ``meshtorch train --remat``: activation checkpointing policies. ``none`` keeps every
#: activation; ``block`` recomputes each (dense) block's forward pass in the backward pass, keeping only the
#: block inputs (:func:`meshtorch.autodiff.recompute_grad`); ``selective`` keeps the blocks' matmul and
#: attention outputs and recomputes the elementwise ops (norms, activations, residual adds) from them
#: (PyTorch's selective activation checkpointing). MoE layers are never recomputed.
REMAT_POLICIES = ("none", "block", "selective")


def keeps_matmuls(op) -> bool:
    """The ``selective`` remat policy's rule (``recompute_grad``'s ``keep``): keep matmul and attention outputs."""
    return isinstance(op, EinsumOperation | AttentionOperation)


def _embeddings(mesh, inputs, d):
    """Token plus position embeddings of ``inputs`` (variables ``embedding``, ``pos_embedding``)."""
    emb = get_variable(mesh, "embedding", [d["vocab"], d["d_model"]], initializer=random_normal_initializer(0.0, 1.0))
    pos = get_variable(mesh, "pos_embedding", [d["length"], d["d_model"]],
                       initializer=random_normal_initializer(0.0, 0.02))
    return _embed(inputs, emb, d) + pos


def _embed(ids, table, d):
    """Embedding lookup: the ``ids`` rows of ``table`` (:func:`meshtorch.layers.embedding_lookup`, a ``gather``;
    Mesh TF: one_hot x einsum, same values)."""
    return layers.embedding_lookup(table, ids, d["vocab"])


def training_updates(graph: Graph, loss: Tensor, optimizer=None, clip_norm: float | None = None,
                     loss_scale: DynamicLossScale | None = None) -> list:
    """The update ops of ``optimizer`` for every trainable variable of ``graph``, from the gradients of the
    scalar ``loss`` (clipped to the global norm ``clip_norm`` first, when given); ``[]`` without an optimizer.
    Shared by the native LM and the imported Hugging Face models.

    ``loss_scale`` (float16 training, :mod:`meshtorch.optim.loss_scale`): the gradients are those of ``loss``
    times the scale, unscaled before clipping; a step with an inf/NaN gradient changes no variable and backs
    the scale off (``torch.amp.GradScaler``'s ``scale``, ``unscale_``, ``step``, ``update``).

    Raises:
        ValueError: ``loss_scale`` with an optimizer other than (fused) Adam/AdamW.
    """
    if optimizer is None:
        return []
    variables = graph.trainable_variables
    if loss_scale is None:
        grads = gradients([loss], variables)
        found = None
    else:
        if not isinstance(optimizer, optim.AdamOptimizer):
            raise ValueError(f"float16 loss scaling skips overflowed steps inside the fused Adam/AdamW update; "
                             f"got {type(optimizer).__name__}: use AdamW, or bf16 (no loss scaling needed).")
        scale, tracker = loss_scale.variables(loss.mesh)
        grads = gradients([loss * scale], variables)
        grads, found = unscale_gradients(grads, scale)
    if clip_norm:
        grads, _ = optim.clip_by_global_norm(grads, clip_norm)
    if found is None:
        return optimizer.apply_grads(grads, variables)
    return [*optimizer.apply_grads(grads, variables, found_inf=found), loss_scale.update(scale, tracker, found)]


def flops_per_token(c: LMConfig) -> float:
    """Training FLOPs per token (6N for the weights + attention scores), PaLM appendix B convention."""
    ffn = 2 * c.d_model * c.d_ff * (1.5 if c.gated else 1)
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    n = c.num_layers * 4 * c.d_model * c.num_heads * c.d_kv + (c.num_layers - n_moe) * ffn
    n += n_moe * (c.moe_top_k * ffn + c.d_model * c.num_experts)  # active experts per token + router
    n += c.d_model * c.padded_vocab
    attn = c.num_layers * 2 * c.num_heads * c.d_kv * c.length  # QK^T and AV, causal average ~ L/2 each x2
    return 6 * n + 6 * attn

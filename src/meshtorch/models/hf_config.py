"""The configuration of an imported Hugging Face model and where its variables sit in safetensors tensors, as
plain data (no file IO, no graph).

:class:`HFModelConfig` is what the one builder (:func:`meshtorch.models.hf.build_hf_lm`) and T5's read;
:class:`HFTensor` places a variable in a checkpoint tensor (transposes, merged ``heads x d_kv`` axes, fused
tensors). The families themselves (config fields, block options, tensor names) are records in
:mod:`meshtorch.models.hf_families`; T5's parser and map are here (:func:`parse_t5`, :func:`t5_tensor_map`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from meshtorch.core.errors import CheckpointError
from meshtorch.core.pipeline import PipelineSchedule
from meshtorch.models.config_base import padded_size

__all__ = ["HFModelConfig", "HFTensor", "hf_dim_sizes", "parse_t5", "t5_tensor_map", "rope_theta", "need", "refuse"]


@dataclass(frozen=True)
class HFModelConfig:
    """The computation of an imported decoder-only model, with the graph's batch and length.

    ``family`` is the ``model_type`` (a key of :data:`meshtorch.models.hf_families.FAMILIES`); ``hf_config`` the
    original ``config.json`` dict (written back on export). ``norm`` .. ``mlp_bias`` are the decoder block's
    options (:class:`meshtorch.models.hf_families.BlockOptions`); ``sliding_window`` > 0 is a local attention
    window (Mistral, Qwen2), accepted only when at least ``length`` long. ``vocab_size``, ``batch_size`` and
    ``length`` are the fields :mod:`meshtorch.runtime.generate` reads.
    """

    family: str
    vocab_size: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    d_kv: int
    d_ff: int
    num_layers: int
    max_positions: int
    norm_eps: float
    tied: bool
    norm: str = "rms"  # "layer" (with bias) or "rms"
    positions: str = "rotary"  # "learned" (a position table) or "rotary"
    activation: str = "silu"  # the MLP's: gelu_tanh, gelu or silu (layers.dense_act_dense's names)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int = 0  # 0: none
    rope_theta: float = 10000.0
    num_decoder_layers: int = 0  # T5
    relative_buckets: int = 32  # T5
    gated: bool = True  # a GLU MLP (Llama's SwiGLU, T5 v1.1's gated-gelu); False: act(W_i x) (GPT-2, T5 relu)
    batch_size: int = 1
    length: int = 0
    vocab_multiple: int = 1  # the graph's vocab padded to a multiple of this (a mesh axis splits it)
    remat: str = "none"  # activation checkpointing of the blocks (LMConfig.remat's policies)
    pipeline_stages: int = 0  # S > 1: the blocks run as an S-stage pipeline (LMConfig's pipeline fields)
    microbatches: int = 1
    pipeline_repeats: int = 1
    hf_config: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def padded_vocab(self) -> int:
        """The graph's ``vocab`` size: ``vocab_size`` rounded up to ``vocab_multiple`` (Megatron's
        make-vocab-size-divisible-by); the padded rows are zero and their logits masked."""
        return padded_size(self.vocab_size, self.vocab_multiple)

    def with_shape(self, batch_size: int, length: int) -> HFModelConfig:
        """This config with the graph's ``batch`` and ``length``.

        Raises:
            ValueError: naming the field, if ``length`` exceeds the model's positions or a size is < 1.
        """
        if batch_size < 1 or length < 1:
            raise ValueError(f"HF model: batch_size ({batch_size}) and length ({length}) must be >= 1.")
        if length > self.max_positions:
            raise ValueError(f"HF model: length {length} exceeds the model's {self.max_positions} positions "
                             "(config.json's n_positions / max_position_embeddings).")
        if 0 < self.sliding_window < length:
            raise ValueError(f"HF model: config.json's sliding_window {self.sliding_window} is shorter than the "
                             f"context length {length}; meshtorch has no sliding-window attention: use a length "
                             f"<= {self.sliding_window}.")
        return replace(self, batch_size=int(batch_size), length=int(length))

    @property
    def pipelined(self) -> bool:
        """Whether the blocks run as a pipeline (``pipeline_stages > 1``; stacked ``stack/...`` weights)."""
        return self.pipeline_stages > 1

    @property
    def pipeline_schedule(self) -> PipelineSchedule | None:
        """The :class:`~meshtorch.core.pipeline.PipelineSchedule` of a pipelined config, else None."""
        return PipelineSchedule(self.pipeline_stages, self.microbatches, self.pipeline_repeats) if self.pipelined \
            else None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``config.json``'s ``eos_token_id`` (an int or a list; () when absent): where decoding stops."""
        e = self.hf_config.get("eos_token_id")
        if e is None:
            return ()
        return tuple(int(i) for i in (e if isinstance(e, list | tuple) else [e]))

    @property
    def encoder_decoder(self) -> bool:
        """Whether the model has an encoder and a decoder (T5)."""
        return self.num_decoder_layers > 0

    def replace(self, **changes) -> HFModelConfig:
        """A copy with ``changes`` (``dataclasses.replace``; ``hf_config`` kept)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


def need(cfg: dict, key: str, where: str):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{where}: field {key!r} is missing.")
    return cfg[key]


def refuse(where: str, key: str, value, why: str):
    raise CheckpointError(f"{where}: field {key!r} = {value!r} is not supported ({why}).")


def rope_theta(cfg: dict, where: str) -> float:
    """RoPE's theta from a Llama-family ``config.json`` (``rope_theta``, or v5's ``rope_parameters``).

    Raises:
        CheckpointError: naming the field, for scaled RoPE (``rope_scaling`` / a ``rope_type`` other than
            default) or a partial rotary factor.
    """
    scaling = cfg.get("rope_scaling")
    if scaling is not None and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        refuse(where, "rope_scaling", scaling, "only unscaled rotary embeddings are implemented")
    params = cfg.get("rope_parameters")
    if params is not None:
        if params.get("rope_type", "default") != "default":
            refuse(where, "rope_parameters", params, "only rope_type 'default' is implemented")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            refuse(where, "rope_parameters", params, "partial_rotary_factor must be 1.0")
        return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return float(cfg.get("rope_theta", 10000.0))


def parse_t5(cfg: dict, where: str) -> HFModelConfig:
    """T5's :class:`HFModelConfig` (``transformers``' ``T5Config``: v1.1's gated-gelu or the original relu).

    Raises:
        CheckpointError: naming ``where`` and the field, for a setting Mesh TF's T5 layers do not compute.
    """
    ff = cfg.get("feed_forward_proj", "relu")
    if ff not in ("gated-gelu", "relu"):
        refuse(where, "feed_forward_proj", ff, "meshtorch implements 'gated-gelu' (T5 v1.1) and 'relu'")
    for key, ok in (("relative_attention_max_distance", 128), ("layer_norm_epsilon", 1e-6)):
        if cfg.get(key, ok) != ok:
            refuse(where, key, cfg[key], f"Mesh TF's T5 layers use {ok}")
    if cfg.get("tie_word_embeddings", True):
        refuse(where, "tie_word_embeddings", cfg.get("tie_word_embeddings", True),
               "only T5 v1.1's untied output layer is implemented")
    if cfg.get("scale_decoder_outputs", False):  # transformers v5: d_model^-0.5 before the untied head
        refuse(where, "scale_decoder_outputs", cfg["scale_decoder_outputs"],
               "T5 v1.1 does not scale the decoder output before its untied head")
    if not cfg.get("is_encoder_decoder", True):
        refuse(where, "is_encoder_decoder", False, "only the encoder-decoder T5 is implemented")
    h = int(need(cfg, "num_heads", where))
    layers = int(need(cfg, "num_layers", where))
    return HFModelConfig(family="t5", vocab_size=int(need(cfg, "vocab_size", where)),
                         d_model=int(need(cfg, "d_model", where)), num_heads=h, num_kv_heads=h,
                         d_kv=int(need(cfg, "d_kv", where)), d_ff=int(need(cfg, "d_ff", where)), num_layers=layers,
                         max_positions=int(cfg.get("n_positions") or 512), norm_eps=1e-6, tied=False,
                         num_decoder_layers=int(cfg.get("num_decoder_layers") or layers),
                         relative_buckets=int(cfg.get("relative_attention_num_buckets", 32)), gated=ff == "gated-gelu",
                         hf_config=dict(cfg))


@dataclass(frozen=True)
class HFTensor:
    """Where a meshtorch variable lives in a safetensors tensor.

    ``key``: the tensor's name; ``full_shape``: its shape; ``groups``: per tensor axis, the
    variable's dim names merged (row-major) into that axis, e.g. ``(("heads", "d_kv"), ("d_model",))``
    for an ``nn.Linear`` query weight ``[heads*d_kv, d_model]``; ``offset``: ``(axis, start)`` where the
    variable starts on a fused axis (GPT-2's ``c_attn`` holds q, k and v at 0, D and 2D), else None.
    """

    var: str
    key: str
    full_shape: tuple
    groups: tuple
    offset: tuple | None = None


def hf_dim_sizes(c: HFModelConfig) -> dict[str, int]:
    """The sizes of the named weight dims of model ``c``."""
    return {"vocab": c.vocab_size, "d_model": c.d_model, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
            "kv_group": c.num_heads // c.num_kv_heads, "d_kv": c.d_kv, "d_ff": c.d_ff, "positions": c.max_positions}


def t5_tensor_map(c: HFModelConfig) -> list[HFTensor]:
    """T5: Mesh TF's variable names (:func:`meshtorch.models.hf_t5.build_t5`, the same as
    :func:`meshtorch.transformer.t5.t5_bitransformer`'s and :func:`meshtorch.models.hf_t5_decoder.build_t5_decoder`'s;
    ``heads`` is the combined ``heads x d_kv`` dim of the projections, and the number of heads in
    ``relative_attention_bias``)."""
    hk, D, F = c.num_heads * c.d_kv, c.d_model, c.d_ff
    out = [HFTensor("shared/embedding", "shared.weight", (c.vocab_size, D), (("vocab",), ("d_model",)))]
    ffs = ("wi_0", "wi_1") if c.gated else ("wi",)
    for stack, n, kinds in (("encoder", c.num_layers, ("SelfAttention", "DenseReluDense")),
                            ("decoder", c.num_decoder_layers, ("SelfAttention", "EncDecAttention", "DenseReluDense"))):
        for i in range(n):
            for j, kind in enumerate(kinds):
                v, k = f"{stack}/block_{i:03d}/layer_{j:03d}/", f"{stack}.block.{i}.layer.{j}."
                out.append(HFTensor(f"{v}rms_norm/scale", f"{k}layer_norm.weight", (D,), (("d_model",),)))
                if kind == "DenseReluDense":
                    fd, df = (("d_ff",), ("d_model",)), (("d_model",), ("d_ff",))
                    out += [HFTensor(f"{v}{kind}/{w}/kernel", f"{k}{kind}.{w}.weight", (F, D), fd) for w in ffs]
                    out.append(HFTensor(f"{v}{kind}/wo/kernel", f"{k}{kind}.wo.weight", (D, F), df))
                    continue
                out += [HFTensor(f"{v}{kind}/{w}", f"{k}{kind}.{w}.weight", (hk, D), (("heads",), ("d_model",)))
                        for w in "qkv"]
                out.append(HFTensor(f"{v}{kind}/o", f"{k}{kind}.o.weight", (D, hk), (("d_model",), ("heads",))))
                if i == 0 and kind == "SelfAttention":
                    out.append(HFTensor(f"{v}{kind}/relative_attention_bias",
                                        f"{k}{kind}.relative_attention_bias.weight", (c.relative_buckets, c.num_heads),
                                        (("buckets",), ("heads",))))
        out.append(HFTensor(f"{stack}/rms_norm/scale", f"{stack}.final_layer_norm.weight", (D,), (("d_model",),)))
    out.append(HFTensor("decoder/logits/kernel", "lm_head.weight", (c.vocab_size, D), (("vocab",), ("d_model",))))
    return out



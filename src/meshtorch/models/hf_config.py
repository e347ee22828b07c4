"""Hugging Face model configurations and their tensor names, as plain data (no file IO, no graph).

:func:`parse_hf_config` turns a ``config.json`` dict of a supported ``model_type`` (``gpt2``,
``llama``) into an :class:`HFModelConfig`, refusing, by field name, every setting that changes the
computation and is not implemented. :func:`hf_tensor_map` says, for each meshtorch variable of the
graph :func:`meshtorch.models.hf.build_hf_lm` builds, which safetensors tensor holds it and how its
named dims sit in that tensor (transposes, merged ``heads x d_kv`` axes, GPT-2's fused ``c_attn``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from meshtorch.core.errors import CheckpointError

__all__ = ["HFModelConfig", "HFTensor", "parse_hf_config", "hf_tensor_map", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "t5")

_GPT2_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class HFModelConfig:
    """The computation of an imported decoder-only model, with the graph's batch and length.

    ``family`` is the ``model_type`` (``gpt2`` or ``llama``); ``hf_config`` the original
    ``config.json`` dict (written back on export). ``vocab_size``, ``batch_size`` and ``length`` are
    the fields :mod:`meshtorch.runtime.generate` reads.
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
    activation: str = "tanh"  # GPT-2: gelu approximate ("tanh" = gelu_new, "none" = erf gelu)
    rope_theta: float = 10000.0
    num_decoder_layers: int = 0  # T5
    relative_buckets: int = 32  # T5
    gated: bool = True  # T5: gated-gelu (v1.1) or relu (the original T5)
    batch_size: int = 1
    length: int = 0
    vocab_multiple: int = 1  # the graph's vocab padded to a multiple of this (a mesh axis splits it)
    remat: str = "none"  # activation checkpointing of the blocks (LMConfig.remat's policies)
    hf_config: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def padded_vocab(self) -> int:
        """The graph's ``vocab`` size: ``vocab_size`` rounded up to ``vocab_multiple`` (Megatron's
        make-vocab-size-divisible-by); the padded rows are zero and their logits masked."""
        m = max(1, self.vocab_multiple)
        return (self.vocab_size + m - 1) // m * m

    def with_shape(self, batch_size: int, length: int) -> HFModelConfig:
        """This config with the graph's ``batch`` and ``length``.

        Raises:
            ValueError: naming the field, if ``length`` exceeds the model's positions or a size is < 1.
        """
        if batch_size < 1 or length < 1:
            raise ValueError(f"HF model: batch_size ({batch_size}) and length ({length}) must be >= 1.")
        if length > self.max_positions:
            raise ValueError(f"HF model: length {length} exceeds the model's {self.max_positions} positions "
                             f"({'n_positions' if self.family == 'gpt2' else 'max_position_embeddings'}).")
        return replace(self, batch_size=int(batch_size), length=int(length))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``config.json``'s ``eos_token_id`` (an int or a list; () when absent): where decoding stops."""
        e = self.hf_config.get("eos_token_id")
        if e is None:
            return ()
        return tuple(int(i) for i in (e if isinstance(e, list | tuple) else [e]))

    def replace(self, **changes) -> HFModelConfig:
        """A copy with ``changes`` (``dataclasses.replace``; ``hf_config`` kept)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


def _need(cfg: dict, key: str, where: str):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{where}: field {key!r} is missing.")
    return cfg[key]


def _refuse(where: str, key: str, value, why: str):
    raise CheckpointError(f"{where}: field {key!r} = {value!r} is not supported ({why}).")


def parse_hf_config(cfg: dict, where: str = "config.json") -> HFModelConfig:
    """An :class:`HFModelConfig` from a Hugging Face ``config.json`` dict.

    Follows ``transformers``' ``GPT2Config`` and ``LlamaConfig`` (v4 ``rope_theta`` / ``rope_scaling``
    and v5 ``rope_parameters`` spellings). Dropout probabilities are read but not applied: the
    graph is built without dropout.

    Raises:
        CheckpointError: naming ``where`` and the field: an unknown ``model_type``, a missing size, or a
            setting that changes the computation and is not implemented (GPT-2: cross attention,
            ``scale_attn_weights=False``, ``scale_attn_by_inverse_layer_idx``, an activation other than
            gelu_new/gelu; Llama: ``rope_scaling`` / a ``rope_type`` other than default,
            ``attention_bias``, ``mlp_bias``, ``hidden_act`` other than silu).
    """
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {mt!r} is not supported; meshtorch imports "
                              f"{list(SUPPORTED_MODEL_TYPES)}.")
    if mt == "gpt2":
        return _gpt2(cfg, where)
    if mt == "t5":
        return _t5(cfg, where)
    return _llama(cfg, where)


def _gpt2(cfg: dict, where: str) -> HFModelConfig:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        _refuse(where, "activation_function", act, f"meshtorch implements {sorted(_GPT2_ACTIVATIONS)}")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if bool(cfg.get(key, ok)) != ok:
            _refuse(where, key, cfg[key], f"only {ok} is implemented")
    d = int(_need(cfg, "n_embd", where))
    h = int(_need(cfg, "n_head", where))
    if d % h:
        _refuse(where, "n_head", h, f"n_embd {d} is not a multiple of it")
    return HFModelConfig(family="gpt2", vocab_size=int(_need(cfg, "vocab_size", where)), d_model=d, num_heads=h,
                         num_kv_heads=h, d_kv=d // h, d_ff=int(cfg.get("n_inner") or 4 * d),
                         num_layers=int(_need(cfg, "n_layer", where)),
                         max_positions=int(_need(cfg, "n_positions", where)),
                         norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                         tied=bool(cfg.get("tie_word_embeddings", True)), activation=_GPT2_ACTIVATIONS[act],
                         hf_config=dict(cfg))


def _rope_theta(cfg: dict, where: str) -> float:
    scaling = cfg.get("rope_scaling")
    if scaling is not None and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        _refuse(where, "rope_scaling", scaling, "only unscaled rotary embeddings are implemented")
    params = cfg.get("rope_parameters")
    if params is not None:
        if params.get("rope_type", "default") != "default":
            _refuse(where, "rope_parameters", params, "only rope_type 'default' is implemented")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            _refuse(where, "rope_parameters", params, "partial_rotary_factor must be 1.0")
        return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return float(cfg.get("rope_theta", 10000.0))


def _llama(cfg: dict, where: str) -> HFModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", cfg["hidden_act"], "only silu (SwiGLU) is implemented")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            _refuse(where, key, cfg[key], "biases in Llama projections are not implemented")
    theta = _rope_theta(cfg, where)
    d = int(_need(cfg, "hidden_size", where))
    h = int(_need(cfg, "num_attention_heads", where))
    kv = int(cfg.get("num_key_value_heads") or h)
    if h % kv:
        _refuse(where, "num_key_value_heads", kv, f"num_attention_heads {h} is not a multiple of it")
    d_kv = int(cfg.get("head_dim") or d // h)
    return HFModelConfig(family="llama", vocab_size=int(_need(cfg, "vocab_size", where)), d_model=d, num_heads=h,
                         num_kv_heads=kv, d_kv=d_kv, d_ff=int(_need(cfg, "intermediate_size", where)),
                         num_layers=int(_need(cfg, "num_hidden_layers", where)),
                         max_positions=int(cfg.get("max_position_embeddings") or 2048),
                         norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                         tied=bool(cfg.get("tie_word_embeddings", False)), rope_theta=theta, hf_config=dict(cfg))


def _t5(cfg: dict, where: str) -> HFModelConfig:
    ff = cfg.get("feed_forward_proj", "relu")
    if ff not in ("gated-gelu", "relu"):
        _refuse(where, "feed_forward_proj", ff, "meshtorch implements 'gated-gelu' (T5 v1.1) and 'relu'")
    for key, ok in (("relative_attention_max_distance", 128), ("layer_norm_epsilon", 1e-6)):
        if cfg.get(key, ok) != ok:
            _refuse(where, key, cfg[key], f"Mesh TF's T5 layers use {ok}")
    if cfg.get("tie_word_embeddings", True):
        _refuse(where, "tie_word_embeddings", cfg.get("tie_word_embeddings", True),
                "only T5 v1.1's untied output layer is implemented")
    if cfg.get("scale_decoder_outputs", False):  # transformers v5: d_model^-0.5 before the untied head
        _refuse(where, "scale_decoder_outputs", cfg["scale_decoder_outputs"],
                "T5 v1.1 does not scale the decoder output before its untied head")
    if not cfg.get("is_encoder_decoder", True):
        _refuse(where, "is_encoder_decoder", False, "only the encoder-decoder T5 is implemented")
    h = int(_need(cfg, "num_heads", where))
    layers = int(_need(cfg, "num_layers", where))
    return HFModelConfig(family="t5", vocab_size=int(_need(cfg, "vocab_size", where)),
                         d_model=int(_need(cfg, "d_model", where)), num_heads=h, num_kv_heads=h,
                         d_kv=int(_need(cfg, "d_kv", where)), d_ff=int(_need(cfg, "d_ff", where)), num_layers=layers,
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


def _t(var, key, groups, sizes, offset=None, full=None):
    shape = tuple(_prod(sizes[n] for n in g) for g in groups)
    if full is not None:
        shape = full
    return HFTensor(var, key, shape, tuple(tuple(g) for g in groups), offset)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def hf_dim_sizes(c: HFModelConfig) -> dict[str, int]:
    """The sizes of the named weight dims of model ``c``."""
    return {"vocab": c.vocab_size, "d_model": c.d_model, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
            "kv_group": c.num_heads // c.num_kv_heads, "d_kv": c.d_kv, "d_ff": c.d_ff, "positions": c.max_positions}


def _t5_map(c: HFModelConfig) -> list[HFTensor]:
    """T5: Mesh TF's variable names (:func:`meshtorch.transformer.t5.t5_bitransformer`; ``heads`` is the combined
    ``heads x d_kv`` dim of the projections, and the number of heads in ``relative_attention_bias``)."""
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


def hf_tensor_map(c: HFModelConfig) -> list[HFTensor]:
    """Every weight variable of the imported graph and its safetensors tensor."""
    if c.family == "t5":
        return _t5_map(c)
    s = hf_dim_sizes(c)
    out = []
    if c.family == "gpt2":
        D = c.d_model
        out += [_t("wte", "transformer.wte.weight", [["vocab"], ["d_model"]], s),
                _t("wpe", "transformer.wpe.weight", [["positions"], ["d_model"]], s)]
        for i in range(c.num_layers):
            p, v = f"transformer.h.{i}.", f"h{i}/"
            for ln in ("ln_1", "ln_2"):
                out += [_t(f"{v}{ln}/scale", f"{p}{ln}.weight", [["d_model"]], s),
                        _t(f"{v}{ln}/bias", f"{p}{ln}.bias", [["d_model"]], s)]
            for j, w in enumerate("qkv"):
                out += [_t(f"{v}attn/{w}", f"{p}attn.c_attn.weight", [["d_model"], ["heads", "d_kv"]], s,
                           (1, j * D), (D, 3 * D)),
                        _t(f"{v}attn/{w}_bias", f"{p}attn.c_attn.bias", [["heads", "d_kv"]], s, (0, j * D), (3 * D,))]
            out += [_t(f"{v}attn/o", f"{p}attn.c_proj.weight", [["heads", "d_kv"], ["d_model"]], s),
                    _t(f"{v}attn/o_bias", f"{p}attn.c_proj.bias", [["d_model"]], s),
                    _t(f"{v}mlp/wi", f"{p}mlp.c_fc.weight", [["d_model"], ["d_ff"]], s),
                    _t(f"{v}mlp/wi_bias", f"{p}mlp.c_fc.bias", [["d_ff"]], s),
                    _t(f"{v}mlp/wo", f"{p}mlp.c_proj.weight", [["d_ff"], ["d_model"]], s),
                    _t(f"{v}mlp/wo_bias", f"{p}mlp.c_proj.bias", [["d_model"]], s)]
        out += [_t("ln_f/scale", "transformer.ln_f.weight", [["d_model"]], s),
                _t("ln_f/bias", "transformer.ln_f.bias", [["d_model"]], s)]
    else:
        kv = "heads" if c.num_kv_heads == c.num_heads else "kv_heads"  # multi-head Llama: one heads dim
        out.append(_t("embed_tokens", "model.embed_tokens.weight", [["vocab"], ["d_model"]], s))
        for i in range(c.num_layers):
            p, v = f"model.layers.{i}.", f"layers{i}/"
            out += [_t(f"{v}input_layernorm/scale", f"{p}input_layernorm.weight", [["d_model"]], s),
                    _t(f"{v}attn/q", f"{p}self_attn.q_proj.weight", [["heads", "d_kv"], ["d_model"]], s),
                    _t(f"{v}attn/k", f"{p}self_attn.k_proj.weight", [[kv, "d_kv"], ["d_model"]], s),
                    _t(f"{v}attn/v", f"{p}self_attn.v_proj.weight", [[kv, "d_kv"], ["d_model"]], s),
                    _t(f"{v}attn/o", f"{p}self_attn.o_proj.weight", [["d_model"], ["heads", "d_kv"]], s),
                    _t(f"{v}post_attention_layernorm/scale", f"{p}post_attention_layernorm.weight", [["d_model"]], s),
                    _t(f"{v}mlp/gate", f"{p}mlp.gate_proj.weight", [["d_ff"], ["d_model"]], s),
                    _t(f"{v}mlp/up", f"{p}mlp.up_proj.weight", [["d_ff"], ["d_model"]], s),
                    _t(f"{v}mlp/down", f"{p}mlp.down_proj.weight", [["d_model"], ["d_ff"]], s)]
        out.append(_t("norm/scale", "model.norm.weight", [["d_model"]], s))
    if not c.tied:
        out.append(_t("lm_head", "lm_head.weight", [["vocab"], ["d_model"]], s))
    return out


def export_aliases(c: HFModelConfig) -> dict[str, tuple[str, ...]]:
    """Tensors written again under other names on export: T5's input embeddings (``transformers`` v5 loads an
    untied T5's ``{encoder,decoder}.embed_tokens.weight`` as tensors of their own; v4 ties them to ``shared``)."""
    if c.family == "t5":
        return {"shared.weight": ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}
    return {}


def tied_keys(c: HFModelConfig) -> tuple[str, ...]:
    """Keys a checkpoint may also hold, equal to a mapped tensor (a tied ``lm_head.weight``; T5's
    ``{encoder,decoder}.embed_tokens.weight``): ignored on import."""
    if c.family == "t5":  # the encoder's and decoder's views of ``shared.weight``
        return ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    return ("lm_head.weight",) if c.tied else ()


#: non-persistent buffers older ``transformers`` versions wrote into GPT-2 checkpoints (ignored on import)
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")

"""The Hugging Face model families meshtorch imports, one record each (plain data, no file IO, no graph).

A decoder-only family is a :class:`Family`: which ``config.json`` fields give the model's sizes
(:attr:`Family.fields`), which settings are refused (:attr:`Family.refuse`), the block options
(:class:`BlockOptions`: norm kind, learned or rotary positions, gated MLP and its activation, biases) and
the checkpoint's tensor names (:attr:`Family.names`: one template per variable role of the graph that
:func:`meshtorch.models.hf.build_hf_lm` builds from those options). One builder reads every record, so a
family that differs from another only in options (Qwen2 = Llama + q/k/v biases; Mistral = Llama with a
sliding window no longer than the context) is a record and nothing else. T5 (encoder-decoder) has a record
too, whose parser and map are :mod:`meshtorch.models.hf_config`'s.

:func:`parse_hf_config` turns a ``config.json`` dict into an :class:`~meshtorch.models.hf_config.HFModelConfig`;
:func:`hf_tensor_map` lists, for each variable, its safetensors tensor and how the variable's named dims sit
in it (``nn.Linear`` weights ``[out, in]``, GPT-2's ``Conv1D`` ``[in, out]``, tensors fused by sharing a name:
GPT-2's ``c_attn`` holds q, k and v side by side on its output axis).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from meshtorch.core.errors import CheckpointError
from meshtorch.models.hf_config import (
    HFModelConfig,
    HFTensor,
    hf_dim_sizes,
    need,
    parse_t5,
    refuse,
    rope_theta,
    t5_tensor_map,
)

__all__ = ["BlockOptions", "Family", "FAMILIES", "SUPPORTED_MODEL_TYPES", "parse_hf_config", "hf_tensor_map",
           "tied_keys", "zero_biases", "export_aliases", "architecture", "variable_dims", "BUFFER_SUFFIXES"]


@dataclass(frozen=True)
class BlockOptions:
    """How a pre-norm decoder block computes (the :class:`~meshtorch.models.hf_config.HFModelConfig` fields of
    the same names; :func:`meshtorch.models.hf.block_spec` turns them into the
    :class:`~meshtorch.models.blocks.BlockSpec` of the one block builder).

    ``norm``: ``layer`` (LayerNorm with bias) or ``rms``; ``positions``: ``learned`` (a position table added to
    the token embeddings) or ``rotary`` (RoPE on q and k); ``activation``: the MLP's
    (:func:`meshtorch.layers.dense_act_dense` names: ``gelu_tanh``, ``gelu``, ``silu``, ``relu``); ``gated``: GLU MLP
    (``act(gate) * up``); ``qkv_bias`` / ``o_bias`` / ``mlp_bias``: biases of the q/k/v, output and MLP
    projections.
    """

    norm: str = "rms"
    positions: str = "rotary"
    activation: str = "silu"
    gated: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False


@dataclass(frozen=True)
class Family:
    """One decoder-only Hugging Face family.

    Attributes:
        model_type / architecture: ``config.json``'s ``model_type`` and ``architectures[0]`` (written on export).
        block: the default :class:`BlockOptions`.
        fields: ``(HFModelConfig field, config.json key, default)``; a default None makes the key required, a
            callable default is called with the fields read so far.
        refuse: ``(config.json key, accepted values, why)``: any other value is refused by name.
        options: ``config.json`` key -> the :class:`BlockOptions` field it sets (``bool(value)``).
        extra: ``(cfg, where) -> dict`` of more HFModelConfig fields (GPT-2's activation, RoPE's theta, ...).
        names: variable role -> tensor name (``{i}``: layer index). Roles sharing a tensor name are fused
            along its output axis in the order given.
        linear: weights stored as ``nn.Linear`` ``[out, in]`` (False: ``Conv1D`` ``[in, out]``, GPT-2).
    """

    model_type: str
    architecture: str
    block: BlockOptions
    fields: tuple
    names: dict
    refuse: tuple = ()
    options: dict = field(default_factory=dict)
    extra: Callable | None = None
    linear: bool = True

    def parse(self, cfg: dict, where: str) -> HFModelConfig:
        """The :class:`HFModelConfig` of ``config.json`` dict ``cfg`` (``where`` names the file in errors).

        Raises:
            CheckpointError: naming ``where`` and the field: a missing size or a refused setting.
        """
        for key, ok, why in self.refuse:
            if key in cfg and cfg[key] not in ok:
                refuse(where, key, cfg[key], why)
        vals = {}
        for name, key, default in self.fields:
            if cfg.get(key) is not None:
                vals[name] = _TYPES.get(name, int)(cfg[key])
            elif default is None:
                need(cfg, key, where)
            else:
                vals[name] = default(vals) if callable(default) else default
        if vals["d_model"] % vals["num_heads"] and "d_kv" not in vals:
            refuse(where, self._key("num_heads"), vals["num_heads"], f"hidden size {vals['d_model']} is not a "
                   "multiple of it")
        vals.setdefault("d_kv", vals["d_model"] // vals["num_heads"])
        if vals["num_heads"] % vals["num_kv_heads"]:
            refuse(where, self._key("num_kv_heads"), vals["num_kv_heads"], f"the number of heads "
                   f"{vals['num_heads']} is not a multiple of it")
        block = replace(self.block, **{o: bool(cfg[k]) for k, o in self.options.items() if k in cfg})
        vals.update(block.__dict__)
        vals.update(self.extra(cfg, where) if self.extra else {})
        return HFModelConfig(family=self.model_type, hf_config=dict(cfg), **vals)

    def _key(self, name: str) -> str:
        return next(k for n, k, _ in self.fields if n == name)


def variable_dims(c: HFModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per variable role of :func:`meshtorch.models.hf.build_hf_lm`'s graph (``{i}``: layer), its dims as
    ``(input dims, output dims)`` of the projection (``layers.dense`` kernels are ``[in..., out...]``; biases,
    norm scales and tables have no input dims). Only the roles ``c``'s options create are listed."""
    kv = "heads" if c.num_kv_heads == c.num_heads else "kv_heads"
    out = {"embed": ((), ("vocab", "d_model"))}
    if c.positions == "learned":
        out["positions"] = ((), ("positions", "d_model"))
    norms = ("attn_norm", "mlp_norm")
    for n in norms:
        out[f"{n}/scale"] = ((), ("d_model",))
        if c.norm == "layer":
            out[f"{n}/bias"] = ((), ("d_model",))
    for w, heads in (("q", "heads"), ("k", kv), ("v", kv)):
        out[f"attn/{w}/kernel"] = (("d_model",), (heads, "d_kv"))
        if c.qkv_bias:
            out[f"attn/{w}/bias"] = ((), (heads, "d_kv"))
    out["attn/o/kernel"] = (("heads", "d_kv"), ("d_model",))
    if c.o_bias:
        out["attn/o/bias"] = ((), ("d_model",))
    for w in ("wi_gate", "wi") if c.gated else ("wi",):
        out[f"mlp/{w}/kernel"] = (("d_model",), ("d_ff",))
        if c.mlp_bias:
            out[f"mlp/{w}/bias"] = ((), ("d_ff",))
    out["mlp/wo/kernel"] = (("d_ff",), ("d_model",))
    if c.mlp_bias:
        out["mlp/wo/bias"] = ((), ("d_model",))
    out["final_norm/scale"] = ((), ("d_model",))
    if c.norm == "layer":
        out["final_norm/bias"] = ((), ("d_model",))
    if not c.tied:
        out["lm_head"] = ((), ("vocab", "d_model"))
    return out


_TABLES = ("embed", "positions", "lm_head")
_TYPES = {"norm_eps": float, "tied": bool}  # other fields are ints


def _layer_role(role: str) -> bool:
    return role.startswith(("attn", "mlp"))


def _decoder_map(fam: Family, c: HFModelConfig) -> list[HFTensor]:
    """``fam``'s tensors for every variable of ``c``'s graph: the family's name per role, axes from the role's dims
    (:func:`variable_dims`), fused tensors split at offsets on their output axis."""
    sizes = hf_dim_sizes(c)
    roles = variable_dims(c)
    out = []
    layer_roles = [r for r in roles if _layer_role(r)]
    top = [r for r in roles if not _layer_role(r)]
    entries = [(r, r, None) for r in top if r.startswith(("embed", "positions"))]
    entries += [(f"layers{i}/{r}", r, i) for i in range(c.num_layers) for r in layer_roles]
    entries += [(r, r, None) for r in top if not r.startswith(("embed", "positions"))]
    fused: dict[str, list] = {}
    for var, role, i in entries:
        if role not in fam.names:
            raise CheckpointError(f"hf: family {fam.model_type!r} has no tensor name for {role!r}.")
        key = fam.names[role].format(i=i)
        ins, outs = roles[role]
        if ins:  # a kernel: nn.Linear [out, in] or Conv1D [in, out]
            groups = (outs, ins) if fam.linear else (ins, outs)
        elif role in _TABLES:  # [vocab or positions, d_model]
            groups = tuple((n,) for n in outs)
        else:  # a bias or norm scale: one axis
            groups = (outs,)
        fused.setdefault(key, []).append((var, groups))
    for key, parts in fused.items():
        if len(parts) == 1:
            var, groups = parts[0]
            out.append(HFTensor(var, key, tuple(_size(g, sizes) for g in groups), groups))
            continue
        axis = 1 if not fam.linear and len(parts[0][1]) == 2 else 0  # the output axis
        total = sum(_size(g[axis], sizes) for _, g in parts)
        start = 0
        for var, groups in parts:
            shape = [_size(g, sizes) for g in groups]
            shape[axis] = total
            out.append(HFTensor(var, key, tuple(shape), groups, (axis, start)))
            start += _size(groups[axis], sizes)
    return out


def _size(group, sizes) -> int:
    n = 1
    for d in group:
        n *= sizes[d]
    return n


_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                     "silu": "silu"}


def _gpt2_extra(cfg: dict, where: str) -> dict:
    """GPT-2's activation; ``attention_bias: false`` (meshtorch's own key, see :func:`zero_biases`) drops the
    output projection's bias with q/k/v's, as Llama's does."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        refuse(where, "activation_function", act, f"meshtorch implements {sorted(_GPT2_ACTIVATIONS)}")
    return {"activation": _GPT2_ACTIVATIONS[act], "o_bias": bool(cfg.get("attention_bias", True))}


def _llama_extra(cfg: dict, where: str) -> dict:
    """RoPE's theta; Llama's ``attention_bias`` puts biases on q, k, v and o alike."""
    return {"rope_theta": rope_theta(cfg, where), "o_bias": bool(cfg.get("attention_bias", False))}


def _sliding(cfg: dict, where: str) -> dict:
    """Mistral's / Qwen2's ``sliding_window`` (0: none): refused later by ``with_shape`` when shorter than the
    context (no sliding-window attention here; a window at least the context long is full causal attention)."""
    used = cfg.get("use_sliding_window", True)  # Qwen2 gates it; Mistral always applies it
    window = cfg.get("sliding_window") if used else None
    return {"rope_theta": rope_theta(cfg, where), "sliding_window": int(window or 0)}


_H = "transformer.h.{i}."  # GPT-2's layer prefix
_GPT2_NAMES = {"embed": "transformer.wte.weight", "positions": "transformer.wpe.weight",
               "final_norm/scale": "transformer.ln_f.weight", "final_norm/bias": "transformer.ln_f.bias",
               "lm_head": "lm_head.weight"}
_GPT2_NAMES |= {f"{role}/{p}": _H + key + (".weight" if p in ("kernel", "scale") else ".bias")
                for role, key in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"), ("attn/q", "attn.c_attn"),
                                  ("attn/k", "attn.c_attn"), ("attn/v", "attn.c_attn"), ("attn/o", "attn.c_proj"),
                                  ("mlp/wi", "mlp.c_fc"), ("mlp/wo", "mlp.c_proj"))
                for p in (("scale", "bias") if role.endswith("norm") else ("kernel", "bias"))}

_GPT2 = Family(
    "gpt2", "GPT2LMHeadModel",
    BlockOptions(norm="layer", positions="learned", activation="gelu_tanh", gated=False, qkv_bias=True, o_bias=True,
                 mlp_bias=True),
    fields=(("vocab_size", "vocab_size", None), ("d_model", "n_embd", None), ("num_heads", "n_head", None),
            ("num_kv_heads", "n_head", None), ("d_ff", "n_inner", lambda v: 4 * v["d_model"]),
            ("num_layers", "n_layer", None), ("max_positions", "n_positions", None),
            ("norm_eps", "layer_norm_epsilon", 1e-5), ("tied", "tie_word_embeddings", True)),
    refuse=(("scale_attn_weights", (True,), "only True is implemented"),
            ("scale_attn_by_inverse_layer_idx", (False,), "only False is implemented"),
            ("add_cross_attention", (False,), "only False is implemented")),
    options={"attention_bias": "qkv_bias", "mlp_bias": "mlp_bias"}, extra=_gpt2_extra, linear=False,
    names=_GPT2_NAMES)

_L = "model.layers.{i}."  # Llama's layer prefix
_LLAMA_NAMES = {"embed": "model.embed_tokens.weight", "attn_norm/scale": _L + "input_layernorm.weight",
                "mlp_norm/scale": _L + "post_attention_layernorm.weight", "final_norm/scale": "model.norm.weight",
                "lm_head": "lm_head.weight"}
_LLAMA_NAMES |= {f"{role}/{p}": _L + key + (".weight" if p == "kernel" else ".bias")
                 for role, key in (("attn/q", "self_attn.q_proj"), ("attn/k", "self_attn.k_proj"),
                                   ("attn/v", "self_attn.v_proj"), ("attn/o", "self_attn.o_proj"),
                                   ("mlp/wi_gate", "mlp.gate_proj"), ("mlp/wi", "mlp.up_proj"),
                                   ("mlp/wo", "mlp.down_proj"))
                 for p in ("kernel", "bias")}

_LLAMA = Family(
    "llama", "LlamaForCausalLM", BlockOptions(),
    fields=(("vocab_size", "vocab_size", None), ("d_model", "hidden_size", None),
            ("num_heads", "num_attention_heads", None),
            ("num_kv_heads", "num_key_value_heads", lambda v: v["num_heads"]),
            ("d_kv", "head_dim", lambda v: v["d_model"] // v["num_heads"]), ("d_ff", "intermediate_size", None),
            ("num_layers", "num_hidden_layers", None), ("max_positions", "max_position_embeddings", 2048),
            ("norm_eps", "rms_norm_eps", 1e-6), ("tied", "tie_word_embeddings", False)),
    refuse=(("hidden_act", ("silu",), "only silu (SwiGLU) is implemented"),),
    options={"attention_bias": "qkv_bias", "mlp_bias": "mlp_bias"}, extra=_llama_extra, names=_LLAMA_NAMES)

#: Qwen2: Llama with biases on the q, k and v projections (always; no ``attention_bias`` field)
_QWEN2 = replace(_LLAMA, model_type="qwen2", architecture="Qwen2ForCausalLM", block=BlockOptions(qkv_bias=True),
                 options={}, extra=_sliding)
#: Mistral: Llama's architecture with a sliding attention window (refused when shorter than the context)
_MISTRAL = replace(_LLAMA, model_type="mistral", architecture="MistralForCausalLM", options={}, extra=_sliding)


@dataclass(frozen=True)
class _EncDec:
    """An encoder-decoder family (T5): its own parser and map in :mod:`meshtorch.models.hf_config`."""

    model_type: str
    architecture: str
    parse: Callable
    tensor_map: Callable


FAMILIES = {f.model_type: f for f in (_GPT2, _LLAMA, _QWEN2, _MISTRAL,
                                      _EncDec("t5", "T5ForConditionalGeneration", parse_t5, t5_tensor_map))}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

#: non-persistent buffers older ``transformers`` versions wrote into GPT-2 checkpoints (ignored on import)
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def parse_hf_config(cfg: dict, where: str = "config.json") -> HFModelConfig:
    """An :class:`HFModelConfig` from a Hugging Face ``config.json`` dict (``transformers``' ``GPT2Config``,
    ``LlamaConfig``, ``Qwen2Config``, ``MistralConfig``, ``T5Config``; v4 ``rope_theta`` / ``rope_scaling`` and v5
    ``rope_parameters`` spellings). Dropout probabilities are read but not applied.

    Raises:
        CheckpointError: naming ``where`` and the field: an unknown ``model_type``, a missing size, or a setting
            that changes the computation and is not implemented (GPT-2: cross attention,
            ``scale_attn_weights=False``, ``scale_attn_by_inverse_layer_idx``, an activation other than
            gelu_new/gelu; Llama family: scaled RoPE, ``hidden_act`` other than silu).
    """
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise CheckpointError(f"{where}: model_type {mt!r} is not supported; meshtorch imports "
                              f"{list(SUPPORTED_MODEL_TYPES)}.")
    return FAMILIES[mt].parse(cfg, where)


def hf_tensor_map(c: HFModelConfig) -> list[HFTensor]:
    """Every weight variable of the imported graph and its safetensors tensor."""
    fam = FAMILIES[c.family]
    return fam.tensor_map(c) if isinstance(fam, _EncDec) else _decoder_map(fam, c)


def architecture(c: HFModelConfig) -> str:
    """``config.json``'s ``architectures[0]`` for ``c``'s family (written on export)."""
    return FAMILIES[c.family].architecture


def export_aliases(c: HFModelConfig) -> dict[str, tuple[str, ...]]:
    """Tensors written again under other names on export: T5's input embeddings (``transformers`` v5 loads an
    untied T5's ``{encoder,decoder}.embed_tokens.weight`` as tensors of their own; v4 ties them to ``shared``)."""
    if c.encoder_decoder:
        return {"shared.weight": ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}
    return {}


def zero_biases(c: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """Bias tensors that ``c``'s family always has but ``c``'s graph lacks, as ``{tensor key: full shape}``.

    ``transformers``' GPT-2 has no switch for its biases; a GPT-2 that ``meshtorch export`` writes from a native
    LM (which has none) says ``"attention_bias": false, "mlp_bias": false`` in ``config.json`` (Llama's keys) and
    holds these tensors as zeros, so that ``transformers`` computes the same function and ``--init-from`` trains
    the same parameters as the native run. Written as zeros on export; on import they must be zero (else
    :func:`meshtorch.checkpoint.hf.load_hf_weights` refuses). Empty for every other config.
    """
    fam = FAMILIES[c.family]
    if isinstance(fam, _EncDec):
        return {}
    full = c.replace(qkv_bias=c.qkv_bias or fam.block.qkv_bias, o_bias=c.o_bias or fam.block.o_bias,
                     mlp_bias=c.mlp_bias or fam.block.mlp_bias)
    have = {t.key for t in _decoder_map(fam, c)}
    return {t.key: t.full_shape for t in _decoder_map(fam, full) if t.key not in have}


def tied_keys(c: HFModelConfig) -> tuple[str, ...]:
    """Keys a checkpoint may also hold, equal to a mapped tensor (a tied ``lm_head.weight``; T5's
    ``{encoder,decoder}.embed_tokens.weight``): ignored on import."""
    if c.encoder_decoder:  # the encoder's and decoder's views of ``shared.weight``
        return ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    return ("lm_head.weight",) if c.tied else ()

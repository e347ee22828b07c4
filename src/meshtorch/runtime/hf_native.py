"""A native (``meshtorch train`` without ``--init-from``) LM as a Hugging Face model: ``meshtorch export --hf``.

The native LM (:mod:`meshtorch.models.transformer`) has learned positions, pre-norm blocks with
bias-free projections, a dense feed-forward and an untied output layer. With ``--norm layer`` and an ungated
feed-forward that is GPT-2's computation (``GPT2LMHeadModel`` with ``tie_word_embeddings: false``, zero
biases, ``layer_norm_epsilon`` 1e-6, ``n_positions`` = the trained ``length``); :func:`gpt2_config_of` writes
that config or says in one line why there is none (RMSNorm with learned positions is neither GPT-2, which has
LayerNorm, nor Llama, which has rotary positions). :func:`copy_native_weights` moves the weights, variable by
variable, into the imported-model graph (:func:`meshtorch.models.hf.build_hf_lm`), which
:func:`meshtorch.checkpoint.hf.export` then writes.
"""

from __future__ import annotations

import os

from meshtorch.checkpoint import hf, latest_checkpoint, load_manifest, restore
from meshtorch.core.errors import CheckpointError
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.hf_families import parse_hf_config
from meshtorch.models.transformer import LMConfig, build_lm

__all__ = ["gpt2_config_of", "copy_native_weights", "native_config", "export_native"]

#: native feed-forward activations -> GPT-2's ``activation_function`` (transformers' ACT2FN names)
_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
_NORM_EPS = 1e-6  # layers.layer_norm's default, which the native LM uses


def _why_not(c: LMConfig) -> str | None:
    if c.pipelined:
        return f"it was trained as a {c.pipeline_stages}-stage pipeline (stacked block weights)"
    if c.num_experts:
        return f"it has Mixture-of-Experts layers (num_experts {c.num_experts})"
    if c.norm != "layer":
        return ("it has RMSNorm with learned positions (GPT-2 has LayerNorm, Llama rotary positions); train with "
                "--norm layer to get a GPT-2")
    if c.gated:
        return "its feed-forward is gated (--gated); GPT-2's is not, and Llama's gated one comes with rotary positions"
    if c.activation not in _ACTIVATIONS:
        return f"its activation {c.activation!r} is none of GPT-2's {sorted(_ACTIVATIONS)}"
    if c.num_heads * c.d_kv != c.d_model:
        return (f"heads x d_kv = {c.num_heads} x {c.d_kv} is not d_model {c.d_model} (GPT-2's head size is "
                "n_embd / n_head)")
    return None


def gpt2_config_of(c: LMConfig) -> HFModelConfig:
    """The GPT-2 :class:`HFModelConfig` computing native LM ``c`` (its padded vocabulary kept for the copy; export
    writes the real ``vocab_size`` rows).

    Raises:
        CheckpointError: one line naming why the LM has no Hugging Face family (a pipeline, MoE, RMSNorm, a gated
            feed-forward, an activation GPT-2 lacks, heads x d_kv != d_model).
    """
    why = _why_not(c)
    if why:
        raise CheckpointError(f"export --hf: this native LM maps to no Hugging Face family: {why}.")
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
           "n_embd": c.d_model, "n_head": c.num_heads, "n_layer": c.num_layers, "n_inner": c.d_ff,
           "n_positions": c.length, "layer_norm_epsilon": _NORM_EPS, "activation_function": _ACTIVATIONS[c.activation],
           "tie_word_embeddings": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
           "bos_token_id": None, "eos_token_id": None,
           "attention_bias": False, "mlp_bias": False}  # the native LM has no such biases (hf_families.zero_biases)
    return parse_hf_config(cfg, where="export --hf").replace(vocab_multiple=c.vocab_multiple)


def _names(c: LMConfig) -> dict[str, str]:
    """native variable -> imported-graph variable (``layers.dense`` kernels of both are ``[in..., out...]``)."""
    out = {"embedding": "embed", "pos_embedding": "positions", "logits/kernel": "lm_head"}
    for part in ("scale", "bias"):
        out[f"final_norm/{part}"] = f"final_norm/{part}"
        for i in range(c.num_layers):
            out[f"layer_{i}/attention_norm/{part}"] = f"layers{i}/attn_norm/{part}"
            out[f"layer_{i}/ffn_norm/{part}"] = f"layers{i}/mlp_norm/{part}"
    for i in range(c.num_layers):
        out |= {f"layer_{i}/attention/{w}": f"layers{i}/attn/{w}/kernel" for w in "qkvo"}
        out |= {f"layer_{i}/ffn/{w}/kernel": f"layers{i}/mlp/{w}/kernel" for w in ("wi", "wo")}
    return out


def copy_native_weights(native_lowering, native_lm, hf_lowering, hf_lm) -> list[str]:
    """Set every variable of the imported-model graph ``hf_lm`` (built from :func:`gpt2_config_of`) from the
    native lowering (a GPT-2 without the projections' biases, which the native LM lacks; export writes them as
    zeros). Returns the copied names.

    Raises:
        CheckpointError: naming the variable, if a native weight is missing or its dims do not match.
    """
    have = {v.name: v.outputs[0].shape for v in native_lm.graph.all_variables}
    want = {v.name: v.outputs[0].shape for v in hf_lm.graph.all_variables}
    rename = {"length": "positions"}  # the native position table's rows are the trained context
    done = []
    for src, dst in _names(native_lm.config).items():
        if src not in have:
            raise CheckpointError(f"export --hf: the native checkpoint has no variable {src!r}.")
        src_dims = [rename.get(d.name, d.name) for d in have[src]]
        dst_dims = [d.name for d in want[dst]]
        if sorted(src_dims) != sorted(dst_dims):
            raise CheckpointError(f"export --hf: variable {src!r} has dims {src_dims}, GPT-2's {dst!r} {dst_dims}.")
        value = native_lowering.variable_value(src).permute([src_dims.index(n) for n in dst_dims])
        hf_lowering.set_variable_value(dst, value.contiguous())
        done.append(dst)
    return done


def native_config(checkpoint_dir: str) -> LMConfig | None:
    """The :class:`LMConfig` of a native ``meshtorch train`` checkpoint (its newest, or the ``ckpt-<step>`` given),
    or None for anything else (a fine-tuning run of an imported model, a Hugging Face directory, no checkpoint)."""
    path = latest_checkpoint(checkpoint_dir) or checkpoint_dir
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        return None
    extra = load_manifest(path).get("extra") or {}
    return LMConfig(**extra["config"]) if "config" in extra and "hf_config" not in extra else None


def export_native(c: LMConfig, checkpoint_dir: str, impl, out_dir: str, max_shard_size: int) -> tuple[list, dict]:
    """Restore native checkpoint ``checkpoint_dir`` (model ``c``) on mesh implementation ``impl``, copy it into the
    GPT-2 graph and write ``out_dir`` (:func:`meshtorch.checkpoint.hf.export`); ``(files written, restore meta)``.

    Raises:
        CheckpointError: :func:`gpt2_config_of`'s refusal, before anything is restored.
    """
    hcfg = gpt2_config_of(c)
    native = build_lm(c, train=False)
    native_lw = native.lowering(mesh_impl=impl)
    meta = restore(native_lw, checkpoint_dir)
    model = hf.build(hcfg.with_shape(1, 1))
    lw = model.lowering(mesh_impl=impl)
    copy_native_weights(native_lw, native, lw, model)
    return hf.export(lw, model, out_dir, max_shard_size=max_shard_size), meta

"""The variable names meshtorch gave imported GPT-2 and Llama models before the one block builder (main 22cc587 and
earlier), so that checkpoints of ``--init-from`` runs written then still restore (:func:`legacy_names`).

Before, GPT-2's graph named its variables after ``transformers``' modules (``wte``, ``wpe``, ``h{i}/ln_1``,
``h{i}/attn/q`` with a separate ``h{i}/attn/q_bias``, ``ln_f``) and Llama's after its own (``embed_tokens``,
``layers{i}/input_layernorm``, ``layers{i}/mlp/gate|up|down``, ``norm``); the kernels had no ``/kernel`` suffix.
Now every family uses the roles of :func:`meshtorch.models.hf_families.variable_dims` (``embed``,
``layers{i}/attn_norm/scale``, ``layers{i}/attn/q/kernel``, ``final_norm/scale``, ...). The named dims of each
variable are unchanged (a checkpoint restore permutes dims saved in another order). Qwen2, Mistral and T5 had no
other names.
"""

from __future__ import annotations

from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.hf_families import variable_dims

__all__ = ["legacy_names"]


def _projections(pairs) -> dict[str, str]:
    """``attn/q/kernel`` → ``attn/q`` and ``attn/q/bias`` → ``attn/q_bias`` for each ``(new, old)`` projection."""
    out = {}
    for new, old in pairs:
        out[f"{new}/kernel"] = old
        out[f"{new}/bias"] = f"{old}_bias"
    return out


#: per family: (old prefix of layer ``{i}``'s variables, {new role: old role}); roles outside layers have no prefix
_OLD = {
    "gpt2": ("h{i}/", {"embed": "wte", "positions": "wpe", "lm_head": "lm_head",
                       "attn_norm/scale": "ln_1/scale", "attn_norm/bias": "ln_1/bias",
                       "mlp_norm/scale": "ln_2/scale", "mlp_norm/bias": "ln_2/bias",
                       "final_norm/scale": "ln_f/scale", "final_norm/bias": "ln_f/bias",
                       **_projections([(f"attn/{w}", f"attn/{w}") for w in "qkvo"]),
                       **_projections([("mlp/wi", "mlp/wi"), ("mlp/wo", "mlp/wo")])}),
    "llama": ("layers{i}/", {"embed": "embed_tokens", "lm_head": "lm_head",
                             "attn_norm/scale": "input_layernorm/scale",
                             "mlp_norm/scale": "post_attention_layernorm/scale", "final_norm/scale": "norm/scale",
                             **{f"attn/{w}/kernel": f"attn/{w}" for w in "qkvo"},
                             "mlp/wi_gate/kernel": "mlp/gate", "mlp/wi/kernel": "mlp/up", "mlp/wo/kernel": "mlp/down"}),
}


def legacy_names(c: HFModelConfig) -> dict[str, str]:
    """``{variable name of build_hf_lm's graph: its name in checkpoints of main 22cc587 and earlier}`` for ``c``'s
    family (empty for families that had no other names). Optimizer slots follow their variable (``{name}/adam_m``
    was ``{old}/adam_m``): :func:`meshtorch.checkpoint.restore.restore` maps those by prefix."""
    if c.family not in _OLD or c.encoder_decoder:
        return {}
    prefix, table = _OLD[c.family]
    out = {}
    for role in variable_dims(c):
        if role not in table:  # a role the old builder never made (e.g. Llama's biases): no old name
            continue
        if role.startswith(("attn", "mlp")):
            for i in range(c.num_layers):
                out[f"layers{i}/{role}"] = prefix.format(i=i) + table[role]
        else:
            out[role] = table[role]
    return out

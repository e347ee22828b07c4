"""The one block builder (meshtorch.models.blocks): the native LM built through it is the LM built with its own
former block (multi-head attention layer + dense_act_dense / moe_ffn, kept below as the reference) to the bit:
the same variables in the same order, initial values, loss, logits and gradients."""

import math
from dataclasses import replace

import pytest
import torch

import meshtorch as mtf
from meshtorch import layers
from meshtorch.models import transformer
from meshtorch.models.blocks import NATIVE_NAMES, BlockSpec, block
from meshtorch.models.transformer import LMConfig, build_lm
from meshtorch.ops.random import dropout
from meshtorch.ops.variables import zeros

CFG = LMConfig(vocab_size=30, vocab_multiple=4, d_model=16, num_heads=4, d_kv=4, d_ff=32, num_layers=2, length=8,
               batch_size=4)


def _former_block(c, d, x, name, train, aux_losses, moe=False, attend=None):
    """The native LM's block before the one block builder (main 996b397), verbatim in its arithmetic."""
    def drop(t):
        return dropout(t, rate=c.dropout) if train and c.dropout > 0 else t

    def norm(t, n):
        return layers.rms_norm(t, d["d_model"], name=n) if c.norm == "rms" else layers.layer_norm(t, d["d_model"],
                                                                                                   name=n)
    h = norm(x, f"{name}/attention_norm")
    h = layers.multihead_attention_layer(h, d["heads"], d["d_kv"], "length", causal=True,
                                         scale=1.0 / math.sqrt(c.d_kv), name=f"{name}/attention", attend=attend)
    x = x + drop(h)
    h = norm(x, f"{name}/ffn_norm")
    if moe:
        h, aux = layers.moe_ffn(h, d["experts"], d["d_ff"], capacity_factor=c.expert_capacity_factor,
                                top_k=c.moe_top_k, min_expert_capacity=c.moe_min_capacity,
                                activation=c.activation, name=f"{name}/moe")
        aux_losses.append(aux)
    else:
        h = layers.dense_act_dense(h, d["d_ff"], activation=c.activation, gated=c.gated, name=f"{name}/ffn")
    return x + drop(h)


def _run(c, mesh_shape, layout):
    lm = build_lm(c, seed=5)
    variables = lm.graph.trainable_variables
    grads = mtf.gradients([lm.loss], variables)
    lw = lm.lowering(mesh_shape, layout)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (c.batch_size, c.length + 1), generator=g)
    init = [lw.variable_value(v.name).clone() for v in variables]
    out = lw.run([lm.loss, lm.logits] + grads, feeds={lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})
    return [(v.name, v.outputs[0].shape) for v in variables], init, out


@pytest.mark.parametrize("c, mesh_shape, layout", [
    (CFG, "data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model"),
    (replace(CFG, norm="layer", activation="gelu", gated=True, dropout=0.1), "", ""),
    (replace(CFG, activation="silu", gated=True, remat="selective"), "all:2", "heads:all;d_ff:all"),
    (replace(CFG, num_experts=4, moe_every=2), "", ""),
    (replace(CFG, pipeline_stages=2, microbatches=2, dropout=0.1), "pipe:2", "stage:pipe"),
], ids=["rms_relu_2x2", "layer_geglu_dropout", "swiglu_selective_remat", "moe", "pipeline_dropout"])
def test_native_lm_is_bitwise_its_former_block(c, mesh_shape, layout, monkeypatch):
    names, init, out = _run(c, mesh_shape, layout)
    monkeypatch.setattr(transformer, "_block", _former_block)
    ref_names, ref_init, ref_out = _run(c, mesh_shape, layout)
    assert names == ref_names
    for (n, _), a, b in zip(names, init, ref_init, strict=True):
        assert torch.equal(a, b), f"initial value of {n}"
    for i, (a, b) in enumerate(zip(out, ref_out, strict=True)):
        assert torch.equal(a, b), f"output {i} (loss, logits, then the gradients of {[n for n, _ in names]})"


def test_block_spec_refuses_bad_options():
    with pytest.raises(ValueError, match="norm must be 'rms' or 'layer'"):
        BlockSpec(NATIVE_NAMES, norm="batch")
    with pytest.raises(ValueError, match="activation 'tanh' is not one of"):
        BlockSpec(NATIVE_NAMES, activation="tanh")
    lm = build_lm(CFG)
    d = transformer.dims(CFG)
    x = zeros(lm.mesh, [d["batch"], d["length"], d["d_model"]])
    with pytest.raises(ValueError, match="moe=True needs BlockSpec.moe"):
        block(x, d, BlockSpec(NATIVE_NAMES), "extra/", moe=True, aux_losses=[])

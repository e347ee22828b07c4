"""T5-style relative attention (``relative_attention_type`` "bias" / "bias_shared") in a Unitransformer.

Against a plain-PyTorch transcription of Mesh TF 0.1.21 (``_relative_position_bucket`` written out
scalar by scalar; ``relative_attention_bias`` ``[heads, buckets]`` gathered at the bucket of
``memory_position - query_position`` and added to the logits; no positional embedding), autoregressive
(one-sided buckets, causal) and not (two-sided buckets, full attention), under layouts.
"""

import math

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import rel_error
from meshtorch.transformer import transformer, transformer_layers
from test_transformer_port import DFF, DKV, B, D, H, L, V, _rms_norm

NB = 8  # buckets: with 8 positions both the exact and the logarithmic buckets are used
LAYOUTS = [("", ""), ("all:4", "heads:all;d_ff:all"), ("rows:2;cols:2", "batch:rows;heads:cols;vocab:cols")]


def bucket(rel, bidirectional, num_buckets, max_distance=128):
    ret, n = 0, -rel
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return ret + n
    return ret + min(exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact)),
                     num_buckets - 1)


def build(autoregressive, kind):
    graph = mtf.Graph(seed=4)
    mesh = mtf.Mesh(graph, "m")
    targets = mtf.placeholder(mesh, "targets", [mtf.Dimension("batch", B), mtf.Dimension("length", L)],
                              dtype=torch.int32)
    sa = {"num_heads": H, "key_value_size": DKV, "relative_attention_type": kind,
          "relative_attention_num_buckets": NB}
    model = transformer.Unitransformer(
        layer_stack=transformer.make_layer_stack([[transformer_layers.SelfAttention, sa],
                                                  [transformer_layers.DenseReluDense, {"hidden_size": DFF}]],
                                                 num_layers=2),
        d_model=D, input_vocab_size=V, output_vocab_size=V, autoregressive=autoregressive, max_length=L,
        shared_embedding_and_softmax_weights=True, positional_embedding=False, z_loss=0.0)
    inputs = transformer.autoregressive_inputs(targets) if autoregressive else targets
    logits, loss = model.call_simple(inputs, targets, True, mode="train")
    variables = graph.trainable_variables
    return graph, mesh, targets, logits, loss, variables, mtf.gradients([loss], [v.outputs[0] for v in variables])


def reference(p, targets, autoregressive, kind):
    inputs = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], 1) if autoregressive else targets
    ids = torch.tensor([[bucket(m - q, not autoregressive, NB) for m in range(L)] for q in range(L)])
    pos = torch.arange(L)
    causal = (pos[:, None] < pos[None, :]).to(torch.float64) * -1e9 if autoregressive else 0.0
    x = p["transformer/embedding"][inputs.long()]
    for b in range(2):
        att, ffn = f"transformer/block_{b:03d}/layer_000", f"transformer/block_{b:03d}/layer_001"
        owner = att if kind == "bias" else "transformer/block_000/layer_000"  # bias_shared: the first layer's
        table = p[f"{owner}/SelfAttention/relative_attention_bias"]
        h = _rms_norm(x, p[f"{att}/rms_norm/scale"])
        q, k, v = ((h @ p[f"{att}/SelfAttention/{n}"]).view(B, L, H, DKV) for n in "qkv")
        logits = torch.einsum("blhk,bmhk->bhlm", q, k) + table[:, ids] + causal
        o = torch.einsum("bhlm,bmhk->blhk", torch.softmax(logits, -1), v).reshape(B, L, H * DKV)
        x = x + o @ p[f"{att}/SelfAttention/o"]
        h = _rms_norm(x, p[f"{ffn}/rms_norm/scale"])
        x = x + torch.relu(h @ p[f"{ffn}/DenseReluDense/wi/kernel"]) @ p[f"{ffn}/DenseReluDense/wo/kernel"]
    logits = (_rms_norm(x, p["transformer/rms_norm/scale"]) * D ** -0.5) @ p["transformer/embedding"].T
    xent = torch.logsumexp(logits, -1) - logits.gather(-1, targets.long()[..., None])[..., 0]
    return logits, (xent * (targets > 0)).sum() / float(B * L)


def test_bucket_transcription_uses_log_buckets():
    assert sorted({bucket(-d, False, NB) for d in range(L)}) == [0, 1, 2, 3, 4]  # 4..7 share log bucket 4
    assert sorted({bucket(d, True, NB) for d in range(-L + 1, L)}) == [0, 1, 2, 5, 6]  # memory after query: +4


@pytest.mark.parametrize("autoregressive,kind", [(True, "bias_shared"), (False, "bias")])
def test_relative_attention_matches_the_mesh_tf_transcription(autoregressive, kind):
    t = torch.randint(1, V, (B, L), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    for mesh_shape, layout in LAYOUTS:
        graph, mesh, targets, logits, loss, variables, grads = build(autoregressive, kind)
        rel = {v.name: [d.name for d in v.shape] for v in variables if "relative" in v.name}
        want = ["transformer/block_000/layer_000/SelfAttention/relative_attention_bias"]
        if kind == "bias":
            want.append("transformer/block_001/layer_000/SelfAttention/relative_attention_bias")
        assert rel == {n: ["heads", "buckets"] for n in want}
        assert not any("positional_embedding" in v.name for v in variables)
        lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        out = lw.run([logits, loss] + grads, feeds={targets: t})
        params = {v.name: lw.variable_value(v.name).to(torch.float64).requires_grad_(True) for v in variables}
        ref_logits, ref_loss = reference(params, t, autoregressive, kind)
        ref_grads = torch.autograd.grad(ref_loss, list(params.values()))
        assert rel_error(out[0], ref_logits) <= 1e-5 and rel_error(out[1], ref_loss) <= 1e-5, layout
        for v, g, r in zip(variables, out[2:], ref_grads, strict=True):
            assert r.abs().max() > 0 and rel_error(g, r) <= 1e-5, f"{layout}: gradient of {v.name}"

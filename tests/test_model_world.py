"""One model world: the attention, dense / feed-forward and decoding code that the CLI's LM, the Hugging Face
models, ``mtf.layers`` and the ``mtf.transformer`` port share, vs plain PyTorch on full tensors under 1-D and
2-D layouts (the fused op and the einsum/softmax composite of ``layers.attention.attention``), and which of
the two each caller gets."""

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.layers import attention as attention_lib
from meshtorch.layers.attention import AttentionOperation
from meshtorch.testing import OpCase, rel_error
from meshtorch.transformer import attention as port_attention
from meshtorch.transformer import transformer, transformer_layers

G = torch.Generator().manual_seed(5)


def _t(*shape):
    return torch.randn(*shape, generator=G)


_Q, _K, _V = _t(2, 4, 8, 8), _t(2, 4, 6, 8), _t(2, 4, 6, 8)  # [b:2, h:4, l:8 / m:6, k:8]
_KS, _VS = _t(2, 4, 8, 8), _t(2, 4, 8, 8)  # m:8 (causal needs equal lengths)
_KMQ, _VMQ = _t(2, 6, 8), _t(2, 6, 8)  # multi-query: [b, m, k], no heads
_Q1 = _t(2, 4, 8)  # one decoding step: [b, h, k], no length
_BIAS = _t(4, 8, 6)  # [h, l, m]
Q, K, V = "b:2,h:4,l:8,k:8", "b:2,h:4,m:6,k:8", "b:2,h:4,m:6,k:8"
ATT = attention_lib.attention


def _ref(q, k, v, scale=1.0, bias=None, extra=None, causal=False):
    logits = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        logits = logits + bias
    if causal:
        logits = logits + torch.full(logits.shape[-2:], -1e9).triu(1)
    if extra is not None:  # softmax with an extra logit in the normaliser
        m = logits.amax(-1, keepdim=True).clamp_min(extra)
        e = (logits - m).exp()
        return (e / (e.sum(-1, keepdim=True) + torch.exp(extra - m))) @ v
    return torch.softmax(logits, -1) @ v


OP_CASES = [
    OpCase("attention_fused_bias_no_scale",
           lambda m, q, k, v, b: ATT(q, k, v, "m", "k", bias=b, scale=1.0),
           {"q": (Q, _Q), "k": (K, _K), "v": (V, _V), "b": ("h:4,l:8,m:6", _BIAS)},
           lambda q, k, v, b: _ref(q, k, v, bias=b)),
    OpCase("attention_composite_log_z",
           lambda m, q, k, v: list(ATT(q, k, v, "m", "k", scale=0.5, return_log_z=True)),
           {"q": (Q, _Q), "k": (K, _K), "v": (V, _V)},
           lambda q, k, v: [_ref(q, k, v, 0.5), torch.logsumexp(q @ k.transpose(-1, -2) * 0.5, -1)]),
    OpCase("attention_composite_causal_bias",
           lambda m, q, k, v, b: list(ATT(q, k, v, "m", "k", bias=b, causal=True, length_dim="l",
                                          return_log_z=True))[0],
           {"q": (Q, _Q), "k": ("b:2,h:4,m:8,k:8", _KS), "v": ("b:2,h:4,m:8,k:8", _VS),
            "b": ("h:4,l:8,m:8", _t(4, 8, 8))},
           lambda q, k, v, b: _ref(q, k, v, 8 ** -0.5, bias=b, causal=True)),
    OpCase("attention_composite_extra_logit",
           lambda m, q, k, v: ATT(q, k, v, "m", "k", scale=1.0, extra_logit=0.0),
           {"q": (Q, _Q), "k": (K, _K), "v": (V, _V)},
           lambda q, k, v: _ref(q, k, v, extra=torch.tensor(0.0))),
    OpCase("attention_composite_multi_query",
           lambda m, q, k, v: ATT(q, k, v, "m", "k", scale=1.0),
           {"q": (Q, _Q), "k": ("b:2,m:6,k:8", _KMQ), "v": ("b:2,m:6,k:8", _VMQ)},
           lambda q, k, v: _ref(q, k[:, None], v[:, None])),
    OpCase("attention_composite_one_decoding_step",
           lambda m, q, k, v: ATT(q, k, v, "m", "k", scale=1.0),
           {"q": ("b:2,h:4,k:8", _Q1), "k": (K, _K), "v": (V, _V)},
           lambda q, k, v: _ref(q[:, :, None], k, v)[:, :, 0]),
    OpCase("port_attention_extra_logit",
           lambda m, q, k, v: port_attention.attention(q, k, v, mtf.Dimension("m", 6), mtf.Dimension("k", 8),
                                                       mtf.Dimension("k", 8), extra_logit=0.0),
           {"q": (Q, _Q), "k": (K, _K), "v": (V, _V)},
           lambda q, k, v: _ref(q, k, v, extra=torch.tensor(0.0))),
]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.name)
def test_layout_invariance(case):
    case.check()


def _graph_ops(build, shapes):
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    build(*[mtf.placeholder(mesh, f"in{i}", s) for i, s in enumerate(shapes)])
    return g.operations


@pytest.mark.parametrize("kwargs,fused", [({}, True), ({"dropout_rate": 0.1}, False), ({"extra_logit": 0.0}, False),
                                         ({"return_log_z": True}, False), ({"float32_logits": True}, True)])
def test_attention_takes_the_fused_op_unless_the_call_needs_the_composite(kwargs, fused):
    ops = _graph_ops(lambda q, k, v: ATT(q, k, v, "m", "k", **kwargs), [Q, K, V])
    assert any(isinstance(op, AttentionOperation) for op in ops) == fused


def test_mtf_layers_and_port_attention_run_the_native_fused_op():
    """mtf.layers.dot_product_attention and the port's attention (no dropout, no z-loss) are the same op as the
    CLI LM's multihead_attention_layer; Mesh TF's unscaled logits become scale 1."""
    for build in (lambda q, k, v: mtf.layers.dot_product_attention(q, k, v, None, False),
                  lambda q, k, v: port_attention.attention(q, k, v, mtf.Dimension("m", 6), mtf.Dimension("k", 8),
                                                           mtf.Dimension("k", 8))):
        ops = [op for op in _graph_ops(build, ["b:2,h:4,l:8,k:8", K, V]) if isinstance(op, AttentionOperation)]
        assert len(ops) == 1 and ops[0].spec.scale == 1.0


def _run(g, mesh, outs, feeds, mesh_shape="", layout=""):
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    return lw, lw.run(outs, feeds=feeds)


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:2", "o:all"), ("r:2;c:2", "b:r;o:c")])
def test_scoped_dense_is_dense_with_mesh_tf_names_and_reuse(mesh_shape, layout):
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    x = mtf.placeholder(mesh, "x", "b:4,i:6")
    out = mtf.Dimension("o", 4)
    with mtf.variable_scope("enc"):
        y1 = mtf.layers.scoped_dense(x, out, name="wi")
    with mtf.variable_scope("enc"):
        y2 = mtf.layers.scoped_dense(x, out, name="wi", activation=mtf.relu)  # the same variables again
    y3, y4 = mtf.layers.dense(x, out, name="wi"), mtf.layers.dense(x, out, name="wi")  # graph-unique names
    names = sorted(v.name for v in g.trainable_variables)
    assert names == ["enc/wi/bias", "enc/wi/kernel", "wi/bias", "wi/kernel", "wi_1/bias", "wi_1/kernel"]
    xv = _t(4, 6)
    lw, (a, b, c, d) = _run(g, mesh, [y1, y2, y3, y4], {x: xv}, mesh_shape, layout)
    w = lw.variable_value("enc/wi/kernel")
    assert rel_error(a, xv @ w) < 1e-6 and rel_error(b, torch.relu(xv @ w)) < 1e-6
    assert rel_error(c, xv @ lw.variable_value("wi/kernel")) < 1e-6
    assert rel_error(d, xv @ lw.variable_value("wi_1/kernel")) < 1e-6
    assert lw.variable_value("enc/wi/kernel").std() == pytest.approx(6 ** -0.5, rel=0.5)  # fan-in variance scaling


@pytest.mark.parametrize("gated", [False, True])
def test_feed_forward_serves_the_cli_lm_and_the_port_names(gated):
    """dense_act_dense (CLI LM names) and the port's DenseReluDense names (scoped ``wi_0``/``wi_1``, ``wo``) run
    the one feed_forward; both equal the plain-PyTorch formula."""
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    x = mtf.placeholder(mesh, "x", "b:4,d_model:6")
    ff = mtf.Dimension("d_ff", 8)
    y = mtf.layers.dense_act_dense(x, ff, activation="gelu", gated=gated, name="ffn")
    factors = [("wi_0", "gelu"), ("wi_1", "linear")] if gated else [("wi", "gelu")]
    with mtf.variable_scope("DenseReluDense"):
        z = mtf.layers.feed_forward(x, ff, factors, "wo", dense_fn=mtf.layers.scoped_dense)
    xv = _t(4, 6)
    lw, (a, b) = _run(g, mesh, [y, z], {x: xv}, "all:2", "d_ff:all")
    v = lw.variable_value
    h = F.gelu(xv @ v("ffn/wi_gate/kernel")) * (xv @ v("ffn/wi/kernel")) if gated else F.gelu(xv @ v("ffn/wi/kernel"))
    assert rel_error(a, h @ v("ffn/wo/kernel")) < 1e-5
    p = "DenseReluDense/"
    h = (F.gelu(xv @ v(p + "wi_0/kernel")) * (xv @ v(p + "wi_1/kernel")) if gated
         else F.gelu(xv @ v(p + "wi/kernel")))
    assert rel_error(b, h @ v(p + "wo/kernel")) < 1e-5


def test_greedy_decode_and_sample_autoregressive_run_the_one_decode_loop(monkeypatch):
    """Both in-graph decoders go through mtf.beam_search.decode_loop (counted), and greedy_decode's ids are
    the argmax continuation a plain-PyTorch loop gives for the same logits function."""
    calls = []
    real = mtf.beam_search.decode_loop

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mtf.beam_search, "decode_loop", counting)
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    length, vocab = mtf.Dimension("length", 5), mtf.Dimension("vocab", 7)
    table = _t(7, 7)
    t = mtf.import_tensor(mesh, table, ["prev:7", vocab])

    def logits_fn(step, ids, states):  # logits = table[previous id] (id 0 before the first step)
        prev = mtf.gather(ids, mtf.maximum(step - 1, 0), length)
        return mtf.gather(t, prev, mtf.Dimension("prev", 7)), states

    ids = mtf.zeros(mesh, ["batch:2", length], dtype=torch.int32)
    out = mtf.beam_search.greedy_decode(logits_fn, ids, eos_id=-1)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    got = lw.run([out])[0]
    want, prev = [], 0
    for _ in range(5):
        prev = int(table[prev].argmax())
        want.append(prev)
    assert got.tolist() == [want, want] and calls == [1]
    g = mtf.Graph(seed=3)  # the port's sampler: the same loop; its first pass fused, its steps the composite
    mesh = mtf.Mesh(g, "m")
    ids = mtf.placeholder(mesh, "ids", ["batch:2", "length:4"], dtype=torch.int32)
    model = transformer.Unitransformer(
        layer_stack=transformer.make_layer_stack(
            [[transformer_layers.SelfAttention, {"num_heads": 2, "key_value_size": 4}],
             [transformer_layers.DenseReluDense, {"hidden_size": 8}]], num_layers=1),
        d_model=8, input_vocab_size=11, output_vocab_size=11, autoregressive=True, max_length=4)
    model.sample_autoregressive(ids)
    assert calls == [1, 1]
    assert sum(isinstance(op, AttentionOperation) for op in g.operations) == 1  # the first_part call

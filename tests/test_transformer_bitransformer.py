"""A Mesh TF ``Bitransformer`` (encoder-decoder) built through ``meshtorch.transformer`` as Mesh TF users build it.

Variable names written from Mesh TF 0.1.21's naming scheme; logits, loss and gradients against a
plain-PyTorch (float64) transcription of ``Bitransformer.call_simple`` under four layouts,
including padding in the inputs and the targets (sequence ids ``minimum(ids, 1)``: padding masked
in attention, zeroed by ``sublayer_mask_padding``, excluded from the loss).
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import rel_error
from meshtorch.transformer import transformer, transformer_layers
from test_transformer_beam import BEAM, mesh_tf_beam_search

B, LIN, LOUT, D, H, DKV, DFF, V, MAXLEN = 4, 8, 6, 32, 4, 8, 64, 128, 16
LAYOUTS = [("", ""), ("all:4", "batch:all"), ("all:4", "heads:all;d_ff:all"),
           ("rows:2;cols:2", "batch:rows;heads:cols;d_ff:cols;vocab:cols")]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _attention_layer(name):
    return [name, {"num_heads": H, "key_value_size": DKV}]


def build(decode=False, beam_size=1):
    graph = mtf.Graph(seed=5)
    mesh = mtf.Mesh(graph, "my_mesh")
    batch = mtf.Dimension("batch", B)
    inputs = mtf.placeholder(mesh, "inputs", [batch, mtf.Dimension("length", LIN)], dtype=torch.int32)
    targets = mtf.placeholder(mesh, "targets", [batch, mtf.Dimension("length", LOUT)], dtype=torch.int32)
    sa = [transformer_layers.SelfAttention, {"num_heads": H, "key_value_size": DKV}]
    ed = [transformer_layers.EncDecAttention, {"num_heads": H, "key_value_size": DKV}]
    ff = [transformer_layers.DenseReluDense, {"hidden_size": DFF}]
    encoder = transformer.Unitransformer(
        layer_stack=transformer.make_layer_stack([sa, ff], num_layers=2), d_model=D, input_vocab_size=V,
        output_vocab_size=None, autoregressive=False, max_length=MAXLEN, name="encoder")
    decoder = transformer.Unitransformer(
        layer_stack=transformer.make_layer_stack([sa, ed, ff], num_layers=2), d_model=D, input_vocab_size=V,
        output_vocab_size=V, autoregressive=True, max_length=MAXLEN, name="decoder", z_loss=1e-4)
    model = transformer.Bitransformer(encoder, decoder)
    if decode:
        return graph, mesh, inputs, model.decode(inputs, beam_size=beam_size)
    logits, loss = model.call_simple(inputs, targets, compute_loss=True, mode="train")
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    return graph, mesh, inputs, targets, logits, loss, variables, grads


def expected_variables():
    """shared/ embedding tables (Bitransformer._shared_params), then encoder/ and decoder/ stacks; the decoder
    (shared_embedding_and_softmax_weights=False, Mesh TF's code default) has ``logits/kernel``."""
    out = {"shared/embedding": [("vocab", V), ("d_model", D)],
           "shared/positional_embedding": [("max_length", MAXLEN), ("d_model", D)]}
    att = {p: [("d_model", D), ("heads", H * DKV)] for p in "qkv"} | {"o": [("heads", H * DKV), ("d_model", D)]}
    for stack, kinds in (("encoder", ["SelfAttention", "DenseReluDense"]),
                         ("decoder", ["SelfAttention", "EncDecAttention", "DenseReluDense"])):
        for b in range(2):
            for n, kind in enumerate(kinds):
                pre = f"{stack}/block_{b:03d}/layer_{n:03d}"
                out[f"{pre}/rms_norm/scale"] = [("d_model", D)]
                if kind == "DenseReluDense":
                    out[f"{pre}/{kind}/wi/kernel"] = [("d_model", D), ("d_ff", DFF)]
                    out[f"{pre}/{kind}/wo/kernel"] = [("d_ff", DFF), ("d_model", D)]
                else:
                    out.update({f"{pre}/{kind}/{p}": s for p, s in att.items()})
        out[f"{stack}/rms_norm/scale"] = [("d_model", D)]
    out["decoder/logits/kernel"] = [("d_model", D), ("vocab", V)]
    return out


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, V, (B, LIN), generator=g, dtype=torch.int32)
    y = torch.randint(1, V, (B, LOUT), generator=g, dtype=torch.int32)
    x[0, 5:] = 0
    x[2, 3:] = 0
    y[1, 4:] = 0
    return x, y


# ---- reference: Mesh TF's Bitransformer.call_simple in plain PyTorch -------------------------------------------------

def _rms(x, s):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * s


def _attend(p, pre, x, mem, visible):
    """AttentionParams (combined heads) + attention (no scale) with a [b, l, m] visibility -> -1e9 bias."""
    b, n, m = x.shape[0], x.shape[1], mem.shape[1]
    q = (x @ p[f"{pre}/q"]).view(b, n, H, DKV)
    k = (mem @ p[f"{pre}/k"]).view(b, m, H, DKV)
    v = (mem @ p[f"{pre}/v"]).view(b, m, H, DKV)
    logits = torch.einsum("blhk,bmhk->blhm", q, k) + (~visible).to(x.dtype)[:, :, None, :] * -1e9
    o = torch.einsum("blhm,bmhk->blhk", torch.softmax(logits, -1), v).reshape(b, n, H * DKV)
    return o @ p[f"{pre}/o"]


def reference(p, x_ids, y_ids, dec_seq=None):
    """Logits and loss; ``dec_seq`` overrides the decoder's sequence ids (decoding passes sequence_id=1)."""
    enc_seq = x_ids.clamp(max=1)  # minimum(ids, 1)
    dec_seq = y_ids.clamp(max=1) if dec_seq is None else dec_seq
    enc_np, dec_np = (enc_seq != 0).to(torch.float64)[..., None], (dec_seq != 0).to(torch.float64)[..., None]
    # encoder: not autoregressive; same-sequence visibility; sublayer_mask_padding before each layer and at the end
    x = p["shared/embedding"][x_ids.long()] + p["shared/positional_embedding"][:LIN]
    vis = enc_seq[:, :, None] == enc_seq[:, None, :]
    for b in range(2):
        pre = f"encoder/block_{b:03d}"
        h = _rms(x, p[f"{pre}/layer_000/rms_norm/scale"]) * enc_np
        x = x + _attend(p, f"{pre}/layer_000/SelfAttention", h, h, vis)
        h = _rms(x, p[f"{pre}/layer_001/rms_norm/scale"]) * enc_np
        x = x + torch.relu(h @ p[f"{pre}/layer_001/DenseReluDense/wi/kernel"]) @ \
            p[f"{pre}/layer_001/DenseReluDense/wo/kernel"]
    mem = _rms(x, p["encoder/rms_norm/scale"]) * enc_np
    # decoder: autoregressive_inputs(targets, sequence_id); causal + same-sequence; enc-dec sees equal ids
    prev_seq = torch.cat([torch.zeros_like(dec_seq[:, :1]), dec_seq[:, :-1]], 1)
    shifted = torch.cat([torch.zeros_like(y_ids[:, :1]), y_ids[:, :-1]], 1).abs()
    dec_in = shifted * (dec_seq == prev_seq).to(shifted.dtype)
    y = p["shared/embedding"][dec_in.long()] + p["shared/positional_embedding"][:y_ids.shape[1]]
    pos = torch.arange(y_ids.shape[1])
    self_vis = (pos[:, None] >= pos[None, :])[None] & (dec_seq[:, :, None] == dec_seq[:, None, :])
    cross_vis = dec_seq[:, :, None] == enc_seq[:, None, :]
    for b in range(2):
        pre = f"decoder/block_{b:03d}"
        h = _rms(y, p[f"{pre}/layer_000/rms_norm/scale"]) * dec_np
        y = y + _attend(p, f"{pre}/layer_000/SelfAttention", h, h, self_vis)
        h = _rms(y, p[f"{pre}/layer_001/rms_norm/scale"]) * dec_np
        y = y + _attend(p, f"{pre}/layer_001/EncDecAttention", h, mem, cross_vis)
        h = _rms(y, p[f"{pre}/layer_002/rms_norm/scale"]) * dec_np
        y = y + torch.relu(h @ p[f"{pre}/layer_002/DenseReluDense/wi/kernel"]) @ \
            p[f"{pre}/layer_002/DenseReluDense/wo/kernel"]
    y = _rms(y, p["decoder/rms_norm/scale"]) * dec_np
    logits = y @ p["decoder/logits/kernel"]
    log_z = torch.logsumexp(logits, -1)
    xent = -((logits - log_z[..., None]) * torch.nn.functional.one_hot(y_ids.long(), V)).sum(-1) + 1e-4 * log_z ** 2
    return logits, (xent * (y_ids > 0)).sum() / float(B * LOUT)


def test_variable_names_and_shapes_are_mesh_tf_s():
    graph, *_ = build()
    assert {v.name: [(d.name, d.size) for d in v.shape] for v in graph.all_variables} == expected_variables()


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_forward_loss_and_gradients_match_the_mesh_tf_transcription(mesh_shape, layout):
    graph, mesh, inputs, targets, logits, loss, variables, grads = build()
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    x, y = data()
    out = lw.run([logits, loss] + grads, feeds={inputs: x, targets: y})
    params = {v.name: lw.variable_value(v.name).to(torch.float64).requires_grad_(True) for v in variables}
    ref_logits, ref_loss = reference(params, x, y)
    ref_grads = torch.autograd.grad(ref_loss, list(params.values()))
    assert rel_error(out[0], ref_logits) <= 1e-5
    assert rel_error(out[1], ref_loss) <= 1e-5
    assert 3.0 < ref_loss.item() < 8.0
    for v, g, r in zip(variables, out[2:], ref_grads, strict=True):
        assert r.abs().max() > 0, f"{v.name}: no gradient in the reference"
        assert rel_error(g, r) <= 1e-5, f"{mesh_shape} {layout}: gradient of {v.name}"


@pytest.mark.parametrize("mesh_shape,layout", [LAYOUTS[0], LAYOUTS[3]])
def test_greedy_decode_matches_mesh_tf_s_loop(mesh_shape, layout):
    """Bitransformer.decode: encoder once, then the decoder's while loop (stop_at_token=1, sequence_id=1)."""
    graph, mesh, inputs, decoded = build(decode=True)
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    x, _ = data()
    got = lw.run([decoded], feeds={inputs: x})[0]
    params = {n: lw.variable_value(n).to(torch.float64) for n in lw.variable_names}
    ids = torch.zeros(B, LIN, dtype=torch.int32)  # the decoded length is the input length (max_decode_length=None)
    for pos in range(LIN):
        if bool(((ids == 1).sum(1) > 0).all()):
            break
        logits = reference(params, x, ids, dec_seq=torch.ones(B, LIN, dtype=torch.int32))[0]
        ids[:, pos] = logits[:, pos].argmax(-1)
    assert torch.equal(got, ids)
    assert len(set(ids.flatten().tolist())) >= 4


def test_beam_search_decode_matches_mesh_tf_s_algorithm():
    """decode(beam_size=3): Mesh TF's beam search (test_transformer_beam's transcription) over the twin decoder."""
    graph, mesh, inputs, decoded = build(decode=True, beam_size=BEAM)
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(*LAYOUTS[3])})
    x, _ = data()
    got = lw.run([decoded], feeds={inputs: x})[0]
    params = {n: lw.variable_value(n).to(torch.float64) for n in lw.variable_names}
    xb = x.repeat_interleave(BEAM, 0)

    def logits_at(ids, i):
        return reference(params, xb, ids, dec_seq=torch.ones_like(ids))[0][:, i]
    want = mesh_tf_beam_search(logits_at, B)
    assert torch.equal(got, want.to(got.dtype))
    assert len({tuple(r) for r in want.tolist()}) >= 3  # the sequences differ with their inputs

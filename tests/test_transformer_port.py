"""A Mesh TF ``Unitransformer`` LM built through ``meshtorch.transformer``, as a Mesh TF user writes it.

Checked against Mesh TF 0.1.21's source (``transformer/transformer.py``, ``transformer_layers.py``,
``attention.py``, ``layers.py``, ``optimize.py``): the variable names and shapes are written out from
its naming scheme; the loss, logits and gradients come from a plain-PyTorch transcription of its
computation (float64) under four layouts; three ``AdafactorOptimizer()`` updates from a
transcription of its ``apply_grad``.
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import rel_error
from meshtorch.transformer import transformer, transformer_layers

B, L, D, H, DKV, DFF, V, MAXLEN = 4, 8, 64, 4, 16, 256, 256, 16
Z_LOSS = 1e-4
LAYOUTS = [("", ""), ("all:4", "batch:all"), ("all:4", "heads:all;d_ff:all"),
           ("rows:2;cols:2", "batch:rows;heads:cols;d_ff:cols;vocab:cols"),
           ("rows:2,cols:2", "batch:rows,d_ff:cols,heads:cols,vocab:cols")]  # layout_data_and_model_parallel.gin's


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def expected_variables():
    """Mesh TF's names: Unitransformer scope ``transformer``; make_layer_stack's ``block_{b:03d}/layer_{n:03d}``;
    sublayer_rms_norm's ``rms_norm/scale``; sublayer_call_layer's class-name scope; AttentionParams' ``q k v o``
    with the combined ``heads`` dim (heads x d_kv = 64); dense's ``wi/kernel`` ``wo/kernel``; the final rms_norm;
    VocabEmbedding ``embedding`` [vocab, d_model] and ``positional_embedding`` [max_length, d_model]; no logits
    kernel (shared embedding and softmax)."""
    out = {"transformer/embedding": [("vocab", V), ("d_model", D)],
           "transformer/positional_embedding": [("max_length", MAXLEN), ("d_model", D)]}
    for b in range(2):
        att, ffn = f"transformer/block_{b:03d}/layer_000", f"transformer/block_{b:03d}/layer_001"
        out[f"{att}/rms_norm/scale"] = [("d_model", D)]
        for p in "qkv":
            out[f"{att}/SelfAttention/{p}"] = [("d_model", D), ("heads", H * DKV)]
        out[f"{att}/SelfAttention/o"] = [("heads", H * DKV), ("d_model", D)]
        out[f"{ffn}/rms_norm/scale"] = [("d_model", D)]
        out[f"{ffn}/DenseReluDense/wi/kernel"] = [("d_model", D), ("d_ff", DFF)]
        out[f"{ffn}/DenseReluDense/wo/kernel"] = [("d_ff", DFF), ("d_model", D)]
    out["transformer/rms_norm/scale"] = [("d_model", D)]
    return out


def build(optimizer=None, variable_dtype=None, layer_stack_kwargs=None, mode="train", **unitransformer_kwargs):
    """The LM exactly as a mesh_tensorflow.transformer user builds it (gin bindings as arguments)."""
    graph = mtf.Graph(seed=3)
    mesh = mtf.Mesh(graph, "my_mesh")
    batch_dim, length_dim = mtf.Dimension("batch", B), mtf.Dimension("length", L)
    targets = mtf.placeholder(mesh, "targets", [batch_dim, length_dim], dtype=torch.int32)
    layer_stack = transformer.make_layer_stack(
        layers=[[transformer_layers.SelfAttention, {"num_heads": H, "key_value_size": DKV}],
                [transformer_layers.DenseReluDense, {"hidden_size": DFF}]],
        num_layers=2)
    if layer_stack_kwargs:  # other sublayers: a LayerStack over the same layers
        layer_stack = transformer.LayerStack(layer_stack.layers, **layer_stack_kwargs)
    model = transformer.Unitransformer(
        layer_stack=layer_stack, d_model=D, input_vocab_size=V, output_vocab_size=V, autoregressive=True,
        max_length=MAXLEN, shared_embedding_and_softmax_weights=True, z_loss=Z_LOSS, **unitransformer_kwargs)
    inputs = transformer.autoregressive_inputs(targets)
    logits, loss = model.call_simple(inputs=inputs, targets=targets, compute_loss=True, mode=mode,
                                     variable_dtype=variable_dtype or mtf.VariableDType(torch.float32))
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    updates = optimizer.apply_grads(grads, [v.outputs[0] for v in variables]) if optimizer else []
    return graph, mesh, targets, logits, loss, variables, grads, updates


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(1, V, (B, L), generator=g, dtype=torch.int32)
    t[1, 6:] = 0  # padding: no loss there (weights = targets > 0); the denominator still counts it
    return t


# ---- the reference: Mesh TF's computation transcribed into plain PyTorch -------------------------------------------

def _rms_norm(x, scale):  # sublayer_rms_norm: x * rsqrt(mean(x^2) + 1e-6) * scale
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


def _self_attention(p, pre, x, visible=None):
    """SelfAttention with combined heads, no logit scale, read_priority >= write_priority visibility (-1e9 bias)."""
    b, n, _ = x.shape
    q = (x @ p[f"{pre}/q"]).view(b, n, H, DKV)
    k = (x @ p[f"{pre}/k"]).view(b, n, H, DKV)
    v = (x @ p[f"{pre}/v"]).view(b, n, H, DKV)
    logits = torch.einsum("blhk,bmhk->blhm", q, k)
    if visible is None:
        pos = torch.arange(n)
        visible = (pos[:, None] >= pos[None, :])[None].expand(b, n, n)  # [batch, length, memory_length]
    logits = logits + (~visible).to(logits.dtype)[:, :, None, :] * -1e9
    w = torch.softmax(logits, -1)
    o = torch.einsum("blhm,bmhk->blhk", w, v).reshape(b, n, H * DKV)
    return o @ p[f"{pre}/o"]


def reference(p, targets, train=True, visible=None, weights=None, norm=None):
    """Unitransformer._call_internal + _compute_loss for this LM; returns (logits, loss).

    ``visible`` [batch, length, memory_length] overrides the causal visibility, ``weights`` the loss weights,
    ``norm(p, scope, x)`` the sublayer norm (default rms_norm with ``{scope}/rms_norm/scale``)."""
    norm = norm or (lambda p, scope, x: _rms_norm(x, p[f"{scope}/rms_norm/scale"]))
    inputs = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], 1).abs().long()  # autoregressive_inputs
    x = p["transformer/embedding"][inputs] + p["transformer/positional_embedding"][:L]
    for b in range(2):
        att, ffn = f"transformer/block_{b:03d}/layer_000", f"transformer/block_{b:03d}/layer_001"
        x = x + _self_attention(p, f"{att}/SelfAttention", norm(p, att, x), visible)
        h = norm(p, ffn, x)
        x = x + torch.relu(h @ p[f"{ffn}/DenseReluDense/wi/kernel"]) @ p[f"{ffn}/DenseReluDense/wo/kernel"]
    x = norm(p, "transformer", x)
    logits = (x * D ** -0.5) @ p["transformer/embedding"].T  # VocabEmbedding.hidden_to_logits
    log_z = torch.logsumexp(logits, -1)
    soft = torch.nn.functional.one_hot(targets.clamp_min(0).long(), V).to(logits.dtype)
    xent = -((logits - log_z[..., None]) * soft).sum(-1)
    if train:
        xent = xent + Z_LOSS * log_z.pow(2)
    weights = (targets > 0).to(logits.dtype) if weights is None else weights.to(logits.dtype)
    return logits, (xent * weights).sum() / float(B * L)


def adafactor_reference(params, grads, slots, step):
    """Mesh TF AdafactorOptimizer() apply_grad (defaults), transcribed: none of these shapes is factored
    (min_dim_size_to_factor=128 needs two dims >= 128)."""
    decay = 1.0 - (step + 1.0) ** -0.8
    lr = min((step + 1.0) ** -0.5, 0.01)
    new = {}
    for n, w in params.items():
        g = grads[n]
        dims = sorted(w.shape, reverse=True)
        assert len(dims) < 2 or dims[1] < 128
        v = slots.get(n, torch.zeros_like(w)) * decay + (g * g + 1e-30) * (1.0 - decay)
        slots[n] = v
        x = g * torch.rsqrt(v)
        x = x / max(1.0, (x.pow(2).mean().sqrt() / 1.0).item())
        scale = max(w.pow(2).mean().sqrt().item(), 1e-3) * lr
        new[n] = w - x * scale
    return new


# ---- the tests -------------------------------------------------------------------------------------------------------

def test_variable_names_and_shapes_are_mesh_tf_s():
    graph, *_ = build()
    got = {v.name: [(d.name, d.size) for d in v.shape] for v in graph.all_variables}
    assert got == expected_variables()


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_loss_logits_and_gradients_match_the_mesh_tf_transcription(mesh_shape, layout):
    graph, mesh, targets, logits, loss, variables, grads, _ = build()
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    t = data()
    out = lw.run([logits, loss] + grads, feeds={targets: t})
    params = {v.name: lw.variable_value(v.name).to(torch.float64).requires_grad_(True) for v in variables}
    ref_logits, ref_loss = reference(params, t)
    ref_grads = torch.autograd.grad(ref_loss, list(params.values()))
    assert rel_error(out[0], ref_logits) <= 1e-5
    assert rel_error(out[1], ref_loss) <= 1e-5
    assert 5.0 < ref_loss.item() < 8.0  # about log(256): a sensible untrained LM
    for v, g, r in zip(variables, out[2:], ref_grads, strict=True):
        assert r.abs().max() > 0, f"{v.name}: no gradient in the reference"
        assert rel_error(g, r) <= 1e-5, f"{mesh_shape} {layout}: gradient of {v.name}"


def test_z_loss_only_in_training_and_integer_targets_accepted():
    """mode="eval" drops the z-loss (Mesh TF: z_loss if context.train else 0.0)."""
    graph = mtf.Graph(seed=3)
    mesh = mtf.Mesh(graph, "m")
    targets = mtf.placeholder(mesh, "targets", [("batch", B), ("length", L)], dtype=torch.int32)
    model = transformer.Unitransformer(
        layer_stack=transformer.make_layer_stack(
            [[transformer_layers.SelfAttention, {"num_heads": H, "key_value_size": DKV}],
             [transformer_layers.DenseReluDense, {"hidden_size": DFF}]], num_layers=2),
        d_model=D, input_vocab_size=V, output_vocab_size=V, autoregressive=True, max_length=MAXLEN,
        shared_embedding_and_softmax_weights=True, z_loss=Z_LOSS)
    _, loss = model.call_simple(transformer.autoregressive_inputs(targets), targets, True, mode="eval")
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl("", "")})
    t = data(1)
    got = lw.run([loss], feeds={targets: t})[0]
    params = {v.name: lw.variable_value(v.name).to(torch.float64) for v in graph.trainable_variables}
    assert rel_error(got, reference(params, t, train=False)[1]) <= 1e-5
    assert abs(got.item() - reference(params, t, train=True)[1].item()) > 1e-6  # the z-loss term is not nothing
    with pytest.raises(ValueError, match="mode"):
        model.call_simple(transformer.autoregressive_inputs(targets), targets, True, mode="training")


@pytest.mark.parametrize("mesh_shape,layout", [LAYOUTS[0], LAYOUTS[3]])
def test_three_adafactor_updates_match_the_mesh_tf_transcription(mesh_shape, layout):
    graph, mesh, targets, logits, loss, variables, grads, updates = build(mtf.optim.AdafactorOptimizer())
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    params = {v.name: lw.variable_value(v.name).to(torch.float64) for v in variables}
    initial = dict(params)
    slots = {}
    for step in range(3):
        t = data(10 + step)
        got_loss = lw.run([loss] + updates, feeds={targets: t})[0]
        leaves = {n: w.clone().requires_grad_(True) for n, w in params.items()}
        ref_loss = reference(leaves, t)[1]
        assert rel_error(got_loss, ref_loss) <= 1e-5, f"step {step}"
        ref_grads = dict(zip(leaves, torch.autograd.grad(ref_loss, list(leaves.values())), strict=True))
        params = adafactor_reference(params, ref_grads, slots, step)
    for v in variables:
        got = lw.variable_value(v.name)
        assert rel_error(got, params[v.name]) <= 1e-5, f"{v.name} after 3 updates"
        assert (params[v.name] - initial[v.name]).abs().max() > 1e-4, f"{v.name} did not move"


def test_the_lm_trains_with_adafactor_and_layouts_agree():
    """Porting example: the LM as Mesh TF users build it, trained with AdafactorOptimizer() on a small fixed set
    of sequences; the loss falls and the same steps give the same losses on a 2x2 mesh."""
    losses = {}
    for mesh_shape, layout in [LAYOUTS[0], LAYOUTS[4]]:
        graph, mesh, targets, logits, loss, variables, grads, updates = build(mtf.optim.AdafactorOptimizer())
        lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        losses[layout] = torch.tensor([lw.run([loss] + updates, feeds={targets: data(step % 2)})[0].item()
                                       for step in range(24)], dtype=torch.float64)
    base = losses[""]
    assert base[-2:].mean() < 0.7 * base[:2].mean(), base.tolist()
    assert ((losses[LAYOUTS[4][1]] - base).abs() / base).max() <= 1e-4


def test_input_full_attention_and_loss_on_targets_only():
    """Seq2seq as an LM: ``[inputs, EOS=1, targets, EOS=1]``; the inputs part (and the position reading its EOS)
    attends fully within itself, the loss counts the targets part only (Mesh TF's delimited_lm_inputs_mask)."""
    graph, mesh, targets, logits, loss, variables, grads, _ = build(input_full_attention=True,
                                                                    loss_on_targets_only=True)
    t = torch.tensor([[5, 6, 1, 7, 8, 9, 1, 0], [5, 1, 7, 1, 4, 4, 1, 3], [9, 9, 9, 1, 2, 1, 0, 0],
                      [3, 4, 5, 6, 7, 1, 8, 1]], dtype=torch.int32)
    eos_before = torch.cumsum((t == 1).int(), 1) - (t == 1).int()
    inputs_part = eos_before % 2 == 0
    region = inputs_part | torch.cat([torch.zeros_like(inputs_part[:, :1]), inputs_part[:, :-1]], 1)
    priority = torch.arange(L)[None] * (~region).int()
    visible = priority[:, :, None] >= priority[:, None, :]
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(*LAYOUTS[3])})
    out = lw.run([logits, loss] + grads, feeds={targets: t})
    params = {v.name: lw.variable_value(v.name).to(torch.float64).requires_grad_(True) for v in variables}
    ref_logits, ref_loss = reference(params, t, visible=visible, weights=(t > 0) & ~inputs_part)
    assert not torch.equal(visible[0], visible[0].tril())  # some positions see ahead: the check has power
    assert rel_error(out[0], ref_logits) <= 1e-5 and rel_error(out[1], ref_loss) <= 1e-5
    for v, g, r in zip(variables, out[2:], torch.autograd.grad(ref_loss, list(params.values())), strict=True):
        assert rel_error(g, r) <= 1e-5, v.name


def test_bfloat16_activations_with_float32_variables():
    """variable_dtype=mtf.VariableDType(float32, float32, bfloat16): float32 variables, bfloat16 logits and loss close
    to the float64 transcription (bfloat16 has 8 bits of mantissa)."""
    graph, mesh, targets, logits, loss, variables, grads, _ = build(
        variable_dtype=mtf.VariableDType(torch.float32, torch.float32, torch.bfloat16))
    assert all(v.dtype == torch.float32 for v in variables) and logits.dtype == torch.bfloat16
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(*LAYOUTS[3])})
    t = data()
    out = lw.run([logits, loss], feeds={targets: t})
    params = {v.name: lw.variable_value(v.name).to(torch.float64) for v in variables}
    ref_logits, ref_loss = reference(params, t)
    assert rel_error(out[1], ref_loss) <= 2e-2 and rel_error(out[0], ref_logits) <= 5e-2

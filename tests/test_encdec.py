"""The T5-style encoder-decoder: loss and gradients vs a plain-PyTorch twin, under layouts; training agrees."""

import math

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.models.encdec import EncDecConfig, build_encdec, relative_position_buckets
from meshtorch.testing import assert_training_agrees

CFG = EncDecConfig(vocab_size=30, vocab_multiple=4, d_model=16, num_heads=4, d_kv=4, d_ff=16, num_encoder_layers=2,
                   num_decoder_layers=2, input_length=8, target_length=6, batch_size=4, num_buckets=8,
                   max_distance=16)
LAYOUTS = [("", ""), ("all:4", "batch:all"), ("all:4", "heads:all;d_ff:all;vocab:all"),
           ("all:4", "d_model:all"), ("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model")]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only contend on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def bucket(n_query_minus_memory, bidirectional, num_buckets, max_distance):
    """T5's bucket for one signed distance, written out scalar by scalar (the twin's own version)."""
    n, ret = n_query_minus_memory, 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            ret += num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return ret + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return ret + min(large, num_buckets - 1)


def test_relative_position_buckets():
    for bidi in (True, False):
        got = relative_position_buckets(7, 40, bidi, 8, 16)
        want = torch.tensor([[bucket(q - m, bidi, 8, 16) for m in range(40)] for q in range(7)])
        assert torch.equal(got, want)
        assert len(set(got.flatten().tolist())) > 5  # the log buckets are exercised
    with pytest.raises(ValueError):
        relative_position_buckets(4, 4, True, 2)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _mha(p, prefix, x, mem, bias, causal, c):
    q = torch.einsum("bld,dhk->bhlk", x, p[f"{prefix}/q"])
    k = torch.einsum("bmd,dhk->bhmk", mem, p[f"{prefix}/k"])
    v = torch.einsum("bmd,dhk->bhmk", mem, p[f"{prefix}/v"])
    s = torch.einsum("bhlk,bhmk->bhlm", q, k) / math.sqrt(c.d_kv) + bias
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhlm,bhmk->bhlk", torch.softmax(s, -1), v)
    return torch.einsum("bhlk,hkd->bld", o, p[f"{prefix}/o"])


def _ffn(p, prefix, x):
    return F.relu(x @ p[f"{prefix}/wi/kernel"]) @ p[f"{prefix}/wo/kernel"]


def twin_loss(p, c, inputs, targets):
    """The same model in plain PyTorch, from a ``{variable name: tensor}`` dict."""
    def rel(name, n, bidi):
        if not c.relative_attention:
            return 0.0
        ids = torch.tensor([[bucket(q - m, bidi, c.num_buckets, c.max_distance) for m in range(n)] for q in range(n)])
        return p[f"{name}/relative_attention_bias"][ids].permute(2, 0, 1)  # [heads, q, m]
    pad = (inputs == c.pad_id).float()[:, None, None, :] * -1e9  # [b, 1, 1, m]
    x = p["embedding"][inputs]
    if not c.relative_attention:
        x = x + p["encoder/pos_embedding"]
    for i in range(c.num_encoder_layers):
        pre = f"encoder/layer_{i}"
        x = x + _mha(p, f"{pre}/attention", h := _rms(x, p[f"{pre}/attention_norm/scale"]), h,
                     rel("encoder", c.input_length, True) + pad, False, c)
        x = x + _ffn(p, f"{pre}/ffn", _rms(x, p[f"{pre}/ffn_norm/scale"]))
    mem = _rms(x, p["encoder/final_norm/scale"])
    dec_in = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], 1)
    y = p["embedding"][dec_in]
    if not c.relative_attention:
        y = y + p["decoder/pos_embedding"]
    for i in range(c.num_decoder_layers):
        pre = f"decoder/layer_{i}"
        h = _rms(y, p[f"{pre}/self_attention_norm/scale"])
        y = y + _mha(p, f"{pre}/self_attention", h, h, rel("decoder", c.target_length, False), True, c)
        h = _rms(y, p[f"{pre}/encdec_attention_norm/scale"])
        y = y + _mha(p, f"{pre}/encdec_attention", h, mem, pad, False, c)
        y = y + _ffn(p, f"{pre}/ffn", _rms(y, p[f"{pre}/ffn_norm/scale"]))
    logits = _rms(y, p["decoder/final_norm/scale"]) @ p["logits/kernel"]
    logits = logits[..., : c.vocab_size]  # the padded classes get -1e9: they drop out of the softmax
    nll = F.cross_entropy(logits.reshape(-1, c.vocab_size), targets.reshape(-1), reduction="none")
    w = (targets.reshape(-1) != c.pad_id).float()
    return (nll * w).sum() / w.sum()


def _data(c, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, c.vocab_size, (c.batch_size, c.input_length), generator=g)
    y = torch.randint(1, c.vocab_size, (c.batch_size, c.target_length), generator=g)
    x[0, 5:] = 0  # padding in the inputs (masked in attention) and in the targets (no loss)
    x[2, 3:] = 0
    y[1, 4:] = 0
    return x, y


@pytest.mark.parametrize("c", [CFG, EncDecConfig(**{**CFG.to_dict(), "relative_attention": False})],
                         ids=["relative_bias", "absolute_positions"])
def test_loss_and_gradients_match_plain_pytorch_under_layouts(c):
    x, y = _data(c)
    ref = None
    for mesh_shape, layout in LAYOUTS:
        m = build_encdec(c, seed=1)
        variables = m.graph.trainable_variables
        grads = mtf.gradients([m.loss], variables)
        lw = m.lowering(mesh_shape, layout)
        out = lw.run([m.loss] + grads, feeds={m.inputs: x, m.targets: y})
        if ref is None:
            params = {v.name: lw.variable_value(v.name).clone().requires_grad_(True) for v in variables}
            if c.relative_attention:
                assert "encoder/relative_attention_bias" in params and "decoder/relative_attention_bias" in params
            loss = twin_loss(params, c, x, y)
            loss.backward()
            ref = (loss.item(), [params[v.name].grad for v in variables])
        where = f"{mesh_shape} {layout}"
        assert abs(out[0].item() - ref[0]) <= 1e-5 * abs(ref[0]), where
        for v, g, r in zip(variables, out[1:], ref[1], strict=True):
            assert r is not None and r.abs().max() > 0, f"{v.name} has no gradient in the twin"
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=f"{where}: grad of {v.name}")


def test_training_losses_agree_across_layouts():
    c = EncDecConfig(**{**CFG.to_dict(), "dropout": 0.1})
    assert_training_agrees(lambda: build_encdec(c, seed=2, optimizer=mtf.optim.AdamWOptimizer(1e-2)), LAYOUTS,
                           lambda step: _data(c, seed=step % 2), steps=8, rtol=1e-4)

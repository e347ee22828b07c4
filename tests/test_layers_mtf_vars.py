"""Mesh TF layers with variables (mtf_attention, local_attention, misc, feedforward, dense_extra, conv):
outputs vs plain PyTorch computed from the layer's own variable values, under a 1-D and a 2-D layout."""

import math

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.testing import rel_error

L = mtf.layers
D = mtf.Dimension


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run(build, x_shape, x, mesh_shape, layout, fetch_vars=True):
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    xt = mtf.import_tensor(mesh, x, x_shape, name="x")
    outs = build(mesh, xt)
    outs = list(outs) if isinstance(outs, list | tuple) else [outs]
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    res = lw.run(outs)
    vals = {n: lw.variable_value(n) for n in lw.variable_names}
    return res, vals


def _qkvo(vals, name):
    w = vals[f"{name}/qkvo"]
    return w[0], w[1], w[2], w[3]  # each [heads, io, kv]


MHA_LAYOUTS = [("", ""), ("all:4", "heads:all"), ("all:4", "b:all"), ("rows:2;cols:2", "b:rows;heads:cols")]


@pytest.mark.parametrize("mesh_shape,layout", MHA_LAYOUTS)
def test_multihead_attention_mesh_tf(mesh_shape, layout):
    x = _r(4, 6, 8)
    mask = torch.triu(torch.full((6, 6), -1e9), 1)

    def build(mesh, xt):
        m = mtf.import_tensor(mesh, mask, "length:6,memory_length:6")
        return L.multihead_attention(xt, None, m, D("kv", 4), D("heads", 4), is_training=False)

    (y,), vals = _run(build, "b:4,length:6,io:8", x, mesh_shape, layout)
    assert list(vals) == ["multihead_attention/qkvo"] and tuple(vals["multihead_attention/qkvo"].shape) == (4, 4, 8, 4)
    wq, wk, wv, wo = _qkvo(vals, "multihead_attention")
    q, k, v = (torch.einsum("bli,hik->bhlk", x, w) for w in (wq, wk, wv))
    o = torch.softmax(q @ k.transpose(-1, -2) + mask, -1) @ v  # no 1/sqrt(d_kv)
    assert rel_error(y, torch.einsum("bhlk,hik->bli", o, wo)) < 1e-5


def test_multihead_attention_params_initial_scales():
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    heads, io, kv = D("heads", 8), D("io", 64), D("kv", 16)
    sep = L.multihead_attention_params(mesh, heads, io, kv, torch.float32)
    comb = L.multihead_attention_vars(mesh, heads, io, kv, torch.float32, torch.float32, torch.float32)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    vals = lw.run(sep + comb)
    want = [64 ** -0.5 * 16 ** -0.25] * 2 + [64 ** -0.5, (64 * 8) ** -0.5]
    for got, w in zip(vals[:4] + vals[4:], want + want, strict=True):
        assert tuple(got.shape) == (8, 64, 16)
        assert abs(got.std().item() / w - 1) < 0.05  # 8192 normal samples per matrix
    assert sorted(lw.variable_names) == ["k", "o", "q", "qkvo", "v"]


def _local_1d_ref(x, wq, wk, wv, wo, block, window):
    b, n, _ = x.shape
    q, k, v = (torch.einsum("bli,hik->bhlk", x, w) for w in (wq, wk, wv))
    out = torch.zeros_like(q)
    for i in range(n):
        start = (i // block) * block
        logits, vals = [], []
        for j in range(start - window, start + block):
            if i - block < j <= i:
                kj = k[:, :, j] if j >= 0 else torch.zeros_like(k[:, :, 0])
                vj = v[:, :, j] if j >= 0 else torch.zeros_like(v[:, :, 0])
                logits.append((q[:, :, i] * kj).sum(-1))
                vals.append(vj)
        p = torch.softmax(torch.stack(logits, -1), -1)
        out[:, :, i] = (p.unsqueeze(-1) * torch.stack(vals, -2)).sum(-2)
    return torch.einsum("bhlk,hik->bli", out, wo)


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:4", "heads:all"), ("all:2", "length:all"),
                                               ("rows:2;cols:2", "b:rows;heads:cols")])
def test_masked_local_attention_1d(mesh_shape, layout):
    x = _r(2, 8, 8)
    kv = []

    def build(mesh, xt):
        return L.masked_local_attention_1d(xt, D("kv", 4), D("heads", 4), False, window_size=2, length_per_split=4,
                                           return_kv=kv)

    (y,), vals = _run(build, "b:2,length:8,io:8", x, mesh_shape, layout)
    assert len(kv) == 2
    wq, wk, wv, wo = _qkvo(vals, "masked_local_attention_1d")
    assert rel_error(y, _local_1d_ref(x, wq, wk, wv, wo, block=4, window=2)) < 1e-5


def _spatial_ref(x, wq, wk, wv, wo, mask_right):
    b, nb, w, _ = x.shape
    q, k, v = (torch.einsum("bnwi,hik->bhnwk", x, m) for m in (wq, wk, wv))
    zk = torch.zeros_like(k[:, :, :1])
    kpad = torch.cat([zk, k, zk], 2)
    vpad = torch.cat([zk, v, zk], 2)
    out = torch.zeros_like(q)
    for blk in range(nb):
        blocks = [blk, blk + 1] if mask_right else [blk, blk + 1, blk + 2]  # indices into the padded blocks
        kk = torch.cat([kpad[:, :, i] for i in blocks], 2)
        vv = torch.cat([vpad[:, :, i] for i in blocks], 2)
        logits = q[:, :, blk] @ kk.transpose(-1, -2)
        if mask_right:
            m = torch.zeros(w, 2 * w)
            m[:, w:] = torch.triu(torch.full((w, w), -1e9), 1)
            logits = logits + m
        out[:, :, blk] = torch.softmax(logits, -1) @ vv
    return torch.einsum("bhnwk,hik->bnwi", out, wo)


@pytest.mark.parametrize("mask_right", [False, True])
@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:2", "nb:all"), ("rows:2;cols:2", "nb:rows;heads:cols")])
def test_local_self_attention_spatial_blocks(mask_right, mesh_shape, layout):
    x = _r(2, 4, 3, 8)

    def build(mesh, xt):
        return L.local_self_attention_spatial_blocks(xt, D("kv", 4), D("heads", 2), False, mask_right=mask_right)

    (y,), vals = _run(build, "b:2,nb:4,w:3,io:8", x, mesh_shape, layout)
    wq, wk, wv, wo = _qkvo(vals, "multihead_attention")
    assert rel_error(y, _spatial_ref(x, wq, wk, wv, wo, mask_right)) < 1e-5


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:4", "c:all"), ("rows:2;cols:2", "b:rows;c:cols")])
def test_batch_norm_training_and_eval(mesh_shape, layout):
    x = _r(8, 4, 4) * 2 + 1
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    xt = mtf.import_tensor(mesh, x, "b:8,h:4,c:4")
    y, ops = L.batch_norm(xt, True, momentum=0.9, epsilon=1e-5, dims_idx_start=0, dims_idx_end=2, name="bn")
    y_eval, none = L.batch_norm(xt, False, 0.9, name="bn_eval")
    assert none == []
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    mm0 = lw.variable_value("bn/bn_moving_mean").clone()
    out = lw.run([y, y_eval] + ops)
    mean, var = x.mean((0, 1)), x.var((0, 1), unbiased=False)
    assert rel_error(out[0], (x - mean) / torch.sqrt(var + 1e-5)) < 1e-5  # scale 1, bias 0
    assert rel_error(lw.variable_value("bn/bn_moving_mean"), 0.9 * mm0 + 0.1 * mean) < 1e-5
    assert rel_error(lw.variable_value("bn/bn_moving_variance"), 0.9 + 0.1 * var) < 1e-5
    mm, mv = lw.variable_value("bn_eval/bn_moving_mean"), lw.variable_value("bn_eval/bn_moving_variance")
    assert rel_error(out[1], (x - mm) / torch.sqrt(mv + 1e-9)) < 1e-5


@pytest.mark.parametrize("mesh_shape,layout",
                         [("", ""), ("all:4", "hidden:all"), ("rows:2;cols:2", "b:rows;hidden:cols")])
def test_dense_relu_dense_mesh_tf(mesh_shape, layout):
    x = _r(4, 8)
    (y,), vals = _run(lambda m, xt: L.dense_relu_dense(xt, D("hidden", 16), False), "b:4,io:8", x, mesh_shape, layout)
    wi, wo = vals["dense_relu_dense/wi/kernel"], vals["dense_relu_dense/wo/kernel"]
    assert rel_error(y, torch.relu(x @ wi) @ wo) < 1e-5


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:4", "depth:all"), ("rows:2;cols:2", "b:rows;out:cols")])
def test_separable_conv1d(mesh_shape, layout):
    x = _r(2, 6, 4)
    (y,), vals = _run(lambda m, xt: L.separable_conv1d(xt, D("out", 4), -1, 1), "b:2,length:6,depth:4", x,
                      mesh_shape, layout)
    s = "separable_conv1d"
    ref = 0
    for i, p in enumerate([-1, 0, 1]):  # shift(x, -p): out[l] = x[l + p], zero-filled
        sh = torch.zeros_like(x)
        lo, hi = max(0, -p), min(6, 6 - p)
        sh[:, lo:hi] = x[:, lo + p:hi + p]
        ref = ref + sh * vals[f"{s}/depthwise_dense_{i}/kernel"]
    ref = ref + vals[f"{s}/depthwise_dense_0/bias"]
    ref = ref @ vals[f"{s}/pointwise_dense/kernel"] + vals[f"{s}/pointwise_dense/bias"]
    assert rel_error(y, ref) < 1e-5


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:2", "wb:all"), ("rows:2;cols:2", "hb:rows;wb:cols")])
def test_conv2d_transpose_with_blocks_equals_unblocked(mesh_shape, layout):
    x = _r(2, 2, 2, 3, 3, 4)  # [b, hb, wb, h, w, c]

    def build(mesh, xt):
        return L.conv2d_transpose_with_blocks(xt, D("o", 3), (2, 2), (2, 2), "SAME", h_blocks_dim="hb",
                                              w_blocks_dim="wb", name="up")

    (y,), vals = _run(build, "b:2,hb:2,wb:2,h:3,w:3,c:4", x, mesh_shape, layout)
    w = vals["up/kernel"]  # [fh, fw, o, c]
    xi = x.permute(0, 1, 2, 5, 3, 4).reshape(8, 4, 3, 3)
    ref = F.conv_transpose2d(xi, w.permute(3, 2, 0, 1), stride=2).reshape(2, 2, 2, 3, 6, 6).permute(0, 1, 2, 4, 5, 3)
    assert rel_error(y, ref) < 1e-5


def test_self_attention_incremental_matches_full_causal_attention():
    x = _r(2, 4, 8)
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    xt = mtf.import_tensor(mesh, x, "b:2,length:4,io:8")
    mask = mtf.import_tensor(mesh, torch.triu(torch.full((4, 4), -1e9), 1), "length:4,memory_length:4")
    full = L.multihead_attention(xt, None, mask, D("kv", 4), D("heads", 2), False, name="att")
    k = mtf.zeros(mesh, "b:2,heads:2,memory_length:4,kv:4")
    v = mtf.zeros(mesh, "b:2,heads:2,memory_length:4,kv:4")
    ys = []
    for t in range(4):
        xt_t = mtf.gather(xt, mtf.constant(mesh, t, [], dtype=torch.int64), "length")
        y, k, v = L.multihead_self_attention_incremental(xt_t, k, v, mtf.constant(mesh, t, [], dtype=torch.int64),
                                                         torch.float32, torch.float32, name="att_inc")
        ys.append(y)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "b:rows;heads:cols")})
    for t in range(4):  # each call makes its own scope (att_inc, att_inc_1, ...): give them the same weights
        lw.set_variable_value(f"att_inc{'_' + str(t) if t else ''}/qkvo", lw.variable_value("att/qkvo"))
    out = lw.run([full] + ys)
    for t in range(4):
        assert rel_error(out[1 + t], out[0][:, t]) < 1e-5


def test_masked_local_attention_incremental_ring_buffer():
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    x = mtf.import_tensor(mesh, _r(2, 8), "b:2,io:8")
    prev = mtf.import_tensor(mesh, _r(2, 2, 3, 4, seed=1), "b:2,heads:2,window:3,kv:4")
    y, k, v = L.masked_local_attention_1d_incremental(x, prev, prev, mtf.constant(mesh, 4, [], dtype=torch.int64),
                                                      torch.float32, torch.float32)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "heads:all")})
    yv, kv, p = lw.run([y, k, prev])
    wq, wk, wv, wo = lw.variable_value("masked_local_attention_1d/qkvo")
    xv = _r(2, 8)
    want_k = p.clone()
    want_k[:, :, 1] = torch.einsum("bi,hik->bhk", xv, wk)  # slot 4 mod 3
    assert rel_error(kv, want_k) < 1e-5
    want_v = p.clone()
    want_v[:, :, 1] = torch.einsum("bi,hik->bhk", xv, wv)
    q = torch.einsum("bi,hik->bhk", xv, wq)
    o = (torch.softmax(torch.einsum("bhk,bhwk->bhw", q, want_k), -1).unsqueeze(-1) * want_v).sum(2)
    assert rel_error(yv, torch.einsum("bhk,hik->bi", o, wo)) < 1e-5


def test_embedding_weights_and_jitter_and_annealed_dropout():
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    e = L.embedding_weights(mesh, D("vocab", 16), D("d", 8), torch.float32, ensemble_dim=D("ens", 2))
    x = mtf.ones(mesh, "b:64,c:64")
    j = L.multiplicative_jitter(x, epsilon=0.1)
    d = L.annealed_dropout(x, True, start_step=0, end_step=10, init_rate=0.5)
    outs = [mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(m, lay)}).run([e, j, d])
            for m, lay in [("", ""), ("rows:2;cols:2", "b:rows;c:cols")]]
    assert tuple(outs[0][0].shape) == (2, 16, 8)
    for a, b in zip(*outs, strict=True):  # layout-independent randomness
        assert torch.equal(a, b)
    jv, dv = outs[0][1], outs[0][2]
    assert 0.9 <= jv.min() and jv.max() <= 1.1 and abs(jv.mean().item() - 1) < 0.01
    kept = dv != 0  # step 0: keep probability 0.5, kept values scaled by 1 / 0.5
    assert abs(kept.float().mean().item() - 0.5) < 0.03 and torch.all(dv[kept] == 2.0)
    assert math.isclose(e.shape.size, 2 * 16 * 8)


def _local_2d_ref(x, wq, wk, wv, wo):
    # Mesh TF's computation: keys/values of the 3x3 neighbour blocks (zero outside), logits summed over
    # memory rows, softmax over memory columns, values summed over memory rows and columns
    b, nh, nw, h, w, _ = x.shape
    q, k, v = (torch.einsum("bnmhwi,gik->bgnmhwk", x, m) for m in (wq, wk, wv))

    def halo(t):
        t = F.pad(t, (0, 0, 0, 0, 0, 0, 0, 0, 1, 1))  # zero blocks around num_h_blocks (dim 2)
        t = torch.cat([t[:, :, i:i + nh] for i in range(3)], 4)  # memory rows: 3 blocks of h
        t = F.pad(t, (0, 0, 0, 0, 0, 0, 1, 1))  # around num_w_blocks (dim 3)
        return torch.cat([t[:, :, :, i:i + nw] for i in range(3)], 5)

    kk, vv = halo(k), halo(v)  # [b, g, nh, nw, 3h, 3w, kv]
    logits = torch.einsum("bgnmhwk,bgnmrck->bgnmhwc", q, kk)
    p = torch.softmax(logits, -1)
    out = torch.einsum("bgnmhwc,bgnmrck->bgnmhwk", p, vv)
    return torch.einsum("bgnmhwk,gik->bnmhwi", out, wo)


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:2", "nh:all"), ("rows:2;cols:2", "nh:rows;nw:cols")])
def test_local_2d_self_attention_spatial_blocks(mesh_shape, layout):
    x = _r(1, 2, 2, 2, 2, 4)

    def build(mesh, xt):
        return L.local_2d_self_attention_spatial_blocks(xt, D("kv", 2), D("heads", 2), False)

    (y,), vals = _run(build, "b:1,nh:2,nw:2,h:2,w:2,io:4", x, mesh_shape, layout)
    wq, wk, wv, wo = _qkvo(vals, "multihead_attention")
    assert rel_error(y, _local_2d_ref(x, wq, wk, wv, wo)) < 1e-5
    with pytest.raises(ValueError, match="mask_right"):
        L.local_2d_self_attention_spatial_blocks(mtf.zeros(mtf.Mesh(mtf.Graph()), "b:1,nh:2,nw:2,h:2,w:2,io:4"),
                                                 D("kv", 2), D("heads", 2), False, mask_right=True)


@pytest.mark.parametrize("mask_right", [False, True])
@pytest.mark.parametrize("mesh_shape,layout",
                         [("", ""), ("all:2", "heads:all"), ("rows:2;cols:2", "b:rows;heads:cols")])
def test_memory_compressed_attention(mask_right, mesh_shape, layout):
    x = _r(2, 8, 4)

    def build(mesh, xt):
        return L.multihead_self_attention_memory_compressed(xt, mask_right, 2, D("kv", 4), D("heads", 2), False)

    (y,), vals = _run(build, "b:2,length:8,io:4", x, mesh_shape, layout)
    wq, wk, wv, wo = _qkvo(vals, "multihead_attention")
    mem = x.reshape(2, 4, 2, 4).mean(2)
    q = torch.einsum("bli,hik->bhlk", x, wq)
    k, v = (torch.einsum("bmi,hik->bhmk", mem, w) for w in (wk, wv))
    logits = q @ k.transpose(-1, -2)
    if mask_right:
        logits = logits + (torch.arange(4)[None, :] * 2 + 1 > torch.arange(8)[:, None]).float() * -1e9
    e = torch.exp(logits)
    p = e / (e.sum(-1, keepdim=True) + 1.0)  # extra_logit = 0
    assert rel_error(y, torch.einsum("bhlk,hik->bli", p @ v, wo)) < 1e-5

"""Convolution, transposed convolution, pooling and blocked (halo-exchange) convolution.

Values and gradients vs plain PyTorch (torch.nn.functional on the full, unblocked tensors) under
every legal layout on one processor, "all:4" and "rows:2;cols:2" (block dims split included).
"""

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.core.errors import LayoutError, ShapeError
from meshtorch.testing import OpCase, run_layout


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tf_same_pad(size, k, s):
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


# ---------------------------------------------------------------- plain convolutions
def _ref_conv2d(x, w, stride, padding):
    """x [b, h, w, c] (NHWC), w [fh, fw, in, out]; TF padding semantics via explicit F.pad."""
    xt = x.permute(0, 3, 1, 2)
    if padding == "SAME":
        ph = _tf_same_pad(x.shape[1], w.shape[0], stride)
        pw = _tf_same_pad(x.shape[2], w.shape[1], stride)
        xt = F.pad(xt, [pw[0], pw[1], ph[0], ph[1]])
    return F.conv2d(xt, w.permute(3, 2, 0, 1), stride=stride).permute(0, 2, 3, 1)


def _conv2d_case(name, stride, padding, hw=(8, 8), cin=4, cout=4, k=(3, 3)):
    return OpCase(
        name,
        lambda mesh, x, w: mtf.conv2d(x, w, strides=stride, padding=padding),
        {"x": (f"b:4,h:{hw[0]},w:{hw[1]},cin:{cin}", _r(4, hw[0], hw[1], cin)),
         "w": (f"fh:{k[0]},fw:{k[1]},cin:{cin},cout:{cout}", _r(k[0], k[1], cin, cout, seed=1) * 0.3)},
        lambda x, w: _ref_conv2d(x, w, stride, padding))


def _ref_conv1d_odd(x, w):
    # x [t, b, cin, e] with spatial t, batch-like b and e; w [k, cin, cout] -> [t, b, cout, e]
    xt = x.permute(1, 3, 2, 0).reshape(2 * 4, 4, 8)
    y = F.conv1d(F.pad(xt, [2, 2]), w.permute(2, 1, 0))
    return y.reshape(2, 4, 4, 8).permute(3, 0, 2, 1)


def _ref_conv3d(x, w):
    # x [b, d, h, w, c] SAME stride 1, w [kd, kh, kw, in, out]
    y = F.conv3d(x.permute(0, 4, 1, 2, 3), w.permute(4, 3, 0, 1, 2), padding=1)
    return y.permute(0, 2, 3, 4, 1)


def _ref_conv2d_transpose(x, w, stride, padding):
    """x [b, h, w, c], w [fh, fw, out, c] as tf.nn.conv2d_transpose: output sizes SAME h*s."""
    k = w.shape[0]
    h = x.shape[1]
    full = h * stride if padding == "SAME" else (h - 1) * stride + k
    pb, pa = _tf_same_pad(full, k, stride) if padding == "SAME" else (0, 0)
    base = (h - 1) * stride + k
    y = F.conv_transpose2d(x.permute(0, 3, 1, 2), w.permute(3, 2, 0, 1), stride=stride,
                           output_padding=full + pb + pa - base)
    y = y[:, :, pb:pb + full, pb:pb + full]
    return y.permute(0, 2, 3, 1)


# ---------------------------------------------------------------- blocked convolutions
def _unblock(x):
    """[b, hb, wb, h, w, c] -> [b, c, H, W]."""
    b, hb, wb, h, w, c = x.shape
    return x.permute(0, 5, 1, 3, 2, 4).reshape(b, c, hb * h, wb * w)


def _reblock(y, hb, wb):
    """[b, c, H, W] -> [b, hb, wb, h, w, c]."""
    b, c, hh, ww = y.shape
    return y.reshape(b, c, hb, hh // hb, wb, ww // wb).permute(0, 2, 4, 3, 5, 1)


def _ref_blocks(x, w, stride=1):
    k = w.shape[0]
    y = F.conv2d(_unblock(x), w.permute(3, 2, 0, 1), stride=stride, padding=k // 2)
    return _reblock(y, x.shape[1], x.shape[2])


def _blocks_case(name, hb=4, wb=4, h=4, w=4, k=3, cin=2, cout=4, stride=1, batch=2):
    return OpCase(
        name,
        lambda mesh, x, f: mtf.conv2d_with_blocks(x, f, strides=stride, padding="SAME", h_blocks_dim="hb",
                                                  w_blocks_dim="wb"),
        {"x": (f"b:{batch},hb:{hb},wb:{wb},h:{h},w:{w},cin:{cin}", _r(batch, hb, wb, h, w, cin)),
         "f": (f"fh:{k},fw:{k},cin:{cin},cout:{cout}", _r(k, k, cin, cout, seed=1) * 0.3)},
        lambda x, f: _ref_blocks(x, f, stride))


def _ref_blocks3d(x, f):
    # x [b, db, hb, d, h, w, c] (no w blocks), SAME, w [k, k, k, in, out]
    b, db, hb, d, h, ww, c = x.shape
    full = x.permute(0, 6, 1, 3, 2, 4, 5).reshape(b, c, db * d, hb * h, ww)
    y = F.conv3d(full, f.permute(4, 3, 0, 1, 2), padding=f.shape[0] // 2)
    co = y.shape[1]
    return y.reshape(b, co, db, d, hb, h, ww).permute(0, 2, 4, 3, 5, 6, 1)


# ---------------------------------------------------------------- pooling
def _ref_pool(x, kind, k, s, padding):
    """x [b, h, w, c] -> pooled, TF semantics (SAME ignores the padding)."""
    xt = x.permute(0, 3, 1, 2)
    if padding == "SAME":
        ph = _tf_same_pad(x.shape[1], k, s)
        pw = _tf_same_pad(x.shape[2], k, s)
        pad = [pw[0], pw[1], ph[0], ph[1]]
        if kind == "MAX":
            y = F.max_pool2d(F.pad(xt, pad, value=float("-inf")), k, s)
        else:
            sums = F.avg_pool2d(F.pad(xt, pad), k, s, divisor_override=1)
            cnt = F.avg_pool2d(F.pad(torch.ones_like(xt[:1, :1]), pad), k, s, divisor_override=1)
            y = sums / cnt
    else:
        y = (F.max_pool2d if kind == "MAX" else F.avg_pool2d)(xt, k, s)
    return y.permute(0, 2, 3, 1)


def _pool_case(name, kind, k, s, padding, hw=8):
    fn = mtf.max_pool2d if kind == "MAX" else mtf.avg_pool2d
    return OpCase(name, lambda mesh, x: fn(x, ksize=(k, k), strides=s, padding=padding),
                  {"x": (f"b:4,h:{hw},w:{hw},c:4", _r(4, hw, hw, 4))},
                  lambda x: _ref_pool(x, kind, k, s, padding))


OP_CASES = [
    _conv2d_case("conv2d_same", 1, "SAME"),
    _conv2d_case("conv2d_valid_stride2", 2, "VALID", hw=(9, 8)),
    _conv2d_case("conv2d_same_stride2_asym", 2, "SAME", hw=(8, 7), k=(3, 2)),
    _conv2d_case("conv2d_5x5_cin2", 1, "SAME", cin=2, k=(5, 5)),
    OpCase("conv1d_spatial_first",
           lambda mesh, x, w: mtf.conv1d(x, w, spatial_dims=["t"]),
           {"x": ("t:8,b:2,cin:4,e:4", _r(8, 2, 4, 4)), "w": ("k:5,cin:4,cout:4", _r(5, 4, 4, seed=1) * 0.3)},
           _ref_conv1d_odd),
    OpCase("conv3d_same",
           lambda mesh, x, w: mtf.conv3d(x, w),
           {"x": ("b:4,d:4,h:4,w:4,cin:4", _r(4, 4, 4, 4, 4)),
            "w": ("fd:3,fh:3,fw:3,cin:4,cout:4", _r(3, 3, 3, 4, 4, seed=1) * 0.2)},
           _ref_conv3d),
    OpCase("conv2d_transpose_same_s2",
           lambda mesh, x, w: mtf.conv2d_transpose(x, w, strides=(2, 2), padding="SAME"),
           {"x": ("b:4,h:4,w:4,c:4", _r(4, 4, 4, 4)), "w": ("fh:3,fw:3,o:4,c:4", _r(3, 3, 4, 4, seed=1) * 0.3)},
           lambda x, w: _ref_conv2d_transpose(x, w, 2, "SAME")),
    OpCase("conv2d_transpose_valid_s2",
           lambda mesh, x, w: mtf.conv2d_transpose(x, w, strides=2, padding="VALID"),
           {"x": ("b:4,h:4,w:4,c:4", _r(4, 4, 4, 4)), "w": ("fh:2,fw:2,o:4,c:4", _r(2, 2, 4, 4, seed=1) * 0.3)},
           lambda x, w: _ref_conv2d_transpose(x, w, 2, "VALID")),
    _pool_case("max_pool2x2", "MAX", 2, 2, "VALID"),
    _pool_case("avg_pool2x2", "AVG", 2, 2, "VALID"),
    _pool_case("max_pool3_s1_same", "MAX", 3, 1, "SAME"),
    _pool_case("avg_pool3_s2_same", "AVG", 3, 2, "SAME", hw=7),
    _pool_case("avg_pool2_s2_same_asym", "AVG", 2, 2, "SAME", hw=5),
    _blocks_case("blocks_3x3"),
    _blocks_case("blocks_5x5_halo2", k=5),
    _blocks_case("blocks_7x7_multihop", h=2, w=2, k=7, cin=4),
    _blocks_case("blocks_stride2", stride=2),
    OpCase("blocks_relu_chain",
           lambda mesh, x, f, g: mtf.conv2d_with_blocks(
               mtf.relu(mtf.conv2d_with_blocks(x, f, h_blocks_dim="hb", w_blocks_dim="wb")), g,
               h_blocks_dim="hb", w_blocks_dim="wb"),
           {"x": ("b:2,hb:4,wb:4,h:4,w:4,cin:2", _r(2, 4, 4, 4, 4, 2)),
            "f": ("fh:3,fw:3,cin:2,mid:4", _r(3, 3, 2, 4, seed=1) * 0.3),
            "g": ("gh:5,gw:5,mid:4,cout:4", _r(5, 5, 4, 4, seed=2) * 0.2)},
           lambda x, f, g: _ref_blocks(torch.relu(_ref_blocks(x, f)), g)),
    OpCase("blocks_h_only_w_padded",
           lambda mesh, x, f: mtf.conv2d_with_blocks(x, f, h_blocks_dim="hb"),
           {"x": ("b:2,hb:4,h:4,w:8,cin:2", _r(2, 4, 4, 8, 2)),
            "f": ("fh:3,fw:5,cin:2,cout:4", _r(3, 5, 2, 4, seed=1) * 0.3)},
           lambda x, f: F.conv2d(x.permute(0, 4, 1, 2, 3).reshape(2, 2, 16, 8), f.permute(3, 2, 0, 1),
                                 padding=(1, 2)).reshape(2, 4, 4, 4, 8).permute(0, 2, 3, 4, 1)),
    OpCase("blocks3d_d_h",
           lambda mesh, x, f: mtf.conv3d_with_blocks(x, f, d_blocks_dim="db", h_blocks_dim="hb"),
           {"x": ("b:2,db:4,hb:4,d:2,h:2,w:4,cin:2", _r(2, 4, 4, 2, 2, 4, 2)),
            "f": ("kd:3,kh:3,kw:3,cin:2,cout:4", _r(3, 3, 3, 2, 4, seed=1) * 0.3)},
           _ref_blocks3d),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    if case.name.startswith("blocks"):  # the block dims are split, so the halo crosses processors
        assert ("all:4", "hb:all") in layouts
        if "wb:" in case.inputs["x"][0]:
            assert ("rows:2;cols:2", "hb:rows;wb:cols") in layouts
    if case.name in ("conv2d_same", "conv3d_same"):  # in-channels split: partial sums + all-reduce
        assert ("all:4", "cin:all") in layouts and ("all:4", "cout:all") in layouts


# ---------------------------------------------------------------- communication of the halo
def _blocks_lowering(layout, mesh_shape="rows:2;cols:2", k=3):
    case = _blocks_case("c", k=k)
    _, _, lw = run_layout(case.build, case.inputs, mesh_shape, layout, grad=True)
    return lw


def test_halo_crosses_processors_only_when_blocks_split():
    kinds = [c.kind for c in _blocks_lowering("hb:rows;wb:cols").counters.records]
    assert kinds.count("collective_permute") >= 4  # forward: left/right per split dim; backward: the transposes
    local = _blocks_lowering("b:rows")
    assert not any(c.kind == "collective_permute" for c in local.counters.records)


def test_halo_sends_only_boundary_rows():
    lw = _blocks_lowering("hb:rows")
    recs = [c for c in lw.counters.records if c.kind == "collective_permute" and "halo" in c.op and "grad" not in c.op]
    assert recs
    # one halo row (3x3 filter) of a [b:2, wb:4, w:4, cin:2] slice, float32
    assert all(c.bytes_per_processor == 2 * 4 * 4 * 2 * 4 for c in recs), recs


# ---------------------------------------------------------------- errors at graph build / lowering
def _mesh():
    g = mtf.Graph()
    return mtf.Mesh(g, "m")


def test_errors_name_tensor_and_dim():
    mesh = _mesh()
    x = mtf.placeholder(mesh, "img", "b:2,h:8,w:8,c:3")
    w = mtf.placeholder(mesh, "ker", "fh:3,fw:3,cin:3,cout:4")
    with pytest.raises(ShapeError, match="cin.*img"):
        mtf.conv2d(x, w)
    w2 = mtf.placeholder(mesh, "ker2", "fh:3,fw:3,c:3,b:4")
    with pytest.raises(ShapeError, match="'b'.*img"):
        mtf.conv2d(x, w2)
    w3 = mtf.placeholder(mesh, "ker3", "fh:9,fw:3,c:3,o:4")
    with pytest.raises(ShapeError, match="h:8"):
        mtf.conv2d(x, w3, padding="VALID")
    w4 = mtf.placeholder(mesh, "ker4", "fh:3,fw:3,c:3,o:4")
    with pytest.raises(ValueError, match="padding"):
        mtf.conv2d(x, w4, padding="FULL")
    with pytest.raises(ShapeError, match="zz"):
        mtf.conv2d(x, w4, spatial_dims=["h", "zz"])
    with pytest.raises(ValueError, match="SAME"):
        mtf.conv2d_with_blocks(x, w4, padding="VALID", h_blocks_dim="b")
    w5 = mtf.placeholder(mesh, "ker5", "fh:2,fw:3,c:3,o:4")
    with pytest.raises(ValueError, match="odd"):
        mtf.conv2d_with_blocks(x, w5, h_blocks_dim="b")
    with pytest.raises(ShapeError, match="nope"):
        mtf.conv2d_with_blocks(x, w4, h_blocks_dim="nope")
    with pytest.raises(ShapeError, match="img"):
        mtf.max_pool2d(x, ksize=(3, 3), padding="VALID", spatial_dims=["h", "q"])


def test_spatial_split_is_rejected_at_lowering():
    mesh = _mesh()
    x = mtf.get_variable(mesh, "img", "b:2,h:8,w:8,c:4")
    w = mtf.get_variable(mesh, "ker", "fh:3,fw:3,c:4,o:4")
    y = mtf.conv2d(x, w)
    del y
    with pytest.raises(LayoutError, match="'h'"):
        mtf.Lowering(mesh.graph, {mesh: mtf.PlacementMeshImpl("all:2", "h:all")})


def test_layers_create_mesh_tf_shaped_filters():
    mesh = _mesh()
    x = mtf.placeholder(mesh, "img", "b:2,h:8,w:8,c:3")
    y = mtf.layers.conv2d(x, mtf.Dimension("o", 5), filter_size=(3, 1), strides=(2, 2), name="c0")
    t = mtf.layers.conv2d_transpose(y, mtf.Dimension("u", 2), name="up")
    assert y.shape == mtf.Shape("b:2,h:4,w:4,o:5") and t.shape == mtf.Shape("b:2,h:8,w:8,u:2")
    shapes = {v.name: v.shape for v in mesh.graph.all_variables}
    assert shapes == {"c0/kernel": mtf.Shape("fh:3,fw:1,c:3,o:5"), "up/kernel": mtf.Shape("fh:2,fw:2,u:2,o:5")}
    with pytest.raises(ShapeError, match="'c'"):
        mtf.layers.conv2d(x, mtf.Dimension("c", 4))

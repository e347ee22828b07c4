"""Mixed precision: VariableDType storage vs activation dtypes, float32 accumulation, bf16 training."""

import pytest
import torch

import meshtorch as mtf

LAYOUTS = [("", ""), ("all:4", "batch:all"), ("all:4", "hidden:all"), ("rows:2;cols:2", "batch:rows;hidden:cols"),
           ("rows:2;cols:2", "hidden:rows;classes:cols")]
BF16 = mtf.VariableDType(torch.float32, torch.float32, torch.bfloat16)


def test_variable_dtype_defaults_and_errors():
    d = mtf.VariableDType(torch.float32, activation_dtype=torch.bfloat16)
    assert (d.master_dtype, d.slice_dtype, d.activation_dtype) == (torch.float32, torch.float32, torch.bfloat16)
    assert mtf.VariableDType.of(torch.float16) == mtf.VariableDType(torch.float16, torch.float16, torch.float16)
    with pytest.raises(TypeError, match="slice_dtype"):
        mtf.VariableDType(torch.float32, slice_dtype=torch.int32)
    g = mtf.Graph()
    with pytest.raises(TypeError, match="VariableDType"):
        mtf.get_variable(mtf.Mesh(g), "w", "a:4", dtype="float32")


def test_get_variable_keeps_slice_dtype_and_returns_activation_dtype():
    g = mtf.Graph(seed=3)
    mesh = mtf.Mesh(g)
    w = mtf.get_variable(mesh, "w", "a:8,b:4", dtype=BF16)
    w16 = mtf.get_variable(mesh, "w16", "a:8,b:4", dtype=mtf.VariableDType(torch.float32, torch.bfloat16))
    w32 = mtf.get_variable(mesh, "w32", "a:8,b:4")
    assert w.dtype == torch.bfloat16 and w.operation.variable.dtype == torch.float32
    # activation dtype defaults to the master dtype (Mesh TF): bfloat16 slices, float32 reads
    assert w16.dtype == torch.float32 and w16.operation.variable.dtype == torch.bfloat16
    assert isinstance(w32.operation, mtf.Variable) and w32.dtype == torch.float32
    upd = mtf.assign(w, w * 2.0)  # assign through the activation-dtype read updates the variable
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "a:all")})
    master = lw.variable_value("w")
    assert master.dtype == torch.float32
    # same name, same seed: initial values drawn in the master dtype, then cast to the slice dtype
    g2 = mtf.Graph(seed=3)
    mesh2 = mtf.Mesh(g2)
    mtf.get_variable(mesh2, "w", "a:8,b:4")
    mtf.get_variable(mesh2, "w16", "a:8,b:4")
    lw2 = mtf.Lowering(g2, {mesh2: mtf.PlacementMeshImpl("", "")})
    torch.testing.assert_close(master, lw2.variable_value("w"))
    torch.testing.assert_close(lw.variable_value("w16"), lw2.variable_value("w16").bfloat16())
    got = lw.run(w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, master.bfloat16())
    torch.testing.assert_close(lw.run(w16), lw2.variable_value("w16").bfloat16().float())
    lw.run(upd)
    assert lw.variable_value("w").dtype == torch.float32
    torch.testing.assert_close(lw.variable_value("w"), (master.bfloat16() * 2).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:4", "n:all"), ("rows:2;cols:2", "m:rows;n:cols")])
def test_low_precision_sums_accumulate_in_float32(dtype, mesh_shape, layout):
    x = (torch.rand(4, 4096, generator=torch.Generator().manual_seed(0)) + 0.5).to(dtype)
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    xv = mtf.get_variable(mesh, "x", "m:4,n:4096", dtype=dtype, initializer=0.0)
    s = mtf.reduce_sum(xv, reduced_dim="n")
    mean = mtf.reduce_mean(xv)
    gram = mtf.einsum([xv, xv], output_shape="m:4")  # sum of squares over n
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    lw.set_variable_value("x", x)
    got_s, got_mean, got_gram = lw.run([s, mean, gram])
    assert got_s.dtype == dtype
    exact = x.double().sum(1)
    # float32 partial sums rounded once (per processor, then summed): within 2 ulps of the exact sum
    ulp = torch.finfo(dtype).eps
    assert ((got_s.double() - exact).abs() / exact).max() <= 2 * ulp
    assert abs(got_mean.double().item() - x.double().mean().item()) / x.double().mean().item() <= 3 * ulp
    # einsum: torch.einsum on bfloat16/float16 accumulates in float32 (per processor), then one rounding
    exact_gram = (x.double() * x.double()).sum(1)
    assert ((got_gram.double() - exact_gram).abs() / exact_gram).max() <= 3 * ulp
    # a sequential low-precision accumulation would be far off: e.g. bf16 stalls once the sum is
    # 256x the addend; the check above excludes it
    naive = torch.zeros((), dtype=dtype)
    for v in x[0, :1024]:
        naive = naive + v
    assert abs(naive.double().item() - x[0, :1024].double().sum().item()) / x[0, :1024].double().sum().item() > 2 * ulp


def _mlp(x, labels, vdtype, hidden=32, classes=10, activation=mtf.relu):
    """act(x W1 + b1) W2 + b2 and the mean softmax cross-entropy; computed in vdtype's activation dtype."""
    h = mtf.layers.dense(mtf.cast(x, vdtype.activation_dtype), mtf.Dimension("hidden", hidden), activation=activation,
                         name="l1", variable_dtype=vdtype)
    logits = mtf.layers.dense(h, mtf.Dimension("classes", classes), name="l2", variable_dtype=vdtype)
    targets = mtf.one_hot(labels, mtf.Dimension("classes", classes), dtype=logits.dtype)
    loss = mtf.reduce_mean(mtf.layers.softmax_cross_entropy_with_logits(logits, targets, "classes"))
    return logits, loss


def _torch_mlp(params, x, labels):
    w1, b1, w2, b2 = params
    logits = torch.tanh(x @ w1 + b1) @ w2 + b2
    return logits, torch.nn.functional.cross_entropy(logits, labels)


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_bf16_mlp_matches_float32_reference(mesh_shape, layout):
    gen = torch.Generator().manual_seed(0)
    xv = torch.randn(8, 16, generator=gen)
    yv = torch.randint(0, 10, (8,), generator=gen)
    g = mtf.Graph(seed=1)
    mesh = mtf.Mesh(g)
    x = mtf.placeholder(mesh, "x", "batch:8,pixels:16")
    y = mtf.placeholder(mesh, "y", "batch:8", dtype=torch.int64)
    logits, loss = _mlp(x, y, BF16, activation=mtf.tanh)  # smooth: no relu kinks flipping under rounding
    variables = g.trainable_variables
    grads = mtf.gradients([loss], variables)
    update = mtf.optim.SgdOptimizer(0.5).apply_grads(grads, variables)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    params = [lw.variable_value(v).clone().requires_grad_(True) for v in variables]
    got = lw.run([logits, loss] + grads + update, feeds={x: xv, y: yv})
    ref_logits, ref_loss = _torch_mlp(params, xv, yv)
    ref_grads = torch.autograd.grad(ref_loss, params)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].float(), ref_logits.detach(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got[1].float(), ref_loss.detach(), rtol=2e-2, atol=2e-2)
    # bf16 has an 8-bit mantissa (relative rounding 2**-9): compare gradients by relative norm
    for v, gv, rv in zip(variables, got[2:6], ref_grads, strict=True):
        assert gv.dtype == torch.float32, v.name
        assert (gv - rv).norm() <= 2e-2 * rv.norm(), v.name
    # the update is applied to float32 master values
    for v, p, rv in zip(variables, params, ref_grads, strict=True):
        new = lw.variable_value(v)
        assert new.dtype == torch.float32
        assert (new - (p.detach() - 0.5 * rv)).norm() <= 0.5 * 2e-2 * rv.norm(), v.name


# Fashion-MNIST, float32 vs bfloat16 activations within one point after an epoch: test_mnist.py's
# test_bfloat16_activations_within_one_point_of_float32 (the MNIST model on rows:2;cols:2, batch:rows;hidden:cols).

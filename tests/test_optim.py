"""Optimizers under split layouts vs independent float64 references written from the papers, and vs torch.optim.

Gradients are fed through placeholders so the test controls them; variables are set with
``lowering.set_variable_value``; after 1 or 3 runs of the update ops the variables and slots are
read back with ``lowering.variable_value`` and compared (``meshtorch.testing.rel_error``).
"""

import math

import pytest
import torch

import meshtorch as mtf
from meshtorch.core.dims import convert_to_shape
from meshtorch.testing import rel_error

LAYOUTS = [
    ("", ""),
    ("all:4", "a:all"),
    ("all:4", "b:all"),
    ("all:4", "c:all"),
    ("rows:2;cols:2", "a:rows;b:cols"),
    ("rows:2;cols:2", "b:rows;c:cols"),
]
# w: factored (d0 = b, d1 = a); w3: factored with a third dim (d0 = b, d1 = a); u and bias: unfactored
SHAPES = {"w": "a:128,b:256", "w3": "c:4,b:256,a:128", "u": "b:256,c:8", "bias": "c:8"}
RTOL = 1e-6


def _params(seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return {n: (s, torch.randn(convert_to_shape(s).to_integer_list(), generator=gen)) for n, s in shapes.items()}


def _grads(params, steps, seed=1, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(v.shape, generator=gen) * scale for n, (_, v) in params.items()} for _ in range(steps)]


def run_optimizer(make_opt, params, grads_seq, mesh_shape, layout, initial_step=None, feeds=None):
    """Build variables + grad placeholders, run ``apply_grads`` once per entry of ``grads_seq``.

    Returns ({variable name: full value}, lowering, graph).
    """
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    names = list(params)
    vs = [mtf.get_variable(mesh, n, params[n][0], initializer=0.0) for n in names]
    phs = [mtf.placeholder(mesh, f"grad_{n}", params[n][0]) for n in names]
    opt, extra = make_opt(mesh)
    ops = opt.apply_grads(phs, vs)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    for n in names:
        lw.set_variable_value(n, params[n][1])
    if initial_step is not None:
        lw.set_variable_value("global_step", torch.tensor(initial_step))
    for grads in grads_seq:
        fd = {ph: grads[n] for ph, n in zip(phs, names, strict=True)}
        fd.update({extra[k]: v for k, v in (feeds or {}).items()})
        lw.run(ops, feeds=fd)
    return {n: lw.variable_value(n) for n in lw.variable_names}, lw, g


def _rms(x):
    return x.square().mean().sqrt()


# ------------------------------------------------------------------ Adafactor reference (paper + Mesh TF defaults)
def ref_adafactor(params, grads_seq, lr=None, beta1=0.0, step0=0, min_dim=128, scale_by_param=True):
    """Shazeer & Stern 2018, Alg. 4/5 with Mesh TF's choices, in float64 on full tensors.

    Factored: V_hat = R C / mean(R) with R, C running means of g^2 + eps1 over the largest / second
    largest dim; rho_t = 1 - t^-0.8 (t = step + 1); lr_t = min(0.01, 1/sqrt(t)); update clipping at RMS 1;
    relative step size max(eps2, RMS(w)).
    """
    w = {n: v.double().clone() for n, (_, v) in params.items()}
    sizes = {n: convert_to_shape(s).to_integer_list() for n, (s, _) in params.items()}
    slots = {}
    for k, grads in enumerate(grads_seq):
        t = step0 + k + 1
        rho = 1.0 - t ** -0.8
        rate = (min(0.01, t ** -0.5) * (1.0 if scale_by_param else 0.05)) if lr is None else lr
        for n in w:
            g = grads[n].double()
            g2 = g * g + 1e-30
            sz = sizes[n]
            order = sorted(range(len(sz)), key=lambda i: -sz[i])
            if len(sz) >= 2 and sz[order[1]] >= min_dim:
                i0, i1 = order[0], order[1]
                R = rho * slots.get(n + "_slot_vr", torch.zeros_like(g2.mean(i0, keepdim=True))) + \
                    (1 - rho) * g2.mean(i0, keepdim=True)
                C = rho * slots.get(n + "_slot_vc", torch.zeros_like(g2.mean(i1, keepdim=True))) + \
                    (1 - rho) * g2.mean(i1, keepdim=True)
                slots[n + "_slot_vr"], slots[n + "_slot_vc"] = R, C
                v_hat = R * C / R.mean(i1, keepdim=True)
            else:
                v_hat = rho * slots.get(n + "_slot_v", torch.zeros_like(g2)) + (1 - rho) * g2
                slots[n + "_slot_v"] = v_hat
            u = g / v_hat.sqrt()
            u = u / max(1.0, _rms(u).item())
            alpha = rate * (max(1e-3, _rms(w[n]).item()) if scale_by_param else 1.0)
            step = alpha * u
            if beta1:
                step = beta1 * slots.get(n + "_slot_m", torch.zeros_like(step)) + (1 - beta1) * step
                slots[n + "_slot_m"] = step
            w[n] = w[n] - step
    out = dict(w)
    for k, v in slots.items():  # drop the kept (size-1) reduced dims to get the slot's shape
        base = k.rsplit("_slot_", 1)[0]
        out[k] = v.reshape([s for i, s in enumerate(v.shape) if not (v.shape[i] == 1 and sizes[base][i] != 1)])
    return out


def _check_update(got, ref, params, where, steps):
    """The update itself (w - w0) agrees to 1e-6 relative, up to float32 rounding of the stored w (1 ulp a step)."""
    for n, (_, w0) in params.items():
        d_ref = ref[n] - w0.double()
        allowed = RTOL + steps * 2.0 ** -23 * ref[n].abs().max().item() / d_ref.abs().max().item()
        err = rel_error(got[n].double() - w0.double(), d_ref)
        assert err <= allowed, f"{where}: update of {n} relative error {err:.3g} > {allowed:.3g}"


def _compare(got, ref, names, where, rtol=RTOL):
    errs = {}
    for n in names:
        assert n in got, f"{where}: missing variable {n!r}; have {sorted(got)}"
        assert tuple(got[n].shape) == tuple(ref[n].shape), f"{where}: {n} shape {tuple(got[n].shape)}"
        errs[n] = rel_error(got[n], ref[n])
        assert errs[n] <= rtol, f"{where}: {n} relative error {errs[n]:.3g} > {rtol}"
    return errs


@pytest.mark.parametrize("beta1", [0.0, 0.9])
@pytest.mark.parametrize("lr", [None, 0.05])
@pytest.mark.parametrize("steps", [1, 3])
def test_adafactor_matches_reference(beta1, lr, steps):
    params = _params()
    grads = _grads(params, steps)
    ref = ref_adafactor(params, grads, lr=lr, beta1=beta1)
    slot_names = [n for n in ref if "_slot_" in n]
    assert {"w_slot_vr", "w_slot_vc", "w3_slot_vr", "u_slot_v", "bias_slot_v"} <= set(slot_names)
    assert ("w_slot_m" in slot_names) == bool(beta1)
    for mesh_shape, layout in LAYOUTS:
        def make(mesh):
            if lr is None and not beta1:
                return mtf.optim.AdafactorOptimizer(), {}  # Mesh TF defaults, no arguments
            return mtf.optim.AdafactorOptimizer(learning_rate=lr, beta1=beta1), {}
        got, lw, _ = run_optimizer(make, params, grads, mesh_shape, layout)
        where = f"adafactor beta1={beta1} lr={lr} steps={steps} {mesh_shape!r} {layout!r}"
        _compare(got, ref, list(params) + slot_names, where)
        _check_update(got, ref, params, where, steps)
        assert lw.variable_value("global_step").item() == steps


def test_adafactor_unscaled_tensor_lr_and_schedule_decay():
    """multiply_by_parameter_scale=False (lr default times 0.05), lr given as a fed scalar Tensor, decay as a float."""
    params = _params(shapes={"w": "a:128,b:256", "u": "b:256,c:8"})
    grads = _grads(params, 3)
    ref_default = ref_adafactor(params, grads, scale_by_param=False)
    for mesh_shape, layout in LAYOUTS[:2] + LAYOUTS[4:5]:
        got, _, _ = run_optimizer(lambda mesh: (mtf.optim.AdafactorOptimizer(multiply_by_parameter_scale=False), {}),
                                  params, grads, mesh_shape, layout)
        _compare(got, ref_default, ["w", "u"], f"unscaled {layout!r}")

        def make(mesh):
            lr = mtf.placeholder(mesh, "lr", [])
            return mtf.optim.AdafactorOptimizer(learning_rate=lr), {"lr": lr}
        got, _, _ = run_optimizer(make, params, grads, mesh_shape, layout, feeds={"lr": torch.tensor(0.02)})
        _compare(got, ref_adafactor(params, grads, lr=0.02), ["w", "u", "w_slot_vr"], f"tensor lr {layout!r}")


def test_adafactor_factored_dims_and_slot_layouts():
    opt = mtf.optim.AdafactorOptimizer()
    sh = convert_to_shape
    assert [d.name for d in opt.factored_dims(sh("a:128,b:256"))] == ["b", "a"]
    assert [d.name for d in opt.factored_dims(sh("a:128,b:128"))] == ["a", "b"]  # stable on ties
    assert opt.factored_dims(sh("a:127,b:256")) is None  # second largest below 128 (Mesh TF default)
    assert opt.factored_dims(sh("b:256,c:8")) is None
    assert opt.factored_dims(sh("b:256")) is None
    assert mtf.optim.AdafactorOptimizer(factored=False).factored_dims(sh("a:128,b:256")) is None
    params = _params()
    _, lw, g = run_optimizer(lambda mesh: (mtf.optim.AdafactorOptimizer(beta1=0.9), {}), params, _grads(params, 1),
                             "rows:2;cols:2", "a:rows;b:cols")
    byname = {v.name: v for v in g.all_variables}
    for n in params:
        p_layout = lw.tensor_layout(byname[n].value)
        p_axes = dict(zip(byname[n].shape.dimension_names, p_layout, strict=True))
        for sn, s in byname.items():
            if sn.startswith(n + "_slot_"):
                s_layout = lw.tensor_layout(s.value)
                if s.shape == byname[n].shape:
                    assert s_layout == p_layout, f"slot {sn} layout {s_layout} != {n} {p_layout}"
                else:
                    assert dict(zip(s.shape.dimension_names, s_layout, strict=True)) == \
                        {d: p_axes[d] for d in s.shape.dimension_names}, sn
                assert not s.trainable
    assert lw.tensor_layout(byname["w"].value) == mtf.TensorLayout([0, 1])
    assert lw.tensor_layout(byname["w_slot_vr"].value) == mtf.TensorLayout([0])  # [a] split on rows


# ------------------------------------------------------------------ Adam / AdamW
def ref_adam(params, grads_seq, lr, b1, b2, eps, wd, decoupled, step0=0):
    """Kingma & Ba 2015 Alg. 1 (bias-corrected); AdamW: Loshchilov & Hutter 2019 Alg. 2 (decay times lr)."""
    w = {n: v.double().clone() for n, (_, v) in params.items()}
    m = {n: torch.zeros_like(v) for n, v in w.items()}
    v2 = {n: torch.zeros_like(v) for n, v in w.items()}
    for k, grads in enumerate(grads_seq):
        t = step0 + k + 1
        for n in w:
            g = grads[n].double()
            if wd and not decoupled:
                g = g + wd * w[n]
            m[n] = b1 * m[n] + (1 - b1) * g
            v2[n] = b2 * v2[n] + (1 - b2) * g * g
            m_hat = m[n] / (1 - b1 ** t)
            v_hat = v2[n] / (1 - b2 ** t)
            if wd and decoupled:
                w[n] = w[n] - lr * wd * w[n]
            w[n] = w[n] - lr * m_hat / (v_hat.sqrt() + eps)
    out = dict(w)
    out.update({f"{n}/adam_m": x for n, x in m.items()})
    out.update({f"{n}/adam_v": x for n, x in v2.items()})
    return out


ADAM_SHAPES = {"w": "a:16,b:32", "u": "b:32,c:8", "bias": "c:8"}


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("steps", [1, 3])
def test_adam_matches_reference_and_torch(decoupled, steps):
    params = _params(shapes=ADAM_SHAPES)
    grads = _grads(params, steps)
    lr, b1, b2, eps, wd = 0.05, 0.8, 0.95, 1e-8, 0.1
    ref = ref_adam(params, grads, lr, b1, b2, eps, wd, decoupled)
    # torch.optim directly
    leaves = {n: v.clone().requires_grad_(True) for n, (_, v) in params.items()}
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    topt = cls(list(leaves.values()), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for gs in grads:
        for n, p in leaves.items():
            p.grad = gs[n].clone()
        topt.step()
    ocls = mtf.optim.AdamWOptimizer if decoupled else mtf.optim.AdamOptimizer
    for mesh_shape, layout in LAYOUTS:
        got, lw, g = run_optimizer(lambda mesh: (ocls(lr, b1, b2, eps, wd), {}), params, grads, mesh_shape, layout)
        where = f"{ocls.__name__} steps={steps} {mesh_shape!r} {layout!r}"
        _compare(got, ref, list(ref), where)
        for n, p in leaves.items():
            err = rel_error(got[n], p.detach())
            assert err <= RTOL, f"{where}: {n} vs torch.optim relative error {err:.3g}"
            st = topt.state[p]
            assert rel_error(got[f"{n}/adam_m"], st["exp_avg"]) <= RTOL
            assert rel_error(got[f"{n}/adam_v"], st["exp_avg_sq"]) <= RTOL
        byname = {v.name: v for v in g.all_variables}
        for n in params:
            for s in ("adam_m", "adam_v"):
                assert lw.tensor_layout(byname[f"{n}/{s}"].value) == lw.tensor_layout(byname[n].value)


def test_adam_resumes_from_global_step_and_schedule_lr():
    """Bias correction uses the checkpointed step (t = step + 1); lr from a schedule of the step."""
    params = _params(shapes={"w": "a:16,b:32"})
    grads = _grads(params, 2)
    sched = lambda s: mtf.optim.rsqrt_decay(s, warmup_steps=4, multiplier=0.1)  # noqa: E731
    for mesh_shape, layout in [("", ""), ("rows:2;cols:2", "a:rows;b:cols")]:
        got, lw, _ = run_optimizer(lambda mesh: (mtf.optim.AdamWOptimizer(sched, weight_decay=0.0), {}), params,
                                   grads, mesh_shape, layout, initial_step=7)
        # steps 7 and 8: lr = 0.1 / sqrt(max(step, 4))
        w = params["w"][1].double()
        m = v = torch.zeros_like(w)
        for k, gs in enumerate(grads):
            step = 7 + k
            g = gs["w"].double()
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            t = step + 1
            w = w - (0.1 / math.sqrt(max(step, 4))) * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
        assert rel_error(got["w"], w) <= RTOL
        assert lw.variable_value("global_step").item() == 9
        assert lw.variable_value("global_step").dtype == torch.int64


# ------------------------------------------------------------------ SGD / momentum vs torch.optim.SGD
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_momentum_vs_torch(momentum):
    params = _params(shapes=ADAM_SHAPES)
    grads = _grads(params, 3)
    leaves = {n: v.clone().requires_grad_(True) for n, (_, v) in params.items()}
    topt = torch.optim.SGD(list(leaves.values()), lr=0.1, momentum=momentum, weight_decay=0.01)
    for gs in grads:
        for n, p in leaves.items():
            p.grad = gs[n].clone()
        topt.step()

    def make(mesh):
        lr = mtf.placeholder(mesh, "lr", [])  # a scalar Tensor learning rate
        if momentum:
            return mtf.optim.MomentumOptimizer(lr, momentum, weight_decay=0.01), {"lr": lr}
        return mtf.optim.SgdOptimizer(lr, weight_decay=0.01), {"lr": lr}
    for mesh_shape, layout in LAYOUTS:
        got, _, _ = run_optimizer(make, params, grads, mesh_shape, layout, feeds={"lr": torch.tensor(0.1)})
        for n, p in leaves.items():
            err = rel_error(got[n], p.detach())
            assert err <= RTOL, f"{layout!r}: {n} vs torch.optim.SGD relative error {err:.3g}"


# ------------------------------------------------------------------ global step
def test_global_step_incremented_once_per_apply_grads():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    ws = [mtf.get_variable(mesh, f"w{i}", "a:4,b:8") for i in range(5)]
    phs = [mtf.placeholder(mesh, f"g{i}", "a:4,b:8") for i in range(5)]
    grads = list(phs)
    grads[2] = None  # skipped
    ops = mtf.optim.AdamOptimizer(0.1).apply_grads(grads, ws)
    step_var = [v for v in g.all_variables if v.name == "global_step"]
    assert len(step_var) == 1 and not step_var[0].trainable and step_var[0].shape.ndims == 0
    incs = [op for op in ops if step_var[0] in op.variables]
    assert len(incs) == 1
    assert mtf.optim.get_or_create_global_step(mesh) is step_var[0].value
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "a:all")})
    feeds = {p: torch.randn(4, 8) for i, p in enumerate(phs) if i != 2}
    for _ in range(3):
        lw.run(ops, feeds=feeds)
    assert lw.variable_value("global_step").item() == 3
    assert "w2/adam_m" not in lw.variable_names


def test_bad_hyperparameters_fail_at_graph_build():
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    w = mtf.get_variable(mesh, "w", "a:4,b:8")
    gr = mtf.placeholder(mesh, "gw", "a:4,b:8")
    with pytest.raises(ValueError, match="beta1"):
        mtf.optim.AdafactorOptimizer(beta1=1.0)
    with pytest.raises(ValueError, match="beta2"):
        mtf.optim.AdamOptimizer(beta2=1.5)
    with pytest.raises(ValueError, match="lr_vec.*scalar"):
        mtf.optim.SgdOptimizer(mtf.placeholder(mesh, "lr_vec", "a:4")).apply_grads([gr], [w])
    with pytest.raises(TypeError, match="learning_rate"):
        mtf.optim.SgdOptimizer("0.1").apply_grads([gr], [w])
    with pytest.raises(ValueError, match="'gv'.*'w'"):
        mtf.optim.AdamOptimizer().apply_grads([mtf.placeholder(mesh, "gv", "a:4,c:8")], [w])
    with pytest.raises(ValueError, match="2 gradients for 1"):
        mtf.optim.SgdOptimizer().apply_grads([gr, gr], [w])

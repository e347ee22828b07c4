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
from meshtorch.optim.foreach_adafactor import ForeachAdafactorGroupUpdate
from meshtorch.optim.fused import FusedAdamGroupUpdate, FusedAdamUpdate
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


def run_optimizer(make_opt, params, grads_seq, mesh_shape, layout, initial_step=None, feeds=None, mode="codegen"):
    """Build variables + grad placeholders, run ``apply_grads`` once per entry of ``grads_seq`` (executor ``mode``).

    Returns ({variable name: full value}, lowering, graph).
    """
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    names = list(params)
    vs = [mtf.get_variable(mesh, n, params[n][0], initializer=0.0) for n in names]
    phs = [mtf.placeholder(mesh, f"grad_{n}", params[n][0]) for n in names]
    opt, extra = make_opt(mesh)
    ops = opt.apply_grads(phs, vs)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}, mode=mode)
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
def ref_adafactor(params, grads_seq, lr=None, beta1=0.0, step0=0, min_dim=128, scale_by_param=True, factored=True,
                  clip=1.0):
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
            if factored and len(sz) >= 2 and sz[order[1]] >= min_dim:
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
            if clip is not None:
                u = u / max(1.0, _rms(u).item() / clip)
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


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("beta1", [0.0, 0.9])
@pytest.mark.parametrize("lr", [None, 0.05])
@pytest.mark.parametrize("steps", [1, 3])
def test_adafactor_matches_reference(beta1, lr, steps, fused):
    """Fused (FusedAdafactorUpdate: kernels + all-reduces of the statistics over split dims) and graph-op
    updates against the float64 reference, on every layout (factored dims split or whole)."""
    params = _params()
    grads = _grads(params, steps)
    ref = ref_adafactor(params, grads, lr=lr, beta1=beta1)
    slot_names = [n for n in ref if "_slot_" in n]
    assert {"w_slot_vr", "w_slot_vc", "w3_slot_vr", "u_slot_v", "bias_slot_v"} <= set(slot_names)
    assert ("w_slot_m" in slot_names) == bool(beta1)
    for mesh_shape, layout in LAYOUTS:
        def make(mesh):
            if lr is None and not beta1 and fused:
                return mtf.optim.AdafactorOptimizer(), {}  # Mesh TF defaults, no arguments
            return mtf.optim.AdafactorOptimizer(learning_rate=lr, beta1=beta1, fused=fused), {}
        got, lw, g = run_optimizer(make, params, grads, mesh_shape, layout)
        assert any(isinstance(op, ForeachAdafactorGroupUpdate) for op in g.operations) == fused
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


def test_adafactor_unfactored_unclipped_small_min_dim():
    params = _params(shapes={"w": "a:16,b:32", "u": "b:32,c:8"})
    grads = _grads(params, 3, scale=10.0)
    cases = [(dict(factored=False, clipping_threshold=None), dict(factored=False, clip=None)),
             (dict(min_dim_size_to_factor=8, clipping_threshold=0.5), dict(min_dim=8, clip=0.5))]
    for kw, ref_kw in cases:
        ref = ref_adafactor(params, grads, **ref_kw)
        for mesh_shape, layout in LAYOUTS[1:2] + LAYOUTS[4:]:
            got, _, _ = run_optimizer(lambda mesh, kw=kw: (mtf.optim.AdafactorOptimizer(**kw), {}), params, grads,
                                      mesh_shape, layout)
            _compare(got, ref, list(ref), f"{kw} {layout!r}")
        assert ("u_slot_vr" in ref) == (ref_kw.get("min_dim") == 8)


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
    """Kingma & Ba 2015 Alg. 1 (bias-corrected); AdamW: Loshchilov & Hutter 2019 Alg. 2 (decay times lr).
    ``lr``: a float or a function of the step count (``step0 + k`` before update ``k``)."""
    w = {n: v.double().clone() for n, (_, v) in params.items()}
    m = {n: torch.zeros_like(v) for n, v in w.items()}
    v2 = {n: torch.zeros_like(v) for n, v in w.items()}
    for k, grads in enumerate(grads_seq):
        t = step0 + k + 1
        lr_t = lr(step0 + k) if callable(lr) else lr  # a schedule of the step count before the update
        for n in w:
            g = grads[n].double()
            if wd and not decoupled:
                g = g + wd * w[n]
            m[n] = b1 * m[n] + (1 - b1) * g
            v2[n] = b2 * v2[n] + (1 - b2) * g * g
            m_hat = m[n] / (1 - b1 ** t)
            v_hat = v2[n] / (1 - b2 ** t)
            if wd and decoupled:
                w[n] = w[n] - lr_t * wd * w[n]
            w[n] = w[n] - lr_t * m_hat / (v_hat.sqrt() + eps)
    out = dict(w)
    out.update({f"{n}/adam_m": x for n, x in m.items()})
    out.update({f"{n}/adam_v": x for n, x in v2.items()})
    return out


ADAM_SHAPES = {"w": "a:16,b:32", "u": "b:32,c:8", "bias": "c:8"}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("steps", [1, 3])
def test_adam_matches_reference_and_torch(decoupled, steps, fused):
    """Graph-op (fused=False) and fused-kernel updates against the float64 formulas and torch.optim."""
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
        got, lw, g = run_optimizer(lambda mesh: (ocls(lr, b1, b2, eps, wd, fused=fused), {}), params, grads,
                                   mesh_shape, layout)
        assert any(isinstance(op, FusedAdamUpdate | FusedAdamGroupUpdate) for op in g.operations) == fused
        where = f"{ocls.__name__} fused={fused} steps={steps} {mesh_shape!r} {layout!r}"
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


@pytest.mark.parametrize("fused", [False, True])
def test_adam_resumes_from_global_step_and_schedule_lr(fused):
    """Bias correction uses the checkpointed step (t = step + 1); lr from a schedule of the step."""
    params = _params(shapes={"w": "a:16,b:32"})
    grads = _grads(params, 2)
    sched = lambda s: mtf.optim.rsqrt_decay(s, warmup_steps=4, multiplier=0.1)  # noqa: E731
    for mesh_shape, layout in [("", ""), ("rows:2;cols:2", "a:rows;b:cols")]:
        got, lw, _ = run_optimizer(lambda mesh: (mtf.optim.AdamWOptimizer(sched, weight_decay=0.0, fused=fused), {}),
                                   params, grads, mesh_shape, layout, initial_step=7)
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


@pytest.mark.slow
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw_schedule"])
def test_fused_adam_compiled_matches_reference(decoupled):
    """Under ``torch.compile`` the fused update runs as its formula (inductor cannot functionalize
    ``torch._fused_adamw_``); against the float64 formulas, weight decay on, the AdamW case with a
    scheduled (tensor) learning rate, on a 2x2 mesh; 1e-5 (the issue's compiled-vs-interpreted bound)."""
    params = _params(shapes=ADAM_SHAPES)
    grads = _grads(params, 3)
    b1, b2, eps, wd = 0.8, 0.95, 1e-8, 0.1
    if decoupled:
        lr = lambda s: mtf.optim.rsqrt_decay(s, warmup_steps=4, multiplier=0.1)  # noqa: E731
        make = lambda mesh: (mtf.optim.AdamWOptimizer(lr, b1, b2, eps, wd, fused=True), {})  # noqa: E731
    else:
        make = lambda mesh: (mtf.optim.AdamOptimizer(0.05, b1, b2, eps, wd, fused=True), {})  # noqa: E731
    got, lw, g = run_optimizer(make, params, grads, "rows:2;cols:2", "a:rows;b:cols", initial_step=7, mode="compile")
    assert any(isinstance(op, FusedAdamUpdate | FusedAdamGroupUpdate) for op in g.operations)
    assert lw.session.compile_seconds and all(lw.session.compile_seconds.values())  # it was compiled
    # steps 7, 8, 9; the schedule: lr = 0.1 / sqrt(max(step, 4))
    rate = (lambda step: 0.1 / math.sqrt(max(step, 4))) if decoupled else 0.05
    ref = ref_adam(params, grads, rate, b1, b2, eps, wd, decoupled, step0=7)
    _compare(got, ref, list(ref), f"compiled {'AdamW' if decoupled else 'Adam'}", rtol=1e-5)


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


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_schedule_on_float64_variables_vs_torch(momentum):
    """A schedule (a float32 Tensor of the step) drives float64 variables: cast per dtype, not a dtype error."""
    params = {n: (s, v.double()) for n, (s, v) in _params(shapes=ADAM_SHAPES).items()}
    grads = [{n: g.double() for n, g in gs.items()} for gs in _grads(params, 3)]
    leaves = {n: v.clone().requires_grad_(True) for n, (_, v) in params.items()}
    topt = torch.optim.SGD(list(leaves.values()), lr=0.3, momentum=momentum)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, lambda t: min(1.0, (t + 1) / 4))
    for gs in grads:
        for n, p in leaves.items():
            p.grad = gs[n].clone()
        topt.step()
        sched.step()

    lr = lambda step: mtf.optim.linear_warmup(step + 1.0, 4, 0.3)
    for mesh_shape, layout in LAYOUTS[:3]:
        g = mtf.Graph(seed=0)
        mesh = mtf.Mesh(g, "mesh")
        vs = [mtf.get_variable(mesh, n, s, initializer=0.0, dtype=torch.float64) for n, (s, _) in params.items()]
        phs = [mtf.placeholder(mesh, f"grad_{n}", s, dtype=torch.float64) for n, (s, _) in params.items()]
        opt = mtf.optim.MomentumOptimizer(lr, momentum) if momentum else mtf.optim.SgdOptimizer(lr)
        ops = opt.apply_grads(phs, vs)
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        for n, (_, v) in params.items():
            lw.set_variable_value(n, v)
        for gs in grads:
            lw.run(ops, feeds={ph: gs[n] for ph, n in zip(phs, params, strict=True)})
        for n, p in leaves.items():
            got = lw.variable_value(n)
            assert got.dtype == torch.float64
            # the schedule is float32 (as Mesh TF's step_num()): lr carries float32 rounding, ~1e-8
            assert rel_error(got, p.detach()) <= 1e-7, f"{layout!r}: {n}"


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


# ------------------------------------------------------------------ schedules
def _eval_schedules(fns, steps, mesh_shape="all:4", layout="a:all"):
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    step = mtf.placeholder(mesh, "step", [], dtype=torch.int64)
    outs = [f(mtf.cast(step, torch.float32)) for f in fns]
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    res = [[v.item() for v in lw.run(outs, feeds={step: torch.tensor(s)})] for s in steps]
    assert lw.counters.count() == 0  # scalar graph ops: no communication
    return res


def test_schedules_vs_formulas():
    steps = [0, 1, 5, 99, 100, 101, 500, 999, 1000, 1500]
    peak, warm, total, lo = 3e-4, 100, 1000, 1e-5
    fns = [
        lambda s: mtf.optim.constant_schedule(s, 0.25),
        lambda s: mtf.optim.linear_warmup(s, warm, peak),
        lambda s: mtf.optim.rsqrt_decay(s, warm),
        lambda s: mtf.optim.cosine_decay_with_warmup(s, peak, warm, total, lo),
        lambda s: mtf.optim.product_schedule(s, 2.0, lambda x: mtf.optim.linear_warmup(x, warm),
                                             lambda x: mtf.optim.truncated_rsqrt(x, warm)),
    ]

    def cosine(s):
        if s < warm:
            return peak * s / warm
        p = min(1.0, (s - warm) / (total - warm))
        return lo + (peak - lo) * 0.5 * (1 + math.cos(math.pi * p))
    formulas = [
        lambda s: 0.25,
        lambda s: peak * min(1.0, s / warm),
        lambda s: 1.0 / math.sqrt(max(s, warm)),
        cosine,
        lambda s: 2.0 * min(1.0, s / warm) / math.sqrt(max(s, warm)),
    ]
    for s, row in zip(steps, _eval_schedules(fns, steps), strict=True):
        for i, (got, f) in enumerate(zip(row, formulas, strict=True)):
            want = f(s)
            assert abs(got - want) <= 1e-6 * abs(want) + 1e-12, f"schedule {i} at step {s}: {got} vs {want}"
    # cosine after warmup equals torch's CosineAnnealingLR (eta_min = lo, T_max = total - warm)
    p = torch.nn.Parameter(torch.zeros(1))
    topt = torch.optim.SGD([p], lr=peak)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(topt, T_max=total - warm, eta_min=lo)
    torch_lrs = []
    for _ in range(total - warm + 1):
        torch_lrs.append(topt.param_groups[0]["lr"])
        topt.step()
        sched.step()
    ks = [0, 1, 37, 450, 899, 900]
    ours = _eval_schedules([fns[3]], [warm + k for k in ks], "", "")
    for k, row in zip(ks, ours, strict=True):
        assert abs(row[0] - torch_lrs[k]) <= 1e-6 * torch_lrs[k], (k, row[0], torch_lrs[k])
    with pytest.raises(ValueError, match="warmup_steps"):
        _eval_schedules([lambda s: mtf.optim.cosine_decay_with_warmup(s, 1.0, 10, 10)], [0])


def test_adafactor_default_schedules_follow_mesh_tf():
    """decay = 1 - (step + 1)^-0.8 and lr = min(0.01, rsqrt(step + 1)), step = global_step before increment."""
    opt = mtf.optim.AdafactorOptimizer()
    steps = [0, 1, 2, 9, 99, 9999, 10000]
    res = _eval_schedules([opt.decay_rate, mtf.optim.adafactor_decay_rate_adam(0.999)], steps)
    for s, (decay, adam_decay) in zip(steps, res, strict=True):
        want = 1.0 - (s + 1.0) ** -0.8
        assert abs(decay - want) <= 1e-6 * max(want, 1e-6) + 1e-7, (s, decay, want)
        t = s + 1.0
        want_adam = 0.999 * (1 - 0.999 ** (t - 1)) / (1 - 0.999 ** t)
        assert abs(adam_decay - want_adam) <= 1e-6 * max(want_adam, 1e-6) + 1e-7, (s, adam_decay, want_adam)
    g = mtf.Graph()
    mesh = mtf.Mesh(g)
    lr = opt.lr(mesh)
    step = mtf.optim.get_or_create_global_step(mesh)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    for s in steps:
        lw.set_variable_value(step, torch.tensor(s))
        assert abs(lw.run(lr).item() - min(0.01, (s + 1) ** -0.5)) <= 1e-8


# ------------------------------------------------------------------ global-norm clipping
CLIP_SHAPES = {"w": "a:16,b:32", "u": "b:32,c:8", "bias": "c:8", "v": "d:4"}
CLIP_LAYOUTS = LAYOUTS + [("rows:2;cols:2", "a:rows;c:cols"), ("all:4", "d:all")]


@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_by_global_norm_vs_torch(max_norm):
    params = _params(shapes=CLIP_SHAPES)
    grads = _grads(params, 1, seed=3)[0]
    leaves = [v.clone().requires_grad_(True) for _, v in params.values()]
    for p, n in zip(leaves, params, strict=True):
        p.grad = grads[n].clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(leaves, max_norm)
    for mesh_shape, layout in CLIP_LAYOUTS:
        g = mtf.Graph()
        mesh = mtf.Mesh(g)
        phs = {n: mtf.placeholder(mesh, n, s) for n, (s, _) in params.items()}
        clipped, norm = mtf.optim.clip_by_global_norm([phs["w"], None, phs["u"], phs["bias"], phs["v"]], max_norm)
        assert clipped[1] is None
        clipped = [c for c in clipped if c is not None]
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        fetch = [norm] + clipped
        out = lw.run(fetch, feeds={phs[n]: grads[n] for n in params})
        where = f"max_norm={max_norm} {mesh_shape!r} {layout!r}"
        assert rel_error(out[0], torch_norm) <= RTOL, f"{where}: norm {out[0]} vs {torch_norm}"
        for got, n in zip(out[1:], ["w", "u", "bias", "v"], strict=True):
            p = leaves[list(params).index(n)]
            assert rel_error(got, p.grad) <= RTOL, f"{where}: clipped {n}"
        # the squared norm costs one all-reduce, over the union of the gradients' split axes
        c = lw.plan_counters([norm])
        want = 0 if mesh_shape == "" else 1
        assert c.count("allreduce") == want, f"{where}: {c.summary()}"
        if want:
            (rec, n_rec), = c.collectives("allreduce")
            assert rec.op.startswith("global_sum_of_squares") and rec.bytes_per_processor == 4


def test_clip_inside_training_step_counts():
    """Clipping the gradients of a data+model parallel step adds exactly one scalar all-reduce."""
    def build():
        g = mtf.Graph()
        mesh = mtf.Mesh(g)
        x = mtf.placeholder(mesh, "x", "batch:8,io:16")
        w1 = mtf.get_variable(mesh, "w1", "io:16,hidden:32")
        w2 = mtf.get_variable(mesh, "w2", "hidden:32,io:16")
        h = mtf.relu(mtf.einsum([x, w1], output_shape="batch:8,hidden:32"))
        y = mtf.einsum([h, w2], output_shape="batch:8,io:16")
        loss = mtf.reduce_mean(mtf.square(y - x))
        grads = mtf.gradients([loss], [w1, w2])
        return g, mesh, x, loss, grads, [w1, w2]
    counts, deltas, norms = [], [], []
    for clip in (False, True):
        g, mesh, x, loss, grads, ws = build()
        norm = mtf.optim.global_norm(grads)
        if clip:
            grads, _ = mtf.optim.clip_by_global_norm(grads, 0.01)
        ops = mtf.optim.SgdOptimizer(0.1).apply_grads(grads, ws)
        lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "batch:rows;hidden:cols")})
        counts.append(lw.plan_counters([loss] + ops).count("allreduce"))
        xv = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        w0 = [lw.variable_value(n) for n in ("w1", "w2")]
        out = lw.run([norm, loss] + ops, feeds={x: xv})
        norms.append(out[0].item())
        deltas.append([lw.variable_value(n) - v0 for n, v0 in zip(("w1", "w2"), w0, strict=True)])
    assert counts[1] == counts[0] + 1, counts
    assert norms[0] > 0.01 and abs(norms[0] - norms[1]) <= 1e-6 * norms[0]
    coef = 0.01 / (norms[0] + 1e-6)
    for d_plain, d_clip in zip(*deltas, strict=True):
        assert rel_error(d_clip, d_plain * coef) <= 1e-3  # w is stored in float32: deltas ~1e-5 of w

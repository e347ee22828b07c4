"""``mtf.optimize`` (Mesh TF's optimizer module names): updates vs NumPy transcriptions of
mesh_tensorflow/optimize.py, under a 1-D and a 2-D layout."""

import types

import numpy as np
import pytest
import torch

import meshtorch as mtf
from meshtorch.core.dims import convert_to_shape
from meshtorch.testing import rel_error

LAYOUTS = [("", ""), ("all:4", "b:all"), ("rows:2;cols:2", "b:rows;c:cols")]
SHAPES = {"w": "b:8,c:4", "u": "b:8,c:4,d:2", "bias": "c:4"}


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(convert_to_shape(s).to_integer_list(), generator=gen, dtype=torch.float64).float()
            for n, s in SHAPES.items()}


def _grads(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(convert_to_shape(s).to_integer_list(), generator=gen) for n, s in SHAPES.items()}
            for _ in range(steps)]


def _run(opt, params, grads_seq, mesh_shape, layout):
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    vs = [mtf.get_variable(mesh, n, s, initializer=0.0) for n, s in SHAPES.items()]
    phs = [mtf.placeholder(mesh, f"grad_{n}", s) for n, s in SHAPES.items()]
    ops = opt.apply_grads(phs, vs)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    for n, v in params.items():
        lw.set_variable_value(n, v)
    for grads in grads_seq:
        lw.run(ops, feeds={ph: grads[n] for ph, n in zip(phs, SHAPES, strict=True)})
    return {n: lw.variable_value(n) for n in lw.variable_names}


def _np_adam_weight_decay(params, grads_seq, lr_of, wd, exclude, b1=0.9, b2=0.999, eps=1e-6):
    """mesh_tensorflow/optimize.py AdamWeightDecayOptimizer.apply_grad, in float64 NumPy."""
    w = {n: v.double().numpy().copy() for n, v in params.items()}
    m = {n: np.zeros_like(v) for n, v in w.items()}
    v2 = {n: np.zeros_like(v) for n, v in w.items()}
    for step, grads in enumerate(grads_seq):
        for n in w:
            g = grads[n].double().numpy()
            m[n] = b1 * m[n] + (1 - b1) * g
            v2[n] = b2 * v2[n] + (1 - b2) * g * g
            update = m[n] / (np.sqrt(v2[n]) + eps)
            if wd and not any(e in n for e in exclude):
                update = update + wd * w[n]
            w[n] = w[n] - lr_of(n, step) * update
    return w, m, v2


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_adam_weight_decay_matches_mesh_tf_formula(mesh_shape, layout):
    params, grads = _params(), _grads(3)
    opt = mtf.optimize.AdamWeightDecayOptimizer(0.05, weight_decay_rate=0.1, exclude_from_weight_decay=["bias"])
    got = _run(opt, params, grads, mesh_shape, layout)
    w, m, v = _np_adam_weight_decay(params, grads, lambda n, s: 0.05, 0.1, ["bias"])
    for n in SHAPES:
        assert rel_error(got[n], torch.from_numpy(w[n])) < 1e-5, n
        assert rel_error(got[f"{n}/adam_m"], torch.from_numpy(m[n])) < 1e-5
        assert rel_error(got[f"{n}/adam_v"], torch.from_numpy(v[n])) < 1e-5


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS[1:])
def test_adam_with_multi_lr_schedule_routes_by_regex(mesh_shape, layout):
    params, grads = _params(), _grads(3)
    # u uses 0.5 * (step + 1) / 10 (Mesh TF's factor list: numbers and f(step, total_train_steps)); others 0.01
    alt = mtf.optimize.compute_lr_for_step([[0.5, lambda step, total: (step + 1.0) / total]], 0.01, train_steps=10)
    opt = mtf.optimize.AdamWithMultiLRSchedule(variable_search=["^u$"], alt_lr_schedules=alt, learning_rate=0.01)
    got = _run(opt, params, grads, mesh_shape, layout)
    w, _, _ = _np_adam_weight_decay(params, grads, lambda n, s: 0.5 * (s + 1) / 10 if n == "u" else 0.01, 0.0, [])
    for n in SHAPES:
        assert rel_error(got[n], torch.from_numpy(w[n])) < 1e-5, n


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_mesh_tf_momentum_folds_the_rate_into_v(mesh_shape, layout):
    params, grads = _params(), _grads(3)
    opt = mtf.optimize.MomentumOptimizer(lambda step: (step + 1.0) * 0.1, 0.9)
    got = _run(opt, params, grads, mesh_shape, layout)
    for n in SHAPES:
        w, v = params[n].double().numpy().copy(), 0.0
        for step, g in enumerate(grads):
            v = g[n].double().numpy() * (step + 1) * 0.1 + 0.9 * v
            w = w - v
        assert rel_error(got[n], torch.from_numpy(w)) < 1e-5
        assert rel_error(got[f"{n}_momentum_v"], torch.from_numpy(v)) < 1e-5


def _torch_sgd_momentum(params, grads_seq, lr_of_step, momentum=0.9):
    """``torch.optim.SGD(momentum=m)`` on copies of the parameters (float64), the rate set per step."""
    ws = {n: v.double().clone().requires_grad_(True) for n, v in params.items()}
    opt = torch.optim.SGD(list(ws.values()), lr=lr_of_step(0), momentum=momentum)
    for step, grads in enumerate(grads_seq):
        for group in opt.param_groups:
            group["lr"] = lr_of_step(step)
        for n, w in ws.items():
            w.grad = grads[n].double()
        opt.step()
    return {n: w.detach() for n, w in ws.items()}


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_both_momentum_optimizers_are_torch_s_sgd_momentum_at_a_constant_rate(mesh_shape, layout):
    """mtf.optim's (torch's form) and mtf.optimize's (Mesh TF's, the rate folded into v) momentum are one
    implementation; at a constant rate both equal torch.optim.SGD(momentum=0.9); under a schedule torch's
    form still does and Mesh TF's does not (its v keeps the old rates)."""
    params, grads = _params(), _grads(3)
    want = _torch_sgd_momentum(params, grads, lambda step: 0.1)
    for opt in (mtf.optim.MomentumOptimizer(0.1, 0.9), mtf.optimize.MomentumOptimizer(0.1, 0.9)):
        got = _run(opt, params, grads, mesh_shape, layout)
        for n in SHAPES:
            assert rel_error(got[n], want[n]) < 1e-5, (type(opt).__name__, n)
    schedule = lambda step: (step + 1.0) * 0.1  # noqa: E731
    want = _torch_sgd_momentum(params, grads, schedule)
    got = _run(mtf.optim.MomentumOptimizer(schedule, 0.9), params, grads, mesh_shape, layout)
    folded = _run(mtf.optimize.MomentumOptimizer(schedule, 0.9), params, grads, mesh_shape, layout)
    for n in SHAPES:
        assert rel_error(got[n], want[n]) < 1e-5, n
        assert rel_error(folded[n], want[n]) > 1e-3, n
    assert isinstance(mtf.optimize.MomentumOptimizer(0.1, 0.9), mtf.optim.MomentumOptimizer)


def _np_adafactor_step(w, g, step, stacked_axes, param_scale, lr=None, eps1=1e-30, eps2=1e-3):
    """One unfactored Adafactor update of mesh_tensorflow/optimize.py from zero slots (float64)."""
    decay = 1.0 - (step + 1.0) ** -0.8
    v = (g * g + eps1) * (1.0 - decay)
    x = g / np.sqrt(v)
    x = x / max(1.0, np.sqrt((x * x).mean()))
    lr = min(0.01, 1.0 / np.sqrt(step + 1.0)) if lr is None else lr
    if param_scale:
        axes = tuple(i for i in range(w.ndim) if i not in stacked_axes)
        scale = np.maximum(np.sqrt((w * w).mean(axis=axes, keepdims=True)), eps2) * lr
    else:
        scale = lr
    return w - x * scale


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_adafactor_stacked_dims_and_parameter_scale_exclusion(mesh_shape, layout):
    params, grads = _params(), _grads(1)
    opt = mtf.optimize.AdafactorOptimizer(stacked_dim_names=["d"], exclude_from_parameter_scale=["bias"])
    got = _run(opt, params, grads, mesh_shape, layout)
    for n, stacked, scale in [("w", (), True), ("u", (2,), True), ("bias", (), False)]:
        want = _np_adafactor_step(params[n].double().numpy(), grads[0][n].double().numpy(), 0, stacked, scale)
        assert rel_error(got[n], torch.from_numpy(want)) < 1e-5, n


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS[1:])
def test_adafactor_with_multi_lr_schedule(mesh_shape, layout):
    params, grads = _params(), _grads(1)
    opt = mtf.optimize.AdafactorWithMultiLRSchedule(variable_search=["^w$"], alt_lr_schedules=[0.2],
                                                    multiply_by_parameter_scale=False)
    got = _run(opt, params, grads, mesh_shape, layout)
    for n in SHAPES:
        # without parameter scale Mesh TF's default rate is min(0.01, rsqrt(step + 1)) * 0.05
        lr = 0.2 if n == "w" else 0.01 * 0.05
        want = _np_adafactor_step(params[n].double().numpy(), grads[0][n].double().numpy(), 0, (), False, lr=lr)
        assert rel_error(got[n], torch.from_numpy(want)) < 1e-5, n


def test_factories_and_schedules():
    hp = types.SimpleNamespace(optimizer="Adafactor", optimizer_adafactor_decay_type="pow",
                               optimizer_adafactor_memory_exponent=0.5, optimizer_adafactor_beta2=0.99,
                               optimizer_adafactor_multiply_by_parameter_scale=False, optimizer_adafactor_beta1=0.0,
                               optimizer_adafactor_clipping_threshold=2.0, optimizer_adafactor_factored=False)
    opt = mtf.optimize.make_optimizer(hp, 0.3)
    assert isinstance(opt, mtf.optimize.AdafactorOptimizer)
    assert (opt.learning_rate, opt.clipping_threshold, opt.factored, opt.multiply_by_parameter_scale) == (
        0.3, 2.0, False, False)
    assert opt.decay_rate(3.0) == pytest.approx(1.0 - 4.0 ** -0.5)
    assert isinstance(mtf.optimize.make_optimizer(types.SimpleNamespace(optimizer="SGD"), 0.1),
                      mtf.optimize.SgdOptimizer)
    with pytest.raises(ValueError, match="Unknown Optimizer"):
        mtf.optimize.make_optimizer(types.SimpleNamespace(optimizer="Lion"), 0.1)
    with pytest.raises(ValueError, match="decay_type"):
        mtf.optimize.adafactor_optimizer_from_hparams(types.SimpleNamespace(optimizer_adafactor_decay_type="x"), 1)
    assert mtf.optimize.adafactor_decay_rate_pow(0.8, offset=10)(12.0) == pytest.approx(1.0 - 3.0 ** -0.8)
    f = lambda step, total: step / total  # noqa: E731
    assert mtf.optimize.product_learning_rate(30, 110, factors=[2.0, f], offset=10) == pytest.approx(2.0 * 20 / 100)
    with pytest.raises(ValueError, match="factors"):
        mtf.optimize.product_learning_rate(1, 10)
    assert mtf.optimize.compute_lr_for_step([None], 0.7) == [0.7]
    assert mtf.optim.MomentumOptimizer is not mtf.optimize.MomentumOptimizer  # torch's vs Mesh TF's update

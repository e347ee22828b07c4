"""Replicated values on the placement mesh: processors holding the same slice share one tensor, and a
kernel whose inputs are all shared runs once for every processor (codegen and interpreter alike).

Reference: the same LM step on one processor (plain layout), and the unshared behaviour (results must
not depend on sharing: a kernel is a pure function of its inputs).
"""

from __future__ import annotations

import pytest
import torch

import meshtorch as mtf
from meshtorch.models.transformer import build_lm, preset
from meshtorch.testing import rel_error

CFG = preset("tiny", vocab_size=32, d_model=16, num_heads=4, d_kv=4, d_ff=32, num_layers=1, length=8, batch_size=4)
TP = "heads:all;d_ff:all;vocab:all"


def _step(layout, mode, steps=3):
    lm = build_lm(CFG, seed=0, optimizer=mtf.optim.AdafactorOptimizer())
    impl = mtf.PlacementMeshImpl("all:4" if layout else "", layout)
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl}, mode=mode)
    ids = torch.randint(0, CFG.vocab_size, (CFG.batch_size, CFG.length + 1), generator=torch.Generator().manual_seed(1))
    losses = [lw.run([lm.loss] + lm.updates, feeds={lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})[0].item()
              for _ in range(steps)]
    return lw, losses


@pytest.mark.parametrize("mode", ["codegen", "interpret"])
def test_replicated_variables_stay_shared_and_results_match_one_processor(mode):
    lw, losses = _step(TP, mode)
    ref, ref_losses = _step("", mode)
    store = lw.session.store
    shared = [n for n in store.names if all(t is store.values[n][0] for t in store.values[n])]
    replicated = [n for n in store.names if all(a is None for a in store.layout(n))]
    assert replicated and set(replicated) <= set(shared)  # e.g. the norms' scales and their slots, after updates
    split = [n for n in store.names if any(a is not None for a in store.layout(n))]
    assert split and not set(split) & set(shared)  # slices of a split variable are never shared
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-6
    for n in ref.variable_names:
        assert rel_error(lw.variable_value(n), ref.variable_value(n)) <= 1e-5, n


@pytest.mark.parametrize("mode", ["codegen", "interpret"])
def test_a_kernel_on_shared_inputs_runs_once(mode):
    calls = []

    def counted(x):
        calls.append(x.shape)
        return torch.tanh(x)
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    b, h = mtf.Dimension("b", 4), mtf.Dimension("h", 8)
    x = mtf.placeholder(mesh, "x", [b, h])
    y = mtf.slicewise(counted, [x], name="counted")
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "")}, mode=mode)  # x replicated
    xv = torch.randn(4, 8)
    torch.testing.assert_close(lw.run(y, feeds={x: xv}), torch.tanh(xv))
    assert len(calls) == 1
    calls.clear()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "b:all")}, mode=mode)  # x split: one call each
    torch.testing.assert_close(lw.run(y, feeds={x: xv}), torch.tanh(xv))
    assert len(calls) == 4


def test_share_replicas_compares_values_not_just_identity():
    impl = mtf.PlacementMeshImpl("rows:2;cols:2", "")
    a, b, c = torch.ones(3), torch.ones(3), torch.zeros(3)
    out = impl.share_replicas([a, b, c, a.clone()])
    assert out[1] is a and out[2] is c and out[3] is a
    lay = mtf.TensorLayout([0])  # split over rows: processors 0, 1 hold one slice, 2, 3 the other
    out = impl.share_replicas([a, b, b.clone(), c], lay)
    assert out[1] is a and out[2] is not a and out[3] is c

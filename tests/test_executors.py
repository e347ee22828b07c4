"""The three executors of a program give the same numbers: the step interpreter, the generated
straight-line function (default) and that function through torch.compile."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mtf
from _program_data import batch, mlp_step
from meshtorch.testing import rel_error

LAYOUTS = [("", ""), ("all:4", "batch:all"), ("rows:2;cols:2", "batch:rows;hidden:cols")]


def _train(mesh_shape, layout, mode, steps=3, storage=None):
    g, mesh, x, ws, loss, grads, updates = mlp_step()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)}, mode=mode)
    out = [lw.run([loss, *grads] + updates, feeds={x: batch(s)})[:3] for s in range(steps)]
    return out, {n: lw.variable_value(n) for n in ("w1", "w2")}, lw


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_generated_function_equals_the_interpreter_bitwise(mesh_shape, layout):
    a, va, lwa = _train(mesh_shape, layout, "codegen")
    b, vb, lwb = _train(mesh_shape, layout, "interpret")
    for s in range(len(a)):
        assert all(torch.equal(x, y) for x, y in zip(a[s], b[s], strict=True)), s
    assert all(torch.equal(va[n], vb[n]) for n in va)
    assert dict(lwa.counters.records) == dict(lwb.counters.records)
    assert lwa.plan([]).fn is None  # nothing fetched, nothing generated


def test_generated_function_unrolls_processors_on_the_placement_mesh():
    g, mesh, x, ws, loss, grads, updates = mlp_step()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "batch:all")})
    lw.run([loss], feeds={x: batch(0)})
    src = lw.plan([loss]).fn.source
    # one kernel call per processor (p0..p3) for a slicewise step; the all-reduce sees the list of slices
    assert all(f"_{p} = k" in src for p in range(4)) and "= f" in src and "_4 = k" not in src


@pytest.mark.parametrize("mesh_shape,layout,storage", [("", "", None), ("rows:2;cols:2", "batch:rows;hidden:cols",
                                                                          "io:rows")])
def test_compiled_equals_interpreted(mesh_shape, layout, storage):
    a, va, lwa = _train(mesh_shape, layout, "compile", steps=4, storage=storage)
    b, vb, _ = _train(mesh_shape, layout, "interpret", steps=4, storage=storage)
    for s in range(len(a)):
        for x, y in zip(a[s], b[s], strict=True):
            assert rel_error(x, y) <= 1e-5, s
    assert all(rel_error(va[n], vb[n]) <= 1e-5 for n in va)
    assert len(lwa.session.compile_seconds) == 1 and next(iter(lwa.session.compile_seconds.values())) > 0


def test_unknown_mode_is_refused_before_planning():
    g, mesh, *_ = mlp_step()
    with pytest.raises(ValueError, match="mode must be"):
        mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}, mode="fast")

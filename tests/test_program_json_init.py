"""A program read back from JSON runs with its variables initialised from their initializers (issue 25):
the same initial values as the Lowering that planned it (and as an unsplit 1-processor Lowering: the
draws are counter-based), in both executors, on placement meshes and on 2 gloo ranks; a variable whose
initializer is not plain data has no value and a run reading it names it."""

from __future__ import annotations

import os

import pytest
import torch

import meshtorch as mtf
from _program_data import batch, init_graph
from meshtorch.core.errors import FeedError
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
NAMES = ["w1", "w2", "w3", "b", "s"]


def _reference():
    """Initial values and loss of the unsplit graph, and the loss recomputed in plain PyTorch from them."""
    g, mesh, x, loss = init_graph()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    v = {n: lw.variable_value(n) for n in NAMES}
    xb = batch(0)
    h = torch.relu(xb @ v["w1"] * v["s"] + v["w3"])
    want = ((h @ v["w2"] + v["b"] - xb) ** 2).mean()
    assert torch.allclose(lw.run(loss, feeds={x: xb}), want, rtol=1e-5)
    assert torch.all(v["b"] == 0.25) and torch.all(v["s"] == 1.0)
    return v, want


@pytest.mark.parametrize("mesh_shape, layout", [("", ""), ("all:4", "hidden:all"),
                                                ("rows:2,cols:2", "batch:rows;io:cols")])
@pytest.mark.parametrize("mode", ["codegen", "interpret"])
def test_json_program_initialises_its_variables(mesh_shape, layout, mode):
    ref, want = _reference()
    g, mesh, x, loss = init_graph()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    text = lw.to_json([loss])
    program = mtf.Program.from_json(text)
    impls = {"mesh": mtf.PlacementMeshImpl(mesh_shape, layout)}
    store = mtf.VariableStore(program, impls)  # as docs/lowering.md shows: no set_value needed
    for n in NAMES:
        assert torch.equal(store.value(n), lw.variable_value(n)), n  # the original lowering's values
        assert torch.equal(store.value(n), ref[n]), n  # and the unsplit graph's
    session = mtf.Session(program, impls, store, mode)
    got = session.run((("tensor", loss.name),), {"x": batch(0)})[0]
    assert torch.allclose(got, want, rtol=1e-5)


def test_json_program_on_two_gloo_ranks_initialises_its_variables():
    ref, want = _reference()
    g, mesh, x, loss = init_graph()
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "hidden:all")})
    text = lw.to_json([loss])
    for mode in ("codegen", "interpret"):
        run = run_spmd("_program_data:spmd_json_init_worker", args=(text, loss.name, "all:2", "hidden:all",
                                                                    mode), nprocs=2, extra_path=[TESTS_DIR]).check()
        for values, got in run.results:
            for n in NAMES:
                assert torch.equal(values[n], ref[n]), (mode, n)
            assert torch.allclose(got, want, rtol=1e-5), mode


def test_variable_whose_initializer_is_lost_in_json_is_named():
    g, mesh, x, loss = init_graph(lost=True)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")})
    text = lw.to_json([loss])
    program = mtf.Program.from_json(text)
    impls = {"mesh": mtf.PlacementMeshImpl("", "")}
    store = mtf.VariableStore(program, impls)
    session = mtf.Session(program, impls, store)
    with pytest.raises(FeedError, match=r"Variable 'half'.*has no value.*set_value"):
        session.run((("tensor", loss.name),), {"x": batch(0)})
    store.set_value("half", lw.variable_value("half"))
    got = session.run((("tensor", loss.name),), {"x": batch(0)})[0]
    assert torch.equal(got, lw.run(loss, feeds={x: batch(0)}))

"""Storage layouts propagated from ``mtf.assign`` (issue 21): a hand-written update in Mesh TF's style
runs on the variable's shards, and its gradient is reduce-scattered, not all-reduced."""

import pytest
import torch

import meshtorch as mtf


def _readme_mnist(lr=0.1):
    """The README's MNIST model with Mesh TF's README update: ``mtf.assign(w, w - lr * g)``."""
    graph = mtf.Graph(seed=0)
    mesh = mtf.Mesh(graph, "mesh")
    batch, io, hidden = mtf.Dimension("batch", 64), mtf.Dimension("io", 32), mtf.Dimension("hidden", 128)
    x = mtf.placeholder(mesh, "x", [batch, io])
    w1 = mtf.get_variable(mesh, "w1", [io, hidden])
    w2 = mtf.get_variable(mesh, "w2", [hidden, io])
    y = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[batch, hidden])), w2], output_shape=[batch, io])
    loss = mtf.reduce_mean(mtf.square(y - x))
    grads = mtf.gradients([loss], [w1, w2])
    updates = [mtf.assign(w, w - lr * g) for w, g in zip([w1, w2], grads, strict=True)]
    return graph, mesh, x, loss, grads, updates


def _losses(impl, steps=3):
    graph, mesh, x, loss, grads, updates = _readme_mnist()
    lw = mtf.Lowering(graph, {mesh: impl})
    gen = torch.Generator().manual_seed(0)
    losses = [lw.run([loss] + updates, feeds={x: torch.randn(64, 32, generator=gen)})[0].item()
              for _ in range(steps)]
    return losses, lw.counters, grads


@pytest.mark.parametrize("mesh_shape,layout,storage", [("all:4", "batch:all", "hidden:all"),
                                                       ("rows:2;cols:2", "batch:rows;hidden:cols", "io:rows")])
def test_hand_written_update_reduce_scatters_gradients_under_storage(mesh_shape, layout, storage):
    want, plain, grads = _losses(mtf.PlacementMeshImpl(mesh_shape, layout))
    got, counters, grads = _losses(mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    recs = counters.records
    for g in grads:
        assert [n for c, n in recs.items() if c.kind == "reduce_scatter" and c.tensor == g.name] == [3], g.name
        assert not [c for c in recs if c.kind == "allreduce" and c.tensor == g.name], g.name
    # without storage rules the same gradients are all-reduced over the batch axis (the test can tell)
    assert [c for c in plain.records if c.kind == "allreduce" and c.tensor in {g.name for g in grads}]


def test_update_read_by_a_forward_op_is_not_moved():
    """An elementwise op another (compute-side) op also reads keeps its compute layout."""
    graph, mesh, x, loss, grads, updates = _readme_mnist()
    scaled = 0.1 * grads[0]
    mtf.reduce_sum(scaled)  # a compute-side reader
    new = graph.name_to_variable["w1"].outputs[0] - scaled
    mtf.assign(graph.name_to_variable["w1"], new)
    assert new.operation.storage_side and not scaled.operation.storage_side

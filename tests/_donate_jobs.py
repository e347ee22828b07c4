"""Jobs of tests/test_donate_reductions.py, importable inside the gloo processes (run_spmd workers)."""

from __future__ import annotations

import torch

import meshtorch as mtf


def _mlp(x_val, y_val):
    """A two-layer MLP (batch split over the mesh: its weight gradients are partial sums), SGD updates."""
    g = mtf.Graph(seed=1)
    mesh = mtf.Mesh(g, "m")
    x = mtf.import_tensor(mesh, x_val, "batch:8,a:8")
    y = mtf.import_tensor(mesh, y_val, "batch:8,b:4")
    w1 = mtf.get_variable(mesh, "w1", "a:8,h:8")
    w2 = mtf.get_variable(mesh, "w2", "h:8,b:4")
    out = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape="batch:8,h:8")), w2], output_shape="batch:8,b:4")
    loss = mtf.reduce_mean(mtf.square(out - y))
    grads = mtf.gradients([loss], [w1.operation.outputs[0], w2.operation.outputs[0]])
    updates = mtf.optim.SgdOptimizer(0.1).apply_grads(grads, [w1.operation, w2.operation])
    return g, mesh, loss, grads, updates


def donated_allreduce_job(fetch_grad: bool) -> dict:
    """On 2 gloo ranks (``batch:all``, no buckets): 3 SGD steps; for each all-reduce call whether it summed
    in its input's buffer (``owned``, and the output's ``data_ptr`` equal to the input's), the losses, the
    fetched gradient of w2 (``fetch_grad``: then it is a result of the run and must not be donated) and the
    final weights."""
    torch.manual_seed(0)
    x_val, y_val = torch.randn(8, 8), torch.randn(8, 4)
    g, mesh, loss, grads, updates = _mlp(x_val, y_val)
    doubled = grads[1] * 2.0
    impl = mtf.SpmdMeshImpl("all:2", "batch:all")
    calls = []
    inner = impl.collectives.all_reduce

    def spy(t, reduction, group, owned):
        work, out = inner(t, reduction, group, owned)
        calls.append((tuple(t.shape), owned, out.data_ptr() == t.data_ptr()))
        return work, out
    impl.collectives.all_reduce = spy
    lw = mtf.Lowering(g, {mesh: impl}, bucket_bytes=0)
    # fetch_grad: w2's gradient and twice it: the doubling (linear) reads the partial sum too, so its
    # all-reduce may not sum in that buffer
    fetches = [loss] + ([grads[1], doubled] if fetch_grad else []) + updates
    out = {"losses": [], "grads": []}
    for _ in range(3):
        res = lw.run(fetches)
        out["losses"].append(float(res[0]))
        if fetch_grad:
            out["grads"].append((res[1], res[2]))
    out["calls"] = calls
    out["weights"] = {n: lw.variable_value(n) for n in ("w1", "w2")}
    out["x"], out["y"] = x_val, y_val
    return out

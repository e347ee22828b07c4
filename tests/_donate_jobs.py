"""Jobs of tests/test_donate_reductions.py, importable inside the gloo processes (run_spmd workers)."""

from __future__ import annotations

import torch

import meshtorch as mtf
from test_inplace_state import _model


def _mlp(x_val, y_val):
    """tests/test_inplace_state.py's two-layer MLP with SGD (batch split over the mesh: its weight gradients
    are partial sums): ``(graph, mesh, loss, grads, updates)``."""
    g, mesh, loss, updates, grads = _model("sgd", x_val, y_val, with_grads=True)
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

"""Worker of tests/test_plan_backend.py (runs inside gloo ranks)."""

import meshtorch as mtf
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import memory_report

SHAPE = {"num_layers": 2, "vocab_size": 256, "d_model": 64, "num_heads": 2, "d_kv": 32, "d_ff": 256, "length": 16,
         "batch_size": 4}


def worker():
    """The memory report of the tiny LM's AdamW step as a default Lowering on this rank plans it."""
    lm = build_lm(preset("tiny", **SHAPE), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.SpmdMeshImpl("data:2", "batch:data", storage="d_model:data")},
                      materialize=False)
    rep = memory_report(lw, [lm.loss] + lm.updates)
    plan = lw.session.plan(lw._fetch_keys([lm.loss] + lm.updates))
    return {"total": rep.total_bytes, "peak": rep.peak_activation_bytes, "peak_op": rep.peak_step[1],
            "kinds": sorted(st.kind for st in plan.steps if st.kind != "slicewise")}


#: layouts of tests/test_bucket_pricing.py: data parallel (every gradient sum in buckets), model parallel
#: (activation sums, each needed at once: no bucket), and one with both
BUCKET_LAYOUTS = ("batch:all", "heads:all;d_ff:all", "d_model:all")


def recorded_calls(make_impl, layouts=BUCKET_LAYOUTS, mesh: str = "all:2") -> dict:
    """``{layout: process-group calls}`` the flight recorder saw in one training step (after one warm-up step) of
    the tiny LM under a default Lowering on ``make_impl(mesh, layout)``, calls over groups of one left out."""
    from meshtorch.mesh.recorder import flight_recorder
    from meshtorch.runtime.autolayout import time_steps

    rec, out = flight_recorder(), {}
    for rules in layouts:
        lm = build_lm(preset("tiny", **SHAPE), optimizer=mtf.optim.AdamWOptimizer(1e-3))
        lw = mtf.Lowering(lm.graph, {lm.mesh: make_impl(mesh, rules)})
        time_steps(lm, lw, 1)
        rec.sink = sink = []
        time_steps(lm, lw, 1, seed=1)
        rec.sink = None
        sizes = {d.name: d.size for d in mtf.MeshSpec(mesh).shape}
        out[rules] = sum(1 for r in sink if any(sizes[a] > 1 for a in r.mesh_axes))
    return out


def spmd_calls():
    """:func:`recorded_calls` on this gloo rank's SPMD mesh."""
    return recorded_calls(mtf.SpmdMeshImpl)

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

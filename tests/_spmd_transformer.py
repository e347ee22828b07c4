"""Functions run inside the gloo processes of tests/test_transformer_spmd.py (via meshtorch.testing.spmd.run_spmd):
the ported Mesh TF transformer on SpmdMeshImpl, one process per processor. They return plain values; the parent
compares them with a PlacementMeshImpl run."""

from __future__ import annotations

MESH, LAYOUT = "rows:2;cols:2", "batch:rows;heads:cols;d_ff:cols;vocab:cols"


def lm_worker():
    """The Unitransformer LM of test_transformer_port: logits, loss and gradients, then 2 Adafactor steps' losses;
    and greedy sample_autoregressive from test_transformer_sampling's prompt."""
    import meshtorch as mtf
    import test_transformer_port as P
    import test_transformer_sampling as S

    graph, mesh, targets, logits, loss, variables, grads, _ = P.build()
    lw = mtf.Lowering(graph, {mesh: mtf.SpmdMeshImpl(MESH, LAYOUT)})
    out = [t.clone() for t in lw.run([logits, loss] + grads, feeds={targets: P.data()})]
    graph, mesh, targets, logits, loss, variables, grads, updates = P.build(mtf.optim.AdafactorOptimizer())
    lw = mtf.Lowering(graph, {mesh: mtf.SpmdMeshImpl(MESH, LAYOUT)})
    steps = [lw.run([loss] + updates, feeds={targets: P.data(s)})[0].item() for s in range(2)]
    graph, mesh, ids, sampled = S.build(stop_at_token=None)
    lw = mtf.Lowering(graph, {mesh: mtf.SpmdMeshImpl(MESH, LAYOUT)})
    tokens = lw.run([sampled], feeds={ids: S.PROMPT})[0].clone()
    return out, steps, tokens


def placement_reference():
    """The same three runs on the simulated mesh (PlacementMeshImpl) in the parent process."""
    import meshtorch as mtf
    import test_transformer_port as P
    import test_transformer_sampling as S

    graph, mesh, targets, logits, loss, variables, grads, _ = P.build()
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(MESH, LAYOUT)})
    out = lw.run([logits, loss] + grads, feeds={targets: P.data()})
    graph, mesh, targets, logits, loss, variables, grads, updates = P.build(mtf.optim.AdafactorOptimizer())
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(MESH, LAYOUT)})
    steps = [lw.run([loss] + updates, feeds={targets: P.data(s)})[0].item() for s in range(2)]
    graph, mesh, ids, sampled = S.build(stop_at_token=None)
    lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(MESH, LAYOUT)})
    return out, steps, lw.run([sampled], feeds={ids: S.PROMPT})[0]

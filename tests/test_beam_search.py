"""mtf.beam_search (Mesh TF's beam search and greedy decoding) vs brute force / a plain loop in PyTorch,
under a 1-D and a 2-D layout."""


import pytest
import torch

import meshtorch as mtf

B, V, LEN = 2, 5, 4
BEAM = 2
ALPHA = 0.6


def _tables(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, LEN, V, generator=gen) * 2, torch.randn(V, V, generator=gen) * 2


def _logits_graph(mesh, t_tab, u_tab, step, ids, batch, vocab, length):
    """logits[b, ..., v] = T[b, step, v] + U[previous id, v] (previous id 0 at step 0)."""
    prev = mtf.reduce_sum(ids * mtf.one_hot(step - 1, length, dtype=ids.dtype), reduced_dim=length)
    prev_v = mtf.Dimension("prev_vocab", V)
    t_step = mtf.gather(t_tab, step, length)
    u_prev = mtf.einsum([mtf.one_hot(prev, prev_v, dtype=torch.float32), u_tab], reduced_dims=[prev_v])
    return t_step + u_prev


def _build(mesh, kind, t, u, beam=BEAM):
    batch, vocab, length = mtf.Dimension("batch", B), mtf.Dimension("vocab", V), mtf.Dimension("length", LEN)
    t_tab = mtf.import_tensor(mesh, t, [batch, length, vocab])
    u_tab = mtf.import_tensor(mesh, u, [mtf.Dimension("prev_vocab", V), vocab])

    def logits_fn(step, ids, states):
        return _logits_graph(mesh, t_tab, u_tab, step, ids, batch, vocab, length), states

    if kind == "beam":
        ids = mtf.zeros(mesh, [batch, mtf.Dimension("beam", beam), length], dtype=torch.int32)
        return mtf.beam_search.beam_search(logits_fn, ids, ALPHA, stop_early=True)
    ids = mtf.zeros(mesh, [batch, length], dtype=torch.int32)
    return [mtf.beam_search.greedy_decode(logits_fn, ids)]


def _reference_beam_search(t, u, b):
    """Mesh TF's beam search (grow 2 x beam candidates, keep the best non-EOS beams alive and the best
    EOS-ended ones finished; length penalty ((5 + len) / 6) ** alpha) on Python lists for batch entry b.
    With V - 1 >= 2 x BEAM no EOS candidate ever competes with the -INF filler beams."""
    alive = [([0] * LEN, 0.0)]
    finished = []
    for i in range(LEN):
        pen = ((5.0 + i + 1) / 6.0) ** ALPHA
        cands = []
        for seq, lp in alive:
            prev = seq[i - 1] if i else 0
            logp = torch.log_softmax(t[b, i] + u[prev], -1)
            for tok in range(V):
                new = list(seq)
                new[i] = tok
                cands.append(((lp + logp[tok].item()) / pen, lp + logp[tok].item(), new))
        cands = sorted(cands, key=lambda c: -c[0])[:2 * BEAM]
        alive = [(c[2], c[1]) for c in cands if c[2][i] != 1][:BEAM]
        finished = sorted(finished + [(c[0], c[2]) for c in cands if c[2][i] == 1], key=lambda c: -c[0])[:BEAM]
    if finished:
        return [c[1] for c in finished], [c[0] for c in finished]
    return [a[0] for a in alive], [a[1] for a in alive]


LAYOUTS = [("", ""), ("all:2", "batch:all"), ("rows:2;cols:2", "batch:rows;length:cols")]


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_beam_search_matches_a_plain_transcription(mesh_shape, layout):
    t, u = _tables()
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    seqs, scores = _build(mesh, "beam", t, u)
    seqs, scores = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}).run([seqs, scores])
    n_finished = 0
    for b in range(B):
        want_seqs, want_scores = _reference_beam_search(t, u, b)
        n = len(want_seqs)
        n_finished += n
        assert seqs[b, :n].tolist() == want_seqs
        assert torch.allclose(scores[b, :n], torch.tensor(want_scores), atol=1e-4)
    assert n_finished >= 2  # the tables give finished beams (EOS is reachable)


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_greedy_decode_is_argmax_until_every_row_has_eos(mesh_shape, layout):
    t, u = _tables(seed=3)
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g)
    fetches = _build(mesh, "greedy", t, u)
    (out,) = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}).run(fetches)
    ids = torch.zeros(B, LEN, dtype=torch.int32)
    for step in range(LEN):
        if bool((ids == 1).any(1).all()):
            break
        prev = ids[:, step - 1] if step else torch.zeros(B, dtype=torch.int32)
        ids[:, step] = torch.argmax(t[:, step] + u[prev.long()], -1).int()
    assert torch.equal(out, ids)

"""``Unitransformer.beam_search`` (Mesh TF's beam search with length penalty on ``mtf.while_loop``) vs a
plain-PyTorch transcription of Mesh TF's ``beam_search.py`` run on the plain-PyTorch LM of
``test_transformer_port`` (full recomputation at every step), under two layouts.
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch.transformer import transformer, transformer_layers
from test_transformer_port import DFF, DKV, MAXLEN, B, D, H, L, V, reference
from test_transformer_sampling import lowering

BEAM, ALPHA, INF, EOS = 3, 0.6, 1e7, 1


def build():
    graph = mtf.Graph(seed=3)
    mesh = mtf.Mesh(graph, "m")
    ids = mtf.zeros(mesh, [mtf.Dimension("batch", B), mtf.Dimension("beam", BEAM), mtf.Dimension("length", L)],
                    dtype=torch.int32)
    model = transformer.Unitransformer(
        layer_stack=transformer.make_layer_stack(
            [[transformer_layers.SelfAttention, {"num_heads": H, "key_value_size": DKV}],
             [transformer_layers.DenseReluDense, {"hidden_size": DFF}]], num_layers=2),
        d_model=D, input_vocab_size=V, output_vocab_size=V, autoregressive=True, max_length=MAXLEN,
        shared_embedding_and_softmax_weights=True)
    return graph, mesh, model.beam_search(ids, mtf.constant(mesh, L, [], torch.int32), alpha=ALPHA)


def mesh_tf_beam_search(logits_at, batch):
    """Mesh TF beam_search (stop_early=True), transcribed on dense torch tensors.

    ``logits_at(ids [batch * beam, length], i)`` -> logits ``[batch * beam, vocab]`` for position i."""
    B = batch  # noqa: N806
    alive_seq = torch.zeros(B, BEAM, L, dtype=torch.long)
    alive_lp = torch.tensor([0.0] + [-INF] * (BEAM - 1), dtype=torch.float64).expand(B, BEAM).clone()
    fin_seq, fin_scores = alive_seq.clone(), torch.full((B, BEAM), -INF, dtype=torch.float64)
    fin_flags = torch.zeros(B, BEAM, dtype=torch.bool)
    i = 0
    while i < L:
        lower = alive_lp[:, 0] / ((5.0 + L) / 6.0) ** ALPHA
        lowest = (fin_scores * fin_flags).min(1).values + (~fin_flags.any(1)).double() * -INF
        if bool((lowest > lower).all()):
            break
        logits = logits_at(alive_seq.reshape(B * BEAM, L), i).view(B, BEAM, -1)
        V = logits.shape[-1]  # noqa: N806
        pen = ((5.0 + i + 1) / 6.0) ** ALPHA
        scores = ((torch.log_softmax(logits, -1) + alive_lp[..., None]) / pen).reshape(B, BEAM * V)
        top_scores, top_flat = scores.topk(2 * BEAM)
        top_beam, top_ids = top_flat // V, top_flat % V
        top_seq = torch.gather(alive_seq, 1, top_beam[..., None].expand(B, 2 * BEAM, L)).clone()
        top_seq[:, :, i] += top_ids
        top_fin = top_ids == EOS
        idx = (top_scores + top_fin * -INF).topk(BEAM).indices
        alive_seq = torch.gather(top_seq, 1, idx[..., None].expand(B, BEAM, L))
        alive_lp = torch.gather(top_scores * pen, 1, idx)
        all_scores = torch.cat([fin_scores, top_scores + (~top_fin) * -INF], 1)
        idx = all_scores.topk(BEAM).indices
        fin_seq = torch.gather(torch.cat([fin_seq, top_seq], 1), 1, idx[..., None].expand(B, BEAM, L))
        fin_flags = torch.gather(torch.cat([fin_flags, top_fin], 1), 1, idx)
        fin_scores = torch.gather(all_scores, 1, idx)
        i += 1
    return torch.where(fin_flags.any(1)[:, None, None], fin_seq, alive_seq)[:, 0]


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("rows:2;cols:2", "batch:rows;heads:cols;d_ff:cols")])
def test_beam_search_matches_mesh_tf_s_algorithm(mesh_shape, layout):
    graph, mesh, out = build()
    lw = lowering(graph, mesh, mesh_shape, layout)
    params = {n: lw.variable_value(n).to(torch.float64) for n in lw.variable_names}

    def logits_at(ids, i):
        return reference(params, ids)[0][:, i]
    free = mesh_tf_beam_search(logits_at, B)
    assert not (free == EOS).any()
    # relabel a token the best beam produces mid-way as the end-of-sequence id (swap their embedding rows: the
    # model is the same up to the relabelling), so that beams finish and the finished set is exercised
    tok = int(free[0, 3])
    emb = lw.variable_value("transformer/embedding")
    emb[[EOS, tok]] = emb[[tok, EOS]]
    lw.set_variable_value("transformer/embedding", emb)
    params = {n: lw.variable_value(n).to(torch.float64) for n in lw.variable_names}
    got = lw.run([out])[0]
    want = mesh_tf_beam_search(logits_at, B)
    assert torch.equal(got, want.to(got.dtype))
    assert (want == EOS).any() and not torch.equal(want, free)

"""T5 decoding on the block builder with an encoder-decoder KV cache (meshtorch.models.hf_t5_decoder), against
``transformers``' ``T5ForConditionalGeneration.generate(do_sample=False)``: greedy tokens and every step's logits, on
encoder inputs of different lengths (padded), under several layouts; the step's work (planner FLOPs) is one decoder
position whatever the position, the encoder and the encoder-decoder keys/values not recomputed. The model's query
projections, head and encoder-decoder output are scaled (peaked attention: a wrong cache read, relative position or
memory moves the argmax)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.runtime.generate import CachedDecoder, beam_search, sample  # noqa: E402

ROWS, BATCH, NEW = 3, 4, 12
GREEDY_NEW = 64  # issue 30: 64 greedy tokens (none of the 3 rows reaches EOS before)
LAYOUTS = [("", ""), ("model:2", "heads:model;d_ff:model;vocab:model"), ("data:2", "batch:data")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ref = F.make_t5(seed=0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            for part, k in (("q.weight", 4.0), ("lm_head", 2.0), ("EncDecAttention.o.weight", 2.0)):
                if part in name:
                    p.mul_(k)
    return ref, F.save_t5(ref, str(tmp_path_factory.mktemp("t5kv") / "t5"))


def _inputs():
    """3 encoder inputs of 8, 5 and 3 ids (no EOS, no pad inside), right-padded with 0 to 8."""
    x = F.t5_batch(ROWS, 8, seed=5)
    for row, n in ((1, 5), (2, 3)):
        x[row, n:] = 0
    return x


@pytest.mark.parametrize("mesh,layout", LAYOUTS, ids=["1", "model2", "data2"])
def test_greedy_tokens_and_step_logits_equal_transformers(saved, mesh, layout):
    ref, path = saved
    x = _inputs()
    mask = (x != 0).long()
    with torch.no_grad():
        gen = ref.generate(x, attention_mask=mask, max_new_tokens=GREEDY_NEW, do_sample=False, decoder_start_token_id=0,
                           eos_token_id=1, pad_token_id=0)
        want_logits = ref(input_ids=x, attention_mask=mask, decoder_input_ids=gen).logits
    want = [r[1:].tolist() for r in gen]
    want = [w[:w.index(1) + 1] if 1 in w else w for w in want]  # transformers pads with 0 after EOS
    assert len({tuple(w[:6]) for w in want}) == ROWS and all(len(set(w)) > 3 for w in want), want
    model, lw = hf.load(path, mtf.PlacementMeshImpl(mesh, layout), batch_size=BATCH, length=GREEDY_NEW + 1)
    got = sample(lw, model, [0], max_new_tokens=GREEDY_NEW, temperature=0.0, num_samples=ROWS, eos_ids=[1],
                 encoder_ids=x)
    assert got == want
    # every step's logits (teacher-forced on transformers' tokens) against transformers' forward
    dec = CachedDecoder.of(lw, model)
    enc = torch.zeros(BATCH, GREEDY_NEW + 1, dtype=torch.int64)
    enc[:ROWS, :8] = x
    buf = torch.zeros(BATCH, GREEDY_NEW + 1, dtype=torch.int64)
    scale = float(want_logits.abs().max())
    first = dec.prefill(buf, enc)[:ROWS, 0]
    assert (first - want_logits[:, 0]).abs().max() <= 1e-5 * scale
    steps = gen.shape[1] - 1
    ids = torch.zeros(BATCH, steps + 1, dtype=torch.int64)
    ids[:ROWS] = gen
    for t in range(1, steps + 1):
        out = dec.step(ids[:, t], t)[:ROWS]
        assert (out - want_logits[:, t]).abs().max() <= 1e-5 * scale, t


def test_step_work_is_one_position_whatever_the_position(saved):
    """Planner FLOPs of the step program (the one program run for every new token): one position's matmuls (the
    self-attention's q/k/v/o, the encoder-decoder attention's q and o only: its keys and values are cached; the
    MLP; the head) plus attention over the ``length`` cached positions (self and encoder-decoder). Recomputing the
    window, the encoder, or the encoder-decoder keys/values adds FLOPs; the prefill (window + encoder) is counted
    for contrast."""
    ref, path = saved
    L = 16
    model, lw = hf.load(path, mtf.PlacementMeshImpl("", ""), batch_size=2, length=L)
    c, dec = model.config, CachedDecoder.of(lw, model)
    g = dec.graph
    step = dec.lowering.plan_counters([g.step_logits] + g.step_writes).einsum_flops
    B, H, D, d = c.batch_size, c.num_heads, c.d_kv, c.d_model
    ffn = d * c.d_ff * (3 if c.gated else 2)
    weights = c.num_decoder_layers * (4 * d * H * D + 2 * d * H * D + ffn) + d * c.vocab_size  # multiply-adds
    attention = c.num_decoder_layers * 2 * (2 * (2 * B * H * L * D))  # self + cross: q.k and weights.v over L
    assert step == 2 * B * weights + attention
    prefill = dec.lowering.plan_counters([g.prefill_logits] + g.prefill_writes).einsum_flops
    assert prefill > L * step  # the window and the encoder, once per sequence
    with pytest.raises(ValueError, match="needs encoder_ids"):
        sample(lw, model, [0], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceed T5's window of 16"):
        sample(lw, model, [0], max_new_tokens=16, encoder_ids=[5, 6])
    with pytest.raises(ValueError, match="KV cache only"):
        sample(lw, model, [0], max_new_tokens=4, encoder_ids=[5, 6], use_cache=False)


def test_no_cache_is_refused_for_t5_from_the_command_line(saved, capsys):
    from meshtorch.cli import main

    _, path = saved
    F.bpe_tokenizer(f"{path}/tokenizer.json", F.text())
    assert main(["sample", "--checkpoint-dir", path, "--prompt", "the cat", "--no-cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--no-cache: T5 decodes with the KV cache only" in err and len(err.splitlines()) == 1, err


def test_beam_search_and_seeded_sampling_equal_transformers(tmp_path):
    """Under 1 processor and ``heads:model``: seeded top-k sampling equals the same host draws (one seeded generator)
    on ``transformers``' logits; beam search through the caches (4 beams, each beam's self-attention and
    encoder-decoder caches following its parent) equals ``generate(num_beams=4, length_penalty=0)``, on a model whose
    EOS logit is 0 (no beam ends early; beams ending at EOS: tests/test_beam_eos.py)."""
    ref = F.make_t5(seed=3)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            for part, k in (("q.weight", 4.0), ("lm_head", 4.0)):
                if part in name:
                    p.mul_(k)
        ref.lm_head.weight[1] = 0.0
    path = F.save_t5(ref, str(tmp_path / "t5"))
    x = F.t5_batch(2, 8, seed=5)
    with torch.no_grad():
        want = ref.generate(x, max_new_tokens=NEW, num_beams=4, do_sample=False, length_penalty=0.0,
                            decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
                            attention_mask=torch.ones_like(x))[:, 1:].tolist()
    # seeded top-k sampling: the host loop's draws (torch.multinomial, one seeded generator) on transformers' logits
    gen, seq = torch.Generator().manual_seed(3), torch.zeros(2, 1, dtype=torch.int64)
    with torch.no_grad():
        for _ in range(NEW):
            logits = ref(input_ids=x, decoder_input_ids=seq).logits[:, -1]
            logits = logits.masked_fill(logits < logits.topk(5, -1).values[:, -1:], float("-inf"))
            seq = torch.cat([seq, torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)], 1)
    sampled = seq[:, 1:].tolist()
    assert sampled != want and len({i for r in sampled for i in r}) > 8, sampled
    for mesh, layout in LAYOUTS[:2]:
        model, lw = hf.load(path, mtf.PlacementMeshImpl(mesh, layout), batch_size=4, length=NEW + 1)
        got = [beam_search(lw, model, [0], beam_size=4, max_new_tokens=NEW, encoder_ids=row) for row in x]
        assert got == want, (mesh, got, want)
        got = sample(lw, model, [0], NEW, temperature=1.0, top_k=5, seed=3, num_samples=2, encoder_ids=x)
        assert got == sampled, (mesh, got, sampled)

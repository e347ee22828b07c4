"""Beam search that stops at EOS (:func:`meshtorch.runtime.generate.beam_search_hypotheses`, through the KV-cache
decoder) against ``transformers``' ``generate(num_beams=4, num_return_sequences=4)``: every finished hypothesis (ids
and length-penalised score), for GPT-2 and T5, with length penalty 1.0 (the default) and 0, ``early_stopping`` False,
True and ``"never"``. The EOS ids are chosen from ``transformers``' own beams (a token its best beam emits early), and
each test asserts that a finished hypothesis ended at EOS before ``max_new_tokens`` (so the case is not vacuous);
``meshtorch sample --beam 4`` on a GPT-2 directory stops at its ``config.json``'s ``eos_token_id``."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.data.hf_tokenizer import HFTokenizer  # noqa: E402
from meshtorch.runtime.generate import beam_search, beam_search_hypotheses  # noqa: E402

NEW, BEAMS = 8, 4


def _hf_hypotheses(ref, x, eos, length_penalty, early_stopping, **kw):
    """``transformers``' finished hypotheses: ``[(sequences_scores, new ids up to and with EOS)]``, best first."""
    with torch.no_grad():
        out = ref.generate(x, max_new_tokens=NEW, num_beams=BEAMS, num_return_sequences=BEAMS, do_sample=False,
                           length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                           output_scores=True, return_dict_in_generate=True, attention_mask=torch.ones_like(x), **kw)
    n = (out.beam_indices != -1).sum(1)  # each hypothesis' new tokens (the rest is padding)
    start = 1 if ref.config.is_encoder_decoder else x.shape[1]
    return [(float(s), out.sequences[i, start:start + int(n[i])].tolist()) for i, s in enumerate(out.sequences_scores)]


def _check(ref, lw, model, x, eos, cases, start, encoder_ids=None, **kw):
    early = 0
    for length_penalty, early_stopping in cases:
        want = _hf_hypotheses(ref, x, eos, length_penalty, early_stopping, **kw)
        got = beam_search_hypotheses(lw, model, start, BEAMS, NEW, eos, length_penalty, early_stopping,
                                     encoder_ids=encoder_ids)
        case = (length_penalty, early_stopping, got, want)
        assert [g[1] for g in got] == [w[1] for w in want], case
        assert all(abs(g[0] - w[0]) <= 1e-4 * max(1.0, abs(w[0])) for g, w in zip(got, want, strict=True)), case
        early += sum(len(h) < NEW and h[-1] in eos for _, h in got)
    assert early > 0  # some hypothesis ended at EOS before the length limit
    assert beam_search(lw, model, start, BEAMS, NEW, eos, length_penalty, early_stopping,
                       encoder_ids=encoder_ids) == want[0][1]  # the best, of the last case


def test_gpt2_beams_stop_at_eos_as_transformers(tmp_path):
    ref = F.make_peaked_model("gpt2")
    path = F.save(ref, str(tmp_path / "gpt2"))
    x = F.token_batch(1, 6, seed=11)
    eos = [_hf_hypotheses(ref, x, None, 0.0, False, pad_token_id=0)[0][1][2]]  # a token the best beam emits 3rd
    model, lw = hf.load(path, mtf.PlacementMeshImpl("", ""), batch_size=BEAMS, length=x.shape[1] + NEW)
    _check(ref, lw, model, x, eos, [(1.0, False), (0.0, False), (2.0, "never")], x[0], pad_token_id=0)
    with pytest.raises(ValueError, match="early_stopping 'sometimes' must be"):
        beam_search(lw, model, x[0], BEAMS, NEW, eos, early_stopping="sometimes")
    # meshtorch sample --beam 4 stops at config.json's eos_token_id, as generate(num_beams=4) with its defaults
    F.bpe_tokenizer(f"{path}/tokenizer.json", F.text())
    prompt = "the cat sat on"
    x = torch.tensor([[int(i) for i in HFTokenizer(f"{path}/tokenizer.json").encode(prompt)]])
    free = _hf_hypotheses(ref, x, None, 1.0, False, pad_token_id=0)[0][1]
    eos = free[2]
    cfg = json.load(open(f"{path}/config.json"))
    json.dump({**cfg, "eos_token_id": eos}, open(f"{path}/config.json", "w"))
    want = _hf_hypotheses(ref, x, eos, 1.0, False, pad_token_id=0)
    assert want[0][1] != free, want  # the EOS changes the best hypothesis
    assert F.run(["sample", "--checkpoint-dir", path, "--prompt", prompt, "--beam", str(BEAMS), "--max-new-tokens",
                  str(NEW)]) == [want[0][1]]


def test_t5_beams_stop_at_eos_as_transformers(tmp_path):
    """Two EOS ids (T5's 1 and a token the best beam emits 3rd): 3 x 4 candidates per step."""
    ref = F.make_t5(seed=0)
    with torch.no_grad():  # peaked attention and output distribution (tests/test_t5_kv_decode.py's model)
        for name, p in ref.named_parameters():
            for part, k in (("q.weight", 4.0), ("lm_head", 2.0), ("EncDecAttention.o.weight", 2.0)):
                if part in name:
                    p.mul_(k)
    path = F.save_t5(ref, str(tmp_path / "t5"))
    x = F.t5_batch(1, 8, seed=5)
    kw = dict(decoder_start_token_id=0, pad_token_id=0)
    eos = [1, _hf_hypotheses(ref, x, [1], 0.0, False, **kw)[0][1][2]]
    model, lw = hf.load(path, mtf.PlacementMeshImpl("", ""), batch_size=BEAMS, length=NEW + 1)
    _check(ref, lw, model, x, eos, [(1.0, False), (0.0, False), (1.0, True)], [0], encoder_ids=x[0], **kw)

"""KV-cache decoding on 4 gloo ranks (SpmdMeshImpl, data:2 x model:2, caches split over batch and heads, FSDP
storage), every Hugging Face family in one job: greedy tokens equal ``transformers.generate(use_cache=True)``
(GPT-2, Llama with grouped-query attention, tied Llama, Qwen2, Mistral, T5), and 4-beam search equals the placement
mesh's for GPT-2 and T5 (which equals ``transformers``' there: tests/test_beam_eos.py). The models' attention is
peaked (tests/_hf_fixtures.make_peaked_model; T5's queries and head scaled), so a wrong cache split or read moves
the argmax."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.runtime.generate import beam_search  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
NEW, LENGTH, BEAMS = 16, 24, 4
DECODERS = ("gpt2", "llama_gqa", "llama_tied", "qwen2", "mistral")


def _peaked_t5():
    ref = F.make_t5(seed=0)
    with torch.no_grad():  # as tests/test_t5_kv_decode.py's model
        for name, p in ref.named_parameters():
            for part, k in (("q.weight", 4.0), ("lm_head", 2.0), ("EncDecAttention.o.weight", 2.0)):
                if part in name:
                    p.mul_(k)
    return ref


def test_cached_decoding_of_every_family_on_four_gloo_ranks(tmp_path):
    prompts = F.token_batch(2, 6, seed=11)
    jobs, want = [], {}
    for family in DECODERS:
        ref = F.make_peaked_model(family)
        path = F.save(ref, str(tmp_path / family))
        with torch.no_grad():
            want[family] = ref.generate(prompts, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                        eos_token_id=None, pad_token_id=0,
                                        attention_mask=torch.ones_like(prompts))[:, 6:].tolist()
        beams = BEAMS if family == "gpt2" else 0
        jobs.append((family, path, [p.tolist() for p in prompts], None, beams, BEAMS, LENGTH))
    t5 = _peaked_t5()
    x = F.t5_batch(2, 8, seed=5)
    with torch.no_grad():
        gen = t5.generate(x, max_new_tokens=NEW, do_sample=False, decoder_start_token_id=0, eos_token_id=1,
                          pad_token_id=0)
    want["t5"] = [[t for t in r[1:].tolist()] for r in gen]
    want["t5"] = [w[:w.index(1) + 1] if 1 in w else w for w in want["t5"]]  # transformers pads after EOS
    t5_path = F.save_t5(t5, str(tmp_path / "t5"))
    jobs.append(("t5", t5_path, [[0], [0]], x, BEAMS, BEAMS, NEW + 1))
    assert all(len(set(map(tuple, w))) == len(w) and len(set(sum(w, []))) > 4 for w in want.values()), want
    want_beam = {}
    for name, path, prompts_, enc, beams, batch, length in jobs:
        if beams:
            model, lw = hf.load(path, mtf.PlacementMeshImpl("", ""), batch_size=batch, length=length)
            want_beam[name] = beam_search(lw, model, prompts_[0], beam_size=beams, max_new_tokens=NEW,
                                          eos_ids=[1] if enc is not None else (),
                                          encoder_ids=None if enc is None else enc[0])
    run = run_spmd("_kv_cache_spmd:worker", args=(jobs, NEW), nprocs=4, timeout_s=300,
                   extra_path=[TESTS_DIR]).check()
    for r in run.results:
        for name in want:
            assert r[name]["greedy"] == want[name], name
        for name, beam in want_beam.items():
            assert r[name]["beam"] == beam, name

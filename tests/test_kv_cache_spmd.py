"""KV-cache decoding on 4 gloo ranks (SpmdMeshImpl, data:2 x model:2, caches split over batch and heads, FSDP
storage): greedy tokens equal ``transformers.generate(use_cache=True)`` and the placement mesh's beam search."""

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


def test_cached_decoding_on_four_gloo_ranks(tmp_path):
    ref = F.make_peaked_model("llama_gqa")
    path = F.save(ref, str(tmp_path / "llama"))
    prompts = F.token_batch(2, 6, seed=11)
    new, length = 20, 32
    with torch.no_grad():
        want = ref.generate(prompts, max_new_tokens=new, do_sample=False, use_cache=True, eos_token_id=None,
                            pad_token_id=0, attention_mask=torch.ones_like(prompts))[:, 6:].tolist()
    model, lw = hf.load(path, mtf.PlacementMeshImpl("", ""), batch_size=2, length=length)
    want_beam = beam_search(lw, model, prompts[0], beam_size=2, max_new_tokens=new)
    run = run_spmd("_kv_cache_spmd:worker", args=(path, list(prompts), new, length), nprocs=4, timeout_s=240,
                   extra_path=[TESTS_DIR]).check()
    for r in run.results:
        assert r["greedy"] == want
        assert r["beam"] == want_beam

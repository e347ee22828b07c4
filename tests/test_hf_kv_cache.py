"""KV-cache decoding of Hugging Face GPT-2 / Llama (meshtorch.models.hf.build_hf_decoder) against
``transformers``' ``generate(do_sample=False, use_cache=True)``, on models whose attention is peaked (q and k
projections scaled), so that swapped q/k, a rotary at the wrong position or a cache read at the wrong
position change the tokens (checked by breaking each on purpose)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.runtime.generate import beam_search, sample  # noqa: E402

MP = "batch:data;heads:model;kv_heads:model;d_ff:model;vocab:model"
LAYOUTS = [("", ""), ("data:2;model:2", MP)]
PROMPT, NEW, LENGTH = 6, 40, 48


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_kv")
    return {fam: (m, F.save(m, str(root / fam))) for fam in F.FAMILIES for m in [F.make_peaked_model(fam)]}


def _want(model, prompt):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, use_cache=True, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones_like(prompt))
    return out[:, PROMPT:].tolist()


@pytest.mark.parametrize("family", F.FAMILIES)
@pytest.mark.parametrize("mesh,layout", LAYOUTS, ids=["1", "2x2"])
def test_greedy_equals_transformers_generate_with_cache(saved, family, mesh, layout):
    ref, path = saved[family]
    prompts = F.token_batch(2, PROMPT, seed=11)
    want = _want(ref, prompts)
    model, lw = hf.load(path, mtf.PlacementMeshImpl(mesh, layout), batch_size=2, length=LENGTH)
    got = [sample(lw, model, p, max_new_tokens=NEW, temperature=0.0)[0] for p in prompts]
    assert got == want
    assert all(len(set(w)) > 5 for w in want)  # not a constant continuation


def test_step_logits_equal_transformers_cached_logits(saved):
    """Logits of every step (not only their argmax) against transformers' incremental forward."""
    ref, path = saved["llama_gqa"]
    ids = F.token_batch(2, 12, seed=5)
    with torch.no_grad():
        want = ref(ids).logits
    model, lw = hf.load(path, mtf.PlacementMeshImpl("model:2", "heads:model;kv_heads:model"), batch_size=2,
                        length=16)
    from meshtorch.runtime.generate import CachedDecoder

    dec = CachedDecoder.of(lw, model)
    buf = torch.zeros(2, 16, dtype=torch.int64)
    buf[:, :4] = ids[:, :4]
    pre = dec.prefill(buf)[:, :4, : F.VOCAB]
    scale = float(want.abs().max())
    assert (pre - want[:, :4]).abs().max() <= 1e-5 * scale
    for t in range(4, 12):
        got = dec.step(ids[:, t], t)[:, : F.VOCAB]
        assert (got - want[:, t]).abs().max() <= 1e-5 * scale, t


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_beam_search_equals_transformers(saved, family):
    """4 beams, no EOS, length penalty 0: the best beam of ``generate(num_beams=4)``."""
    ref, path = saved[family]
    prompt = F.token_batch(1, PROMPT, seed=11)
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=16, num_beams=4, do_sample=False, use_cache=True, length_penalty=0.0,
                            early_stopping=False, eos_token_id=None, pad_token_id=0,
                            attention_mask=torch.ones_like(prompt))[0, PROMPT:].tolist()
    model, lw = hf.load(path, mtf.PlacementMeshImpl("data:2;model:2", MP), batch_size=4, length=LENGTH)
    assert beam_search(lw, model, prompt[0], beam_size=4, max_new_tokens=16) == want

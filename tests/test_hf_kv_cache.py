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


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_step_head_copy_follows_every_weight_change(saved, family):
    """The step reads the head from a contiguous ``[d_model, vocab]`` copy (``Step.weight``); after each way the
    weights change (a new copy from the training lowering; a variable replaced in the decoder, as a restore
    does; a slice written in place, as a training update does) the copy equals the head's transpose and the
    step's logits equal ``transformers``' for the changed weights."""
    import copy

    from meshtorch.runtime.generate import CachedDecoder

    ref0, path = saved[family]
    head = "embed" if family == "gpt2" else "lm_head"
    model, lw = hf.load(path, mtf.PlacementMeshImpl("data:2;model:2", MP), batch_size=2, length=16)
    ids = F.token_batch(2, 8, seed=3)
    buf = torch.zeros(2, 16, dtype=torch.int64)
    buf[:, :6] = ids[:, :6]

    def check(dec, factor):
        ref = copy.deepcopy(ref0)
        with torch.no_grad():
            ref.get_output_embeddings().weight.mul_(factor)
            want = ref(ids).logits
        dec.prefill(buf)
        got = dec.step(ids[:, 6], 6)[:, : F.VOCAB]
        assert (got - want[:, 6]).abs().max() <= 1e-5 * float(want.abs().max())
        w = dec.lowering.variable_value(head)
        assert torch.equal(dec.lowering.variable_value("lm_head_proj/decode_kernel"), w.t())

    dec = CachedDecoder.of(lw, model)
    check(dec, 1.0)
    slices = dec.lowering.store.impl(head).local_slices(dec.lowering.store.values[head])
    copies = dec.lowering.store.values["lm_head_proj/decode_kernel"]
    assert all(t.is_contiguous() for t in dec.lowering.store.impl(head).local_slices(copies))
    for t in {id(t): t for t in slices}.values():  # in place, as a training step's commit writes
        t.mul_(2.0)
    check(dec, 2.0)
    dec.lowering.set_variable_value(head, lw.variable_value(head) * 3.0)  # replaced, as a restore does
    check(dec, 3.0)
    lw.set_variable_value(head, lw.variable_value(head) * 0.5)  # the training lowering's weights changed
    assert CachedDecoder.of(lw, model) is dec
    check(dec, 0.5)

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
PROMPT, NEW, LENGTH = 6, 64, 70  # issue 30: 64 greedy tokens (the fixtures' context is LENGTH)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_kv")
    return {fam: (m, F.save(m, str(root / fam))) for fam in F.FAMILIES
            for m in [F.make_peaked_model(fam, positions=LENGTH)]}


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


def _scale_q_and_head(model, family, factor):
    """``transformers`` ``model`` with its head and layer 0's query kernel times ``factor`` (in place)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
        if family == "gpt2":
            model.transformer.h[0].attn.c_attn.weight[:, : F.D].mul_(factor)
        else:
            model.model.layers[0].self_attn.q_proj.weight.mul_(factor)
    return model


@pytest.mark.parametrize("family", F.FAMILIES)
def test_step_weight_copies_follow_every_weight_change(saved, family):
    """The step reads the head from a contiguous ``[d_model, vocab]`` copy and (multi-head) the q/k/v kernels from
    one stacked copy (``Step.weight`` / ``Step.derive``); after each way the weights change (a new copy from the
    training lowering; a variable replaced in the decoder, as a restore does; a slice written in place, as a
    training update does) the copies equal their sources and the step's logits equal ``transformers``' for the
    changed weights."""
    import copy

    from meshtorch.runtime.generate import CachedDecoder

    ref0, path = saved[family]
    q = "layers0/attn/q/kernel"
    model, lw = hf.load(path, mtf.PlacementMeshImpl("data:2;model:2", MP), batch_size=2, length=16)
    head = "embed" if model.config.tied else "lm_head"
    fused = model.config.num_kv_heads == model.config.num_heads  # multi-head: q, k, v from one matmul
    ids = F.token_batch(2, 8, seed=3)
    buf = torch.zeros(2, 16, dtype=torch.int64)
    buf[:, :6] = ids[:, :6]

    def check(dec, factor):
        with torch.no_grad():
            want = _scale_q_and_head(copy.deepcopy(ref0), family, factor)(ids).logits
        dec.prefill(buf)
        got = dec.step(ids[:, 6], 6)[:, : F.VOCAB]
        assert (got - want[:, 6]).abs().max() <= 1e-5 * float(want.abs().max())
        value = dec.lowering.variable_value
        assert torch.equal(value("lm_head_proj/decode_kernel"), value(head).t())
        if fused:
            kernels = [value(f"layers0/attn/{w}/kernel") for w in "qkv"]
            assert torch.equal(value("layers0/attn/qkv/decode_kernel"), torch.stack(kernels, 1))
        else:
            assert "layers0/attn/qkv/decode_kernel" not in dec.lowering.variable_names

    dec = CachedDecoder.of(lw, model)
    check(dec, 1.0)
    store = dec.lowering.store
    assert all(t.is_contiguous() for n in dec.graph.derived for t in store.impl(n).local_slices(store.values[n]))
    for name in (head, q):  # in place, as a training step's commit writes
        for t in {id(t): t for t in store.impl(name).local_slices(store.values[name])}.values():
            t.mul_(2.0)
    check(dec, 2.0)
    for name in (head, q):  # replaced, as a restore does
        dec.lowering.set_variable_value(name, lw.variable_value(name) * 3.0)
    check(dec, 3.0)
    for name in (head, q):  # the training lowering's weights changed: the next decoding copies them
        lw.set_variable_value(name, lw.variable_value(name) * 0.5)
    assert CachedDecoder.of(lw, model) is dec
    check(dec, 0.5)

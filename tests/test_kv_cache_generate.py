"""KV-cache decoding of the native LM (meshtorch.layers.kv_cache, meshtorch.models.decoding, runtime.generate):
each step's logits against an independent plain-PyTorch forward over the whole prefix (TorchLM on the same
weights) and against the training graph's logits, under 1-D and 2-D placement meshes with heads split;
tokens equal to the recompute path (greedy and sampled, past the context too); FLOPs per token from the
planner against the model's arithmetic."""

from __future__ import annotations

import pytest
import torch

from meshtorch.models.decoding import build_lm_decoder
from meshtorch.models.transformer import LMConfig, build_lm
from meshtorch.runtime.generate import CachedDecoder, beam_search, sample
from meshtorch.testing.torch_lm import TorchLM, state_dict_from_lowering

C = LMConfig(vocab_size=61, vocab_multiple=4, d_model=32, num_heads=4, d_kv=8, d_ff=64, num_layers=2, length=16,
             batch_size=4, norm="layer", activation="gelu")
MP = "heads:model;d_ff:model;vocab:model"
LAYOUTS = [("", ""), ("data:2", "batch:data"), ("model:4", MP), ("data:2;model:2", "batch:data;" + MP)]
IDS = [f"{m}|{lay}" for m, lay in LAYOUTS]


def _model(mesh="", layout="", seed=3):
    """The LM with its attention made peaked (q scaled x4: a q/k or position mistake moves the argmax)."""
    lm = build_lm(C, seed=seed, train=False)
    lw = lm.lowering(mesh, layout)
    for i in range(C.num_layers):
        name = f"layer_{i}/attention/q"
        lw.set_variable_value(name, lw.variable_value(name) * 4.0)
    return lm, lw


def _reference(lw) -> TorchLM:
    ref = TorchLM(C)
    ref.load_state_dict(state_dict_from_lowering(lw, ref))
    return ref.eval()


@pytest.mark.parametrize("mesh,layout", LAYOUTS, ids=IDS)
def test_step_logits_equal_full_forward(mesh, layout):
    lm, lw = _model(mesh, layout)
    ids = torch.randint(0, C.vocab_size, (C.batch_size, C.length), generator=torch.Generator().manual_seed(0))
    full = lw.run(lm.logits, feeds={lm.inputs: ids, lm.targets: ids})
    with torch.no_grad():
        ref = _reference(lw)
        want = [ref(ids[:, : t + 1])[:, t] for t in range(C.length)]  # plain PyTorch, whole prefix each time
    dec = CachedDecoder.of(lw, lm)
    prompt = 5
    buf = ids.clone()
    buf[:, prompt:] = 7  # what the prefill sees past the prompt must not matter
    pre = dec.prefill(buf)
    scale = max(float(w.abs().max()) for w in want)
    for t in range(prompt):
        assert (pre[:, t] - want[t]).abs().max() <= 1e-5 * scale
    for t in range(prompt, C.length):
        got = dec.step(ids[:, t], t)
        assert (got - want[t]).abs().max() <= 1e-5 * scale, t
        assert (got - full[:, t]).abs().max() <= 1e-5 * scale, t
        assert torch.equal(got.argmax(-1), want[t].argmax(-1))


def test_caches_are_laid_out_by_the_rules():
    lm, lw = _model("data:2;model:2", "batch:data;" + MP)
    dec = CachedDecoder.of(lw, lm)
    k = dec.graph.graph.name_to_variable["layer_0/attention/sdpa/k_cache"]
    assert [d.name for d in k.shape] == ["batch", "heads", "memory_length", "d_kv"]
    assert dec.lowering.slice_shape(k.outputs[0]) == [C.batch_size // 2, C.num_heads // 2, C.length, C.d_kv]


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 5)])
def test_tokens_equal_recompute_path_on_every_layout(temperature, top_k):
    prompt = [3, 14, 15, 9, 2]
    kw = dict(max_new_tokens=20, temperature=temperature, top_k=top_k, seed=4, num_samples=3)  # slides past 16
    runs = []
    for mesh, layout in LAYOUTS:
        lm, lw = _model(mesh, layout)
        runs.append(sample(lw, lm, prompt, **kw))
        runs.append(sample(lw, lm, prompt, use_cache=False, **kw))
    assert all(r == runs[0] for r in runs)
    assert len(runs[0][0]) == 20 and len(set(runs[0][0])) > 3


def test_beam_search_with_cache_equals_recompute_on_every_layout():
    """The caches follow the beams (a wrong reorder gives other beams); 14 tokens slide past the context."""
    runs = []
    for mesh, layout in LAYOUTS:
        lm, lw = _model(mesh, layout)
        runs += [beam_search(lw, lm, [3, 14, 15, 9, 2], beam_size=4, max_new_tokens=14, use_cache=u)
                 for u in (True, False)]
    assert all(r == runs[0] for r in runs) and len(runs[0]) == 14


def test_greedy_tokens_equal_plain_pytorch_greedy():
    lm, lw = _model()
    prompt = [3, 14, 15, 9, 2]
    got = sample(lw, lm, prompt, max_new_tokens=10, temperature=0.0)[0]
    ref, seq = _reference(lw), list(prompt)
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(ref(torch.tensor([seq]))[0, -1, : C.vocab_size].argmax()))
    assert got == seq[len(prompt):]


def test_eos_stops_each_sample():
    lm, lw = _model()
    free = sample(lw, lm, [1, 2, 3], max_new_tokens=8, temperature=1.0, seed=1, num_samples=2)
    eos = free[0][2]
    got = sample(lw, lm, [1, 2, 3], max_new_tokens=8, temperature=1.0, seed=1, num_samples=2, eos_ids=[eos])
    for f, g in zip(free, got, strict=True):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert g == f[:cut]


def test_step_flops_are_one_position_plus_cache_attention():
    """Planner FLOPs (einsums and the fused attention's contractions): a step costs the matmuls of one position per
    sequence plus attention over the cache; the recompute path costs the matmuls of all ``length`` positions for
    every token."""
    lm, lw = _model()
    dec = CachedDecoder.of(lw, lm)
    g = dec.graph
    step = dec.lowering.plan_counters([g.step_logits] + g.step_writes).einsum_flops
    full = lw.plan_counters(lm.logits).einsum_flops
    B, L, H, D, d = C.batch_size, C.length, C.num_heads, C.d_kv, C.d_model
    weights = C.num_layers * (4 * d * H * D + 2 * d * C.d_ff) + d * C.padded_vocab  # multiply-adds per position
    attention = C.num_layers * 2 * (2 * B * H * L * D)  # one position's q.k and weights.v over L positions
    assert full == L * (2 * B * weights + attention)  # the fused attention op counts its two contractions
    assert step == 2 * B * weights + attention  # the step's einsums over the cache
    assert step * 4 < full  # at length 16; the ratio grows with length


def test_step_outside_the_cache_is_refused():
    lm, lw = _model()
    with pytest.raises(ValueError, match="position 16 is outside"):
        CachedDecoder.of(lw, lm).step(torch.zeros(C.batch_size, dtype=torch.int64), C.length)


def test_no_cached_decoder_for_pipelines_and_moe():
    with pytest.raises(ValueError, match="pipeline_stages"):
        build_lm_decoder(LMConfig(num_layers=2, pipeline_stages=2, microbatches=2, batch_size=4))
    with pytest.raises(ValueError, match="num_experts"):
        build_lm_decoder(LMConfig(num_layers=2, num_experts=2))

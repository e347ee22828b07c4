"""Families added as registry records only (meshtorch.models.hf_families): Qwen2 (Llama + q/k/v biases) and
Mistral (Llama with a sliding window), against ``transformers``' ``Qwen2ForCausalLM`` / ``MistralForCausalLM``:
logits on 1 processor and the 2x2 Megatron layout, greedy KV-cache decoding of peaked models against
``generate``, the export round trip, and the sliding-window refusal."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.models.hf_families import hf_tensor_map  # noqa: E402
from meshtorch.runtime.generate import sample  # noqa: E402
from meshtorch.testing import rel_error  # noqa: E402

B, L = 2, 16
MP = "batch:data;heads:model;kv_heads:model;d_ff:model;vocab:model"
LAYOUTS = [("", "", ""), ("data:2", "batch:data", ""), ("data:2;model:2", MP, "d_model:data")]
PROMPT, NEW, LENGTH = 6, 64, 70  # issue 30: 64 greedy tokens; the peaked fixtures' context and window


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: (model, dir)} and {family + "_peaked": (peaked model, dir)}."""
    root = tmp_path_factory.mktemp("hf_records")
    out = {}
    for fam in F.RECORDS:
        for tag, m in ((fam, F.make_model(fam)), (f"{fam}_peaked", F.make_peaked_model(fam, LENGTH, LENGTH))):
            out[tag] = (m, F.save(m, str(root / tag)))
    return out


@pytest.mark.parametrize("family", F.RECORDS)
@pytest.mark.parametrize("mesh,layout,storage", LAYOUTS, ids=["1", "batch", "2x2"])
def test_logits_match_transformers(saved, family, mesh, layout, storage):
    ref, path = saved[family]
    ids = F.token_batch(B, L)
    with torch.no_grad():
        want = ref(ids).logits
    model, lw = hf.load(path, mtf.PlacementMeshImpl(mesh, layout, storage=storage or None), batch_size=B, length=L)
    assert rel_error(lw.run(model.logits, feeds={model.inputs: ids, model.targets: ids}), want) <= 1e-5


@pytest.mark.parametrize("family", F.RECORDS)
def test_greedy_kv_cache_equals_transformers_generate(saved, family):
    ref, path = saved[f"{family}_peaked"]
    prompts = F.token_batch(2, PROMPT, seed=11)
    with torch.no_grad():
        want = ref.generate(prompts, max_new_tokens=NEW, do_sample=False, use_cache=True, eos_token_id=None,
                            pad_token_id=0, attention_mask=torch.ones_like(prompts))[:, PROMPT:].tolist()
    model, lw = hf.load(path, mtf.PlacementMeshImpl("data:2;model:2", MP), batch_size=2, length=LENGTH)
    got = [sample(lw, model, p, max_new_tokens=NEW, temperature=0.0)[0] for p in prompts]
    assert got == want
    assert all(len(set(w)) > 5 for w in want)  # attention decides: not a constant continuation


@pytest.mark.parametrize("family", F.RECORDS)
def test_export_round_trip(saved, family, tmp_path):
    """import on the 2x2 layout -> export -> ``from_pretrained``: the same class, bitwise-equal parameters."""
    ref, path = saved[family]
    model, lw = hf.load(path, mtf.PlacementMeshImpl("data:2;model:2", MP, storage="d_model:data"), batch_size=B,
                        length=L)
    out = str(tmp_path / "out")
    hf.export(lw, model, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(ref)
    want = dict(ref.named_parameters())
    assert sorted(n for n, _ in back.named_parameters()) == sorted(want)
    for name, p in back.named_parameters():
        assert torch.equal(p, want[name]), name


def test_sliding_window_shorter_than_context_refused(saved):
    _, path = saved["mistral"]
    with pytest.raises(ValueError, match=f"sliding_window {F.WINDOW} is shorter than the context length 49"):
        hf.load(path, batch_size=1, length=F.WINDOW + 1)


def test_qwen2_biases_are_mapped(saved):
    """Qwen2's record adds q/k/v biases (and no output bias): the map holds exactly those bias tensors."""
    cfg = hf.read_config(saved["qwen2"][1])
    biases = sorted(t.key for t in hf_tensor_map(cfg) if t.key.endswith(".bias"))
    assert biases == sorted(f"model.layers.{i}.self_attn.{w}_proj.bias" for i in range(F.LAYERS) for w in "qkv")


def test_llama_attention_and_mlp_biases(tmp_path):
    """Llama's ``attention_bias`` (q, k, v and o) and ``mlp_bias`` are block options of the same builder."""
    cfg = F.hf_config("llama_gqa")
    cfg.attention_bias, cfg.mlp_bias = True, True
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    path = F.save(ref, str(tmp_path / "llama_bias"))
    ids = F.token_batch(B, L)
    with torch.no_grad():
        want = ref(ids).logits
    model, lw = hf.load(path, mtf.PlacementMeshImpl("data:2;model:2", MP), batch_size=B, length=L)
    assert rel_error(lw.run(model.logits, feeds={model.inputs: ids, model.targets: ids}), want) <= 1e-5

"""Hugging Face GPT-2 / Llama checkpoints in and out (meshtorch.checkpoint.hf, meshtorch.models.hf), against
``transformers`` itself: logits under several meshes and layouts, sharded files, export round trips,
AdamW fine-tuning steps, greedy decoding, and the refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.runtime.generate import sample  # noqa: E402
from meshtorch.testing import rel_error  # noqa: E402

B, L = 4, 16
MP = "batch:data;heads:model;kv_heads:model;d_ff:model;vocab:model"
LAYOUTS = [  # (mesh shape, compute layout, storage layout)
    ("", "", ""),
    ("data:4", "batch:data", ""),
    ("model:2", "heads:model;d_ff:model;vocab:model", ""),
    ("data:2;model:2", MP, ""),
    ("data:2;model:2", MP, "d_model:data"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: (transformers model, directory)}; plus a sharded Llama save."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for fam in F.FAMILIES:
        m = F.make_model(fam)
        out[fam] = (m, F.save(m, str(root / fam)))
    m = out["llama_gqa"][0]
    out["llama_sharded"] = (m, F.save(m, str(root / "llama_sharded"), max_shard_size="40KB"))
    return out


def _impl(mesh, layout, storage):
    return mtf.PlacementMeshImpl(mesh, layout, storage=storage or None)


def _logits(model, lw, ids):
    return lw.run(model.logits, feeds={model.inputs: ids, model.targets: ids})


@pytest.mark.parametrize("family", F.FAMILIES)
@pytest.mark.parametrize("mesh,layout,storage", LAYOUTS, ids=[f"{m}|{lay}|{s}" for m, lay, s in LAYOUTS])
def test_logits_match_transformers(saved, family, mesh, layout, storage):
    ref_model, path = saved[family]
    ids = F.token_batch(B, L)
    with torch.no_grad():
        want = ref_model(ids).logits
    model, lw = hf.load(path, _impl(mesh, layout, storage), batch_size=B, length=L)
    got = _logits(model, lw, ids)
    assert rel_error(got, want) <= 1e-5, (family, mesh, layout, storage)


def test_sharded_checkpoint_loads(saved):
    ref_model, path = saved["llama_sharded"]
    files = os.listdir(path)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    ids = F.token_batch(B, L)
    with torch.no_grad():
        want = ref_model(ids).logits
    model, lw = hf.load(path, _impl("data:2;model:2", MP, "d_model:data"), batch_size=B, length=L)
    assert rel_error(_logits(model, lw, ids), want) <= 1e-5


def _param_count(m) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("family", F.FAMILIES)
def test_export_round_trip_bitwise(saved, family, tmp_path):
    """import on a 2x2 FSDP layout -> export -> from_pretrained: bitwise-equal logits and parameters."""
    ref_model, path = saved[family]
    model, lw = hf.load(path, _impl("data:2;model:2", MP, "d_model:data"), batch_size=B, length=L)
    out = str(tmp_path / "out")
    written = hf.export(lw, model, out)
    assert written == ["model.safetensors", "config.json"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(ref_model)
    ids = F.token_batch(B, L, seed=5)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref_model(ids).logits)
    want = dict(ref_model.named_parameters())
    for name, p in back.named_parameters():
        assert torch.equal(p, want[name]), name
    assert _param_count(back) == _param_count(ref_model)


def test_sharded_export(saved, tmp_path):
    ref_model, path = saved["gpt2"]
    model, lw = hf.load(path, _impl("data:4", "batch:data", "d_model:data"), batch_size=B, length=L)
    out = str(tmp_path / "sharded")
    written = hf.export(lw, model, out, max_shard_size=64 * 1024)
    shards = [f for f in written if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in written
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = F.token_batch(B, L, seed=6)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref_model(ids).logits)
    # and meshtorch reads its own sharded export
    model2, lw2 = hf.load(out, _impl("", "", ""), batch_size=B, length=L)
    assert torch.equal(_logits(model2, lw2, ids), _logits(model, lw, ids))


@pytest.mark.parametrize("family,mesh,layout,storage", [
    ("gpt2", "data:2;model:2", MP, "d_model:data"),
    ("llama_gqa", "data:2;model:2", MP, ""),
    ("llama_tied", "", "", ""),
])
def test_adamw_finetuning_matches_torch(saved, family, mesh, layout, storage):
    """10 AdamW steps: meshtorch's AdamWOptimizer on the imported graph vs torch.optim.AdamW on transformers."""
    ref_model, path = saved[family]
    torch_model = F.make_model(family).train()  # same seed: the same weights as the saved model
    lr, wd = 3e-3, 0.01
    opt = torch.optim.AdamW(torch_model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    model, lw = hf.load(path, _impl(mesh, layout, storage), batch_size=B, length=L,
                        optimizer=mtf.optim.AdamWOptimizer(learning_rate=lr, epsilon=1e-8, weight_decay=wd))
    ours, theirs = [], []
    for step in range(10):
        ids = F.token_batch(B, L + 1, seed=100 + step % 2)  # two batches, alternating: the loss falls
        loss = lw.run([model.loss] + model.updates, feeds={model.inputs: ids[:, :-1], model.targets: ids[:, 1:]})[0]
        ours.append(float(loss))
        logits = torch_model(ids[:, :-1]).logits
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, F.VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        ref.backward()
        opt.step()
        theirs.append(float(ref.detach()))
    assert theirs[-1] < theirs[0]  # it learns
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_greedy_decoding_equals_generate(saved, family):
    ref_model, path = saved[family]
    prompt = F.token_batch(1, 5, seed=9)
    with torch.no_grad():
        want = ref_model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  attention_mask=torch.ones_like(prompt))[0, 5:].tolist()
    model, lw = hf.load(path, _impl("model:2", "heads:model;kv_heads:model;d_ff:model;vocab:model", ""),
                        batch_size=1, length=32)
    got = sample(lw, model, prompt[0], max_new_tokens=20, temperature=0.0)[0]
    assert len(want) == 20 and got == want


# ---------------------------------------------------------------------------------------------- refusals


def _copy(saved, family, tmp_path) -> str:
    dst = str(tmp_path / family)
    shutil.copytree(saved[family][1], dst)
    return dst


def _edit_config(path, **changes):
    cfile = os.path.join(path, "config.json")
    cfg = json.load(open(cfile))
    cfg.update(changes)
    json.dump(cfg, open(cfile, "w"))


def test_refuses_missing_config(saved, tmp_path):
    path = _copy(saved, "gpt2", tmp_path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(mtf.CheckpointError, match="has no config.json"):
        hf.load(path, batch_size=1, length=4)


def test_refuses_unknown_model_type(saved, tmp_path):
    path = _copy(saved, "gpt2", tmp_path)
    _edit_config(path, model_type="mamba")
    with pytest.raises(mtf.CheckpointError, match="model_type 'mamba' is not supported"):
        hf.load(path, batch_size=1, length=4)


@pytest.mark.parametrize("field,value", [("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
                                         ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}),
                                         ("hidden_act", "gelu")])
def test_refuses_unsupported_llama_fields(saved, tmp_path, field, value):
    path = _copy(saved, "llama_gqa", tmp_path)
    _edit_config(path, **{field: value})
    with pytest.raises(mtf.CheckpointError, match=f"field '{field}'"):
        hf.load(path, batch_size=1, length=4)


def test_refuses_unsupported_gpt2_field(saved, tmp_path):
    path = _copy(saved, "gpt2", tmp_path)
    _edit_config(path, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(mtf.CheckpointError, match="field 'scale_attn_by_inverse_layer_idx'"):
        hf.load(path, batch_size=1, length=4)


def test_refuses_shape_mismatch(saved, tmp_path):
    path = _copy(saved, "llama_gqa", tmp_path)
    _edit_config(path, intermediate_size=128)
    with pytest.raises(mtf.CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' in .*model.safetensors.* "
                                                  r"has shape \[96, 64\], but config.json implies \[128, 64\]"):
        hf.load(path, batch_size=1, length=4)


def test_refuses_missing_and_unknown_tensors(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(saved, "gpt2", tmp_path)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(mtf.CheckpointError, match=r"tensor 'transformer.h.1.mlp.c_fc.bias' is missing from .*"
                                                  r"model.safetensors"):
        hf.load(path, batch_size=1, length=4)
    tensors["transformer.h.1.mlp.c_fc.bias"] = torch.zeros(4 * F.D)
    tensors["transformer.h.1.adapter.weight"] = torch.zeros(3)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(mtf.CheckpointError, match="adapter.weight"):
        hf.load(path, batch_size=1, length=4)


def test_refuses_missing_shard(saved, tmp_path):
    path = _copy(saved, "llama_sharded", tmp_path)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(mtf.CheckpointError, match=f"file .*{victim}.*, which holds tensor .* is missing"):
        hf.load(path, batch_size=1, length=4)


def test_refuses_length_past_positions(saved):
    with pytest.raises(ValueError, match="n_positions"):
        hf.load(saved["gpt2"][1], batch_size=1, length=F.POSITIONS + 1)

"""The command line with a Hugging Face model: ``meshtorch train --init-from`` (tokenizer.json through
``tokenizers``), ``meshtorch sample`` and ``meshtorch export``, checked against ``transformers``."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.cli import build_parser, main  # noqa: E402
from meshtorch.data.hf_tokenizer import HFTokenizer  # noqa: E402
from meshtorch.data.text import PackedDataset, load_documents  # noqa: E402
from meshtorch.runtime import generate  # noqa: E402

MP = "batch:data;heads:model;kv_heads:model;d_ff:model;vocab:model"
_text, _tokenizer = F.text, F.bpe_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfcli")
    ref = F.make_model("llama_gqa")
    d = F.save(ref, str(root / "llama"))
    text = _text()
    _tokenizer(os.path.join(d, "tokenizer.json"), text)
    data = root / "data.txt"
    data.write_text(text)
    return ref, d, str(data)


def _run(argv):
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_finetune_sample_export(model_dir, tmp_path):
    ref, d, data = model_dir
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    res = _run(["train", "--init-from", d, "--data", data, "--mesh", "data:2,model:2", "--layout", MP,
                "--storage", "d_model:data", "--steps", "6", "--batch-size", "4", "--length", "16", "--lr", "3e-3",
                "--warmup-steps", "1", "--clip-norm", "0", "--eval-every", "3", "--eval-batches", "1",
                "--checkpoint-dir", ck, "--plot", "", "--sample", "6", "--prompt", "the cat", "--temperature", "0"])
    # the first step's loss is transformers' loss on the first batch, tokenized with the model's tokenizer.json
    tok = HFTokenizer(os.path.join(d, "tokenizer.json"))
    batch = next(PackedDataset.from_documents(load_documents([data]), tok, 17).batches(4, seed=0))
    with torch.no_grad():
        logits = ref(batch[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, F.VOCAB), batch[:, 1:].reshape(-1)).item()
    losses = res["history"]["loss"]
    assert abs(losses[0] - want) <= 1e-5 * want, (losses[0], want)
    assert losses[-1] < losses[0]
    assert os.path.isfile(os.path.join(ck, "tokenizer.json"))
    manifest = json.load(open(os.path.join(ck, "ckpt-6", "manifest.json")))
    assert manifest["extra"]["hf_config"]["model_type"] == "llama"
    # export on another layout, load with transformers; greedy decoding from the checkpoint == generate()
    assert main(["export", "--checkpoint-dir", ck, "--hf", out, "--mesh", "model:2",
                 "--layout", "heads:model;kv_heads:model"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not torch.equal(tuned.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight)
    prompt = tok.encode("the cat sat")
    ids = torch.as_tensor(prompt)[None]
    with torch.no_grad():
        want_ids = tuned.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    got = _run(["sample", "--checkpoint-dir", ck, "--prompt", "the cat sat", "--max-new-tokens", "8",
                "--temperature", "0", "--mesh", "data:2", "--layout", "batch:data"])
    assert got == [want_ids]


def test_sample_straight_from_hf_dir(model_dir, capsys):
    ref, d, _ = model_dir
    tok = HFTokenizer(os.path.join(d, "tokenizer.json"))
    prompt = tok.encode("a dog ran")
    ids = torch.as_tensor(prompt)[None]
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                            attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    got = _run(["sample", "--checkpoint-dir", d, "--prompt", "a dog ran", "--max-new-tokens", "10",
                "--temperature", "0"])
    assert got == [want]
    assert "a dog ran" + tok.decode(want) in capsys.readouterr().out


def test_sample_no_cache_recomputes_the_same_tokens(model_dir, monkeypatch):
    """``--no-cache``: greedy and beam tokens of the recompute path equal the cached path's, and no cached decoder
    is built."""
    _, d, _ = model_dir
    argv = ["sample", "--checkpoint-dir", d, "--prompt", "a dog ran", "--max-new-tokens", "8", "--no-progress"]
    cached = [_run(argv + ["--temperature", "0"]), _run(argv + ["--beam", "2"])]
    monkeypatch.setattr(generate.CachedDecoder, "of", classmethod(lambda *a: pytest.fail("--no-cache used the cache")))
    assert [_run(argv + ["--temperature", "0", "--no-cache"]), _run(argv + ["--beam", "2", "--no-cache"])] == cached


def test_init_from_refusals(model_dir, tmp_path, capsys):
    _, d, data = model_dir
    assert main(["train", "--init-from", d, "--data", data, "--layers", "3", "--plot", ""]) == 2
    assert "--layers cannot be combined with --init-from" in capsys.readouterr().err
    assert main(["train", "--init-from", str(tmp_path), "--data", data, "--plot", ""]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["export", "--checkpoint-dir", d, "--hf", str(tmp_path / "x")]) == 2
    assert "already a Hugging Face directory" in capsys.readouterr().err
    t5 = F.save_t5(F.make_t5(), str(tmp_path / "t5"))
    assert main(["train", "--init-from", t5, "--data", data, "--plot", ""]) == 2
    assert "tokenizer.json' does not exist" in capsys.readouterr().err  # T5 without its tokenizer: refused


def test_resume_on_another_layout(model_dir, tmp_path):
    """3 steps on a 2x2 FSDP layout, then --resume to step 5 on data:4 == 5 uninterrupted steps."""
    _, d, data = model_dir
    common = ["train", "--init-from", d, "--data", data, "--batch-size", "4", "--length", "16", "--lr", "3e-3",
              "--schedule", "constant", "--clip-norm", "0", "--eval-every", "100", "--eval-batches", "1",
              "--plot", "", "--sample", "0"]
    ck = str(tmp_path / "ck")
    _run(common + ["--steps", "3", "--checkpoint-dir", ck, "--mesh", "data:2,model:2", "--layout", MP,
                   "--storage", "d_model:data"])
    resumed = _run(common + ["--steps", "5", "--checkpoint-dir", ck, "--resume", "--mesh", "data:4",
                             "--layout", "batch:data"])["history"]
    straight = _run(common + ["--steps", "5", "--checkpoint-dir", str(tmp_path / "ck2"), "--mesh", "",
                              "--layout", ""])["history"]
    assert resumed["step"] == [0, 1, 2, 3, 4]  # the run's history goes on from its checkpoint
    for a, b in zip(resumed["loss"], straight["loss"], strict=True):
        assert abs(a - b) <= 1e-5 * b, (resumed["loss"], straight["loss"])

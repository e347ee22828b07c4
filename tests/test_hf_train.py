"""``meshtorch train --init-from`` is ``meshtorch train``: one loop, one run directory, one set of flags (each
runs for a native preset, a GPT-2 and a Llama directory, or is refused by name), and the safe defaults on that
path (another run's checkpoints refused, no tokenizer refused, unknown prompt characters reported, --resume
without retyping flags, a padded vocabulary giving transformers' logits, decoding that stops at EOS)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.core.mesh_spec import MeshSpec  # noqa: E402
from meshtorch.data.hf_tokenizer import HFTokenizer  # noqa: E402
from meshtorch.runtime import generate  # noqa: E402
from meshtorch.runtime.train_config import DEFAULT_LAYOUT, DEFAULT_MESH  # noqa: E402

ODD_VOCAB = 257  # a mesh axis of 2 does not divide it (GPT-2's 50257 neither)
SHORT = ["--steps", "2", "--batch-size", "4", "--length", "16", "--eval-every", "2", "--eval-batches", "1",
         "--plot", "", "--sample", "0", "--lr", "1e-3", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``(llama dir with tokenizer.json, gpt2 dir with vocab 257 and no tokenizer.json, data file, gpt2 model)``."""
    root = tmp_path_factory.mktemp("hftrain")
    llama = F.save(F.make_model("llama_gqa"), str(root / "llama"))
    text = F.text()
    F.bpe_tokenizer(os.path.join(llama, "tokenizer.json"), text)
    gpt2_ref = F.make_model("gpt2", vocab=ODD_VOCAB)
    gpt2 = F.save(gpt2_ref, str(root / "gpt2"))
    data = root / "data.txt"
    data.write_text(text)
    return llama, gpt2, str(data), gpt2_ref


_run, _cli = F.run, F.cli


@pytest.mark.parametrize("vocab", [ODD_VOCAB, 50257])  # 50257: GPT-2's own vocabulary
def test_padded_vocab_logits_equal_transformers_on_the_default_layout(dirs, tmp_path, vocab):
    """GPT-2 with an odd vocabulary (257, and GPT-2's 50257) on the default 2x2 layout, vocab:model: the
    vocabulary is padded by one; the real logits equal transformers', the padded one is masked, the loss is
    transformers' loss."""
    if vocab == ODD_VOCAB:
        _, gpt2, _, ref = dirs
    else:
        ref = F.make_model("gpt2", vocab=vocab)
        gpt2 = F.save(ref, str(tmp_path / "gpt2"))
    c = hf.read_config(gpt2).with_shape(2, 16).replace(vocab_multiple=MeshSpec(DEFAULT_MESH, DEFAULT_LAYOUT)
                                                       .axis_size_for("vocab"))
    assert c.padded_vocab == vocab + 1
    lm = hf.build(c)
    lw = hf.lower_loaded(lm, MeshSpec(DEFAULT_MESH, DEFAULT_LAYOUT), gpt2)
    ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(3))
    logits, loss = lw.run([lm.logits, lm.loss], feeds={lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})
    with torch.no_grad():
        want = ref(ids[:, :-1]).logits
    want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    assert logits.shape[-1] == vocab + 1
    torch.testing.assert_close(logits[..., :vocab], want, rtol=1e-5, atol=1e-5)
    assert bool((logits[..., vocab:] < -1e8).all())
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item()
    assert not bool(lw.variable_value("embed")[vocab:].any())  # the padded row is zero


def test_gpt2_odd_vocab_trains_on_the_default_layout_and_exports_unpadded(dirs, tmp_path, capsys):
    """The default mesh and layout (vocab:model) with vocab 257 and --tokenizer byte: the first loss is
    transformers' loss on the same batch; export strips the padding (transformers loads it)."""
    _, gpt2, data, ref = dirs
    runs = str(tmp_path / "runs")
    res = _run(["train", "--init-from", gpt2, "--tokenizer", "byte", "--data", data, "--runs-dir", runs,
                "--run-name", "g", *SHORT])
    from meshtorch.data.text import ByteTokenizer, PackedDataset, load_documents

    batch = next(PackedDataset.from_documents(load_documents([data]), ByteTokenizer(), 17).batches(4, seed=0))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ref(batch[:, :-1]).logits.reshape(-1, ODD_VOCAB),
                                                 batch[:, 1:].reshape(-1)).item()
    assert abs(res["history"]["loss"][0] - want) <= 1e-5 * want, (res["history"]["loss"], want)
    out = str(tmp_path / "out")
    rc, log = _cli(capsys, "export", "--checkpoint-dir", os.path.join(runs, "g", "ckpt"), "--hf", out)
    assert rc == 0, log
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert tuned.transformer.wte.weight.shape == (ODD_VOCAB, F.D)
    lw = res["lowering"]
    torch.testing.assert_close(tuned.transformer.wte.weight, lw.variable_value("embed")[:ODD_VOCAB])


def test_fine_tune_run_directory_then_sample_by_run_name(dirs, tmp_path, capsys):
    """--init-from --run-name ft writes runs/ft/ckpt with run.json (source model, its config.json), metrics.jsonl
    with --log-dir, and `meshtorch sample --run-name ft` decodes it with the model's tokenizer."""
    llama, _, data, _ = dirs
    runs, logs = str(tmp_path / "runs"), str(tmp_path / "logs")
    rc, out = _cli(capsys, "train", "--init-from", llama, "--data", data, "--runs-dir", runs, "--run-name", "ft",
                   "--log-dir", logs, *SHORT)
    assert rc == 0, out
    ck = os.path.join(runs, "ft", "ckpt")
    record = json.load(open(os.path.join(ck, "run.json")))
    assert record["init_from"] == os.path.abspath(llama) and record["hf_config"]["model_type"] == "llama"
    assert record["tokenizer"] == "tokenizer.json" and os.path.isfile(os.path.join(ck, "tokenizer.json"))
    rows = [json.loads(line) for line in open(os.path.join(logs, "metrics.jsonl"))]
    assert any("mfu" in r and "tokens_per_s" in r for r in rows), rows
    assert "MFU" in out and "tokens/s" in out
    rc, out = _cli(capsys, "sample", "--runs-dir", runs, "--run-name", "ft", "--prompt", "the cat",
                   "--max-new-tokens", "4", "--temperature", "0")
    assert rc == 0 and out.startswith("the cat"), out


def test_init_from_into_another_runs_checkpoint_dir_is_refused(dirs, tmp_path, capsys):
    llama, _, data, _ = dirs
    ck = tmp_path / "ck"
    rc, out = _cli(capsys, "train", "--init-from", llama, "--data", data, "--checkpoint-dir", str(ck), *SHORT)
    assert rc == 0, out
    before = {p.name: p.stat().st_mtime_ns for p in ck.iterdir()}
    rc, out = _cli(capsys, "train", "--init-from", llama, "--data", data, "--checkpoint-dir", str(ck), *SHORT)
    assert rc == 2 and "--checkpoint-dir" in out and "already holds checkpoints" in out and "ckpt-2" in out, out
    assert {p.name: p.stat().st_mtime_ns for p in ck.iterdir()} == before  # nothing written, tokenizer untouched


def test_no_tokenizer_json_is_refused_unless_tokenizer_byte(dirs, tmp_path, capsys):
    _, gpt2, data, _ = dirs
    rc, out = _cli(capsys, "train", "--init-from", gpt2, "--data", data, "--runs-dir", str(tmp_path), *SHORT)
    assert rc == 2 and os.path.join(gpt2, "tokenizer.json") in out and "--tokenizer byte" in out, out
    assert not (tmp_path / "latest").exists()
    rc, out = _cli(capsys, "train", "--init-from", gpt2, "--data", data, "--runs-dir", str(tmp_path),
                   "--tokenizer", "byte", *SHORT)
    assert rc == 0, out


def test_unknown_prompt_characters_are_reported(dirs, tmp_path, capsys):
    llama, _, data, _ = dirs
    rc, out = _cli(capsys, "train", "--init-from", llama, "--data", data, "--runs-dir", str(tmp_path),
                   *SHORT, "--sample", "3", "--prompt", "the cat ate ü")
    tok = HFTokenizer(os.path.join(llama, "tokenizer.json"))
    bad = tok.unknown_characters("the cat ate ü")
    assert "ü" in bad and 0 in tok.encode("ü").tolist()  # [UNK] is id 0 of the fixture's tokenizer
    assert rc == 2 and "--prompt" in out and "'ü'" in out, out
    rc, out = _cli(capsys, "sample", "--checkpoint-dir", llama, "--prompt", "a dog ü", "--max-new-tokens", "2")
    assert rc == 2 and "--prompt" in out and "'ü'" in out, out


def test_eos_stops_sampling_as_transformers_generate(dirs, tmp_path):
    llama, _, _, _ = dirs
    d = str(tmp_path / "llama_eos")
    shutil.copytree(llama, d)
    tok = HFTokenizer(os.path.join(d, "tokenizer.json"))
    prompt = tok.encode("a dog ran")
    ids = torch.as_tensor(prompt)[None]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        free = ref.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                            attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a token first emitted at step k >= 2
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["eos_token_id"] = free[k]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=free[k], pad_token_id=0,
                            attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    got = _run(["sample", "--checkpoint-dir", d, "--prompt", "a dog ran", "--max-new-tokens", "12",
                "--temperature", "0"])
    assert got == [want] and len(want) == k + 1 < len(free)


def test_resume_takes_the_model_flags_from_run_json(dirs, tmp_path, capsys):
    """Native: a run with non-default model flags (even --remat) resumes with no model flag given, and its losses
    equal an uninterrupted run's; a flag given and different is refused by name. Imported: --resume without
    --init-from / --length / --batch-size continues the fine-tune."""
    llama, _, data, _ = dirs
    runs = str(tmp_path / "runs")
    native = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "2", "--d-kv", "16", "--d-ff", "64",
              "--remat", "block", "--norm", "rms"]
    common = ["--data", data, "--runs-dir", runs, "--eval-every", "10", "--eval-batches", "1", "--plot", "",
              "--sample", "0", "--schedule", "constant", "--mesh", "", "--layout", ""]
    straight = _run(["train", *native, "--batch-size", "4", "--length", "16", *common, "--steps", "4",
                     "--run-name", "s"])["history"]["loss"]
    _run(["train", *native, "--batch-size", "4", "--length", "16", *common, "--steps", "2", "--run-name", "n"])
    rc, out = _cli(capsys, "train", *common, "--steps", "4", "--run-name", "n", "--resume", "--layers", "2")
    assert rc == 2 and "--layers 2 differs" in out and "1" in out, out
    resumed = _run(["train", *common, "--steps", "4", "--run-name", "n", "--resume"])["history"]["loss"]
    assert resumed == pytest.approx(straight, rel=1e-6)
    ft = ["--data", data, "--runs-dir", runs, "--eval-every", "10", "--eval-batches", "1", "--plot", "",
          "--sample", "0", "--schedule", "constant", "--clip-norm", "0"]
    first = _run(["train", "--init-from", llama, *ft, "--length", "16", "--batch-size", "4", "--steps", "3",
                  "--run-name", "f0"])["history"]["loss"]
    _run(["train", "--init-from", llama, *ft, "--length", "16", "--batch-size", "4", "--steps", "2",
          "--run-name", "f"])
    again = _run(["train", *ft, "--steps", "3", "--run-name", "f", "--resume"])["history"]["loss"]
    assert again == pytest.approx(first, rel=1e-6)


NATIVE = ["--preset", "tiny", "--layers", "2", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64"]


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
def test_native_run_exports_as_gpt2_with_our_logits(dirs, tmp_path, capsys, monkeypatch, activation):
    """A native ``--norm layer`` run (learned positions, LayerNorm, ungated MLP) exports as GPT2LMHeadModel whose
    logits equal the native graph's on the trained layout; the default RMSNorm LM is refused in one line. The
    native run's ``sample --no-cache`` gives the cached path's greedy tokens without building a cached decoder."""
    _, _, data, _ = dirs
    runs = str(tmp_path / "runs")
    res = _run(["train", *NATIVE, "--norm", "layer", "--activation", activation, "--data", data, "--runs-dir", runs,
                "--run-name", "n", *SHORT])
    out = str(tmp_path / "out")
    rc, log = _cli(capsys, "export", "--checkpoint-dir", os.path.join(runs, "n", "ckpt"), "--hf", out)
    assert rc == 0, log
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "GPT2LMHeadModel"
    lm, lw = res["lm"], res["lowering"]
    ids = torch.randint(0, lm.config.vocab_size, (lm.config.batch_size, lm.config.length),
                        generator=torch.Generator().manual_seed(3))
    ours = lw.run(lm.logits, feeds={lm.inputs: ids, lm.targets: ids})[..., : lm.config.vocab_size]
    with torch.no_grad():
        want = back(ids).logits
    assert (ours - want).abs().max() <= 1e-5 * want.abs().max()
    if activation == "gelu_tanh":
        argv = ["sample", "--runs-dir", runs, "--run-name", "n", "--temperature", "0", "--max-new-tokens", "6",
                "--no-progress"]
        cached = _run(argv)
        monkeypatch.setattr(generate.CachedDecoder, "of", classmethod(lambda *a: pytest.fail("--no-cache: cache used")))
        assert _run(argv + ["--no-cache"]) == cached
    if activation == "relu":
        rc, log = _cli(capsys, "train", *NATIVE, "--data", data, "--runs-dir", runs, "--run-name", "r", *SHORT)
        assert rc == 0, log
        rc, log = _cli(capsys, "export", "--checkpoint-dir", os.path.join(runs, "r", "ckpt"), "--hf",
                       str(tmp_path / "r_out"))
        assert rc == 2 and "maps to no Hugging Face family" in log and "RMSNorm" in log, log
        assert len([ln for ln in log.splitlines() if "error" in ln.lower()]) == 1, log

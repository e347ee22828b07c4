"""Checkpoints of ``--init-from`` runs written before the one block builder (main 22cc587: GPT-2's ``wte``,
``h{i}/attn/q`` + ``h{i}/attn/q_bias``, ``ln_f``; Llama's ``embed_tokens``, ``layers{i}/mlp/gate``, ``norm``) still
resume, sample and export. The old names are spelled here from 22cc587's ``hf_tensor_map``, independently of
``meshtorch.models.hf_legacy``: a run is written by today's code, its manifest renamed to the old scheme (as 22cc587
wrote it); ``export`` must write the same tensors as before the renaming, ``sample`` must run, and ``--resume``
must continue it to the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.cli import build_parser, main  # noqa: E402

# 22cc587's variable names, by the HF tensor each was read from (models/hf_config.py: hf_tensor_map there)
_OLD_GPT2 = {"embed": "wte", "positions": "wpe", "final_norm/scale": "ln_f/scale", "final_norm/bias": "ln_f/bias",
             r"layers(\d+)/attn_norm/(scale|bias)": r"h\1/ln_1/\2",
             r"layers(\d+)/mlp_norm/(scale|bias)": r"h\1/ln_2/\2",
             r"layers(\d+)/attn/(\w)/kernel": r"h\1/attn/\2", r"layers(\d+)/attn/(\w)/bias": r"h\1/attn/\2_bias",
             r"layers(\d+)/mlp/(wi|wo)/kernel": r"h\1/mlp/\2",
             r"layers(\d+)/mlp/(wi|wo)/bias": r"h\1/mlp/\2_bias"}
_OLD_LLAMA = {"embed": "embed_tokens", "lm_head": "lm_head", "final_norm/scale": "norm/scale",
              r"layers(\d+)/attn_norm/scale": r"layers\1/input_layernorm/scale",
              r"layers(\d+)/mlp_norm/scale": r"layers\1/post_attention_layernorm/scale",
              r"layers(\d+)/attn/(\w)/kernel": r"layers\1/attn/\2",
              r"layers(\d+)/mlp/wi_gate/kernel": r"layers\1/mlp/gate",
              r"layers(\d+)/mlp/wi/kernel": r"layers\1/mlp/up", r"layers(\d+)/mlp/wo/kernel": r"layers\1/mlp/down"}
FT = ["--eval-every", "10", "--eval-batches", "1", "--plot", "", "--sample", "0", "--schedule", "constant",
      "--clip-norm", "0", "--length", "16", "--batch-size", "4"]


def _old(name: str, table: dict) -> str:
    """``name`` as 22cc587 spelled it (an optimizer slot ``{var}/adam_m`` follows its variable)."""
    base, sep, slot = name.partition("/adam_")
    for pat, rep in table.items():
        if re.fullmatch(pat, base):
            return re.sub(pat, rep, base) + sep + slot
    return name


def _to_old_scheme(ckpt_root: str, table: dict) -> list[str]:
    """Rename the variables of the newest checkpoint under ``ckpt_root`` in its manifest; the renamed names."""
    step = max(int(d.split("-")[1]) for d in os.listdir(ckpt_root) if d.startswith("ckpt-"))
    path = os.path.join(ckpt_root, f"ckpt-{step}", "manifest.json")
    with open(path) as f:
        m = json.load(f)
    m["variables"] = {_old(n, table): e for n, e in m["variables"].items()}
    with open(path, "w") as f:
        json.dump(m, f)
    return sorted(m["variables"])


def _run(argv):
    args = build_parser().parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_a_22cc587_fine_tune_checkpoint_resumes_and_samples(family, tmp_path, capsys):
    model = F.save(F.make_model(family), str(tmp_path / "model"))
    text = F.text()
    F.bpe_tokenizer(os.path.join(model, "tokenizer.json"), text)
    data = tmp_path / "data.txt"
    data.write_text(text)
    runs = str(tmp_path / "runs")
    common = ["--init-from", model, "--data", str(data), "--runs-dir", runs, *FT]
    straight = _run(["train", *common, "--steps", "3", "--run-name", "s"])["history"]["loss"]
    _run(["train", *common, "--steps", "2", "--run-name", "old"])
    ckpt = os.path.join(runs, "old", "ckpt")
    assert main(["export", "--checkpoint-dir", ckpt, "--hf", str(tmp_path / "before")]) in (0, None)
    names = _to_old_scheme(os.path.join(runs, "old", "ckpt"), _OLD_GPT2 if family == "gpt2" else _OLD_LLAMA)
    old_embed = "wte" if family == "gpt2" else "embed_tokens"
    assert old_embed in names and "embed" not in names and not any("/kernel" in n for n in names), names
    rc = main(["sample", "--runs-dir", runs, "--run-name", "old", "--prompt", text[:5], "--max-new-tokens", "3",
               "--temperature", "0"])
    assert rc in (0, None), capsys.readouterr()
    assert main(["export", "--checkpoint-dir", ckpt, "--hf", str(tmp_path / "after")]) in (0, None)
    before, after = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("before", "after"))
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    resumed = _run(["train", "--data", str(data), "--runs-dir", runs, *FT, "--steps", "3", "--run-name", "old",
                    "--resume"])["history"]["loss"]
    assert resumed == pytest.approx(straight, rel=1e-6)

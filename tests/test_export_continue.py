"""Issue 30 acceptance: a native ``--norm layer`` run exported with ``meshtorch export --hf`` (GPT2LMHeadModel)
continues under ``train --init-from EXPORT --start-step N`` with the same losses as ``train --resume`` of the
native run (20 steps, 1e-6 relative).

An export carries weights only (no optimizer state), so the comparison uses plain ``--optimizer sgd``
(stateless) and ``--clip-norm 0``; the schedule (cosine with warmup) is not constant, so the step the
continuation starts at matters, as does the data position (``--start-step``). The export is a GPT-2 without the
projections' biases (``config.json``'s ``attention_bias`` / ``mlp_bias`` false, zeros in the file): with them the
continuation would train parameters the native run does not have. The reference is the native run itself:
``--resume`` restores its own checkpoint (weights, step, data position).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from transformers import GPT2LMHeadModel  # noqa: E402

import _hf_fixtures as F  # noqa: E402
from meshtorch.cli import build_parser  # noqa: E402
from meshtorch.core.errors import CheckpointError, UsageError  # noqa: E402
from meshtorch.data.text import ByteTokenizer, PackedDataset  # noqa: E402

N = 3
MODEL = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
         "--norm", "layer"]
OPT = ["--optimizer", "sgd", "--lr", "0.05", "--schedule", "cosine", "--warmup-steps", "5", "--clip-norm", "0",
       "--batch-size", "4", "--length", "16", "--eval-every", "100", "--eval-batches", "1", "--plot", "",
       "--sample", "0", "--mesh", "", "--layout", ""]


def _run(argv):
    args = build_parser().parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A native run of N steps, its export, and the ``--resume`` of that run for 20 more steps (its losses)."""
    tmp = tmp_path_factory.mktemp("exportcont")
    data = tmp / "data.txt"
    data.write_text(F.text())
    runs = str(tmp / "runs")
    common = ["--data", str(data), "--runs-dir", runs, *OPT]
    _run(["train", *MODEL, *common, "--steps", str(N), "--run-name", "n"])
    out = str(tmp / "hf")
    assert sorted(_run(["export", "--checkpoint-dir", os.path.join(runs, "n", "ckpt"), "--hf", out])) == [
        "config.json", "model.safetensors"]  # a byte-tokenizer run exports no tokenizer.json
    resumed = _run(["train", *common, "--steps", str(N + 20), "--run-name", "n", "--resume"])["history"]["loss"]
    return common, out, resumed[-20:]


def test_init_from_export_continues_like_resume(exported):
    common, out, resumed = exported
    ft = ["train", "--init-from", out, "--tokenizer", "byte", *common, "--start-step", str(N),
          "--steps", str(N + 20), "--run-name", "ft"]
    cont = _run(ft)["history"]["loss"]
    assert len(resumed) == len(cont) == 20
    assert cont == pytest.approx(resumed, rel=1e-6), (cont, resumed)


def test_export_is_a_bias_free_gpt2_that_transformers_loads(exported):
    """The export's biases are zeros and flagged absent; transformers loads every tensor (none missing)."""
    _, out, _ = exported
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["attention_bias"] is False and cfg["mlp_bias"] is False
    tensors = load_file(os.path.join(out, "model.safetensors"))
    biases = [k for k in tensors if k.endswith(("attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias",
                                                "mlp.c_proj.bias"))]
    assert len(biases) == 4 and all(not tensors[k].any() for k in biases)
    _, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info


def test_trained_bias_in_a_bias_free_export_is_refused(exported, tmp_path):
    """A bias made nonzero (trained elsewhere) under ``attention_bias: false`` is refused, naming the tensor."""
    common, out, _ = exported
    bad = str(tmp_path / "bad")
    shutil.copytree(out, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    key = "transformer.h.0.mlp.c_fc.bias"
    tensors[key] = tensors[key] + 0.5
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"transformer\.h\.0\.mlp\.c_fc\.bias.*is not zero"):
        _run(["train", "--init-from", bad, "--tokenizer", "byte", *common, "--steps", "1", "--run-name", "bad"])


@pytest.mark.parametrize("extra, match", [
    (["--start-step", "2"], "--start-step 2 continues an exported model"),  # no --init-from
    (["--start-step", "2", "--resume"], "--start-step 2 cannot be combined with --resume"),
    (["--init-from", "X", "--start-step", "5"], r"--start-step 5: --steps 5 counts steps in total"),
])
def test_start_step_misuse_refused_by_name(tmp_path, extra, match):
    with pytest.raises(UsageError, match=match):
        _run(["train", "--steps", "5", "--runs-dir", str(tmp_path), *extra])


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_start_step_bad_value_refused_at_parsing(value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--start-step", value])
    assert e.value.code == 2
    assert "argument --start-step:" in capsys.readouterr().err


def test_position_is_where_the_stream_stands():
    """``position(k)`` is the (epoch, batch) the stream reaches after k batches, across epoch ends, and
    ``stream`` started there yields the stream's (k+1)-th batch."""
    ds = PackedDataset.from_text(F.text(n=300), ByteTokenizer(), 17)
    per_epoch = len(ds.train) // 4
    reference = PackedDataset.stream(ds, 4, seed=1)
    seen = [next(reference) for _ in range(2 * per_epoch + 3)]
    for k in (0, 1, per_epoch - 1, per_epoch, per_epoch + 2, 2 * per_epoch + 1):
        epoch, done = ds.position(4, k)
        nxt = next(ds.stream(4, 1, epoch, done))
        assert (nxt[0], nxt[1]) == seen[k][:2] and torch.equal(nxt[2], seen[k][2]), k

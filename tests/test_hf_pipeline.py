"""``meshtorch train --init-from DIR`` with a pipeline layout (``stage:pipe``): a Hugging Face GPT-2 (tied head) or
Llama (grouped-query attention, untied head) trains as a pipeline, under the pipeline layout's own program
(``--pipeline-schedule gpipe``: stacked ``stack/...`` weights) and the stage executor (``1f1b``: one program per
stage), with the unpipelined run's losses and exported weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file  # noqa: E402

import _hf_fixtures as F  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.core.mesh_spec import MeshSpec  # noqa: E402

GPT2_VOCAB = 257  # >= 256 byte ids (--tokenizer byte), and odd: a vocab:model split pads it
STEPS = 3
FLAGS = ["--steps", str(STEPS), "--batch-size", "4", "--length", "16", "--eval-every", str(STEPS), "--eval-batches",
         "1", "--plot", "", "--sample", "0", "--lr", "1e-3", "--warmup-steps", "1", "--optimizer", "adamw",
         "--peak-tflops", "1"]  # a given peak: no matmul measured per run


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``{family: (model dir, extra train flags, transformers model)}`` and the data file."""
    d = F.train_dirs(tmp_path_factory.mktemp("hfpipe"), GPT2_VOCAB)
    return {"gpt2": (*d["gpt2"][:1], ["--tokenizer", "byte"], d["gpt2"][1]), "llama": (*d["llama"][:1], [],
                                                                                   d["llama"][1])}, d["data"]


_run, _cli = F.run, F.cli


@pytest.mark.parametrize("family,mesh,layout", [("gpt2", "pipe:2,data:2", "stage:pipe;heads:data;d_ff:data;vocab:data"),
                                                ("llama", "pipe:2", "stage:pipe")])
def test_pipeline_layout_loss_equals_transformers(dirs, family, mesh, layout, tmp_path):
    """The imported model built as a 2-stage pipeline (2 microbatches; weights read into the stacked variables row by
    row) gives transformers' loss on the same batch, and its logits; exported from the pipelined lowering (rows
    written back per layer), the tensors are the source files' (bitwise)."""
    (path, _, ref), _ = dirs[0][family], dirs[1]
    vocab = ref.config.vocab_size
    spec = MeshSpec(mesh, layout)
    c = hf.read_config(path).with_shape(4, 16).replace(vocab_multiple=spec.axis_size_for("vocab"), pipeline_stages=2,
                                                       microbatches=2)
    lm = hf.build(c)
    assert any(v.name.startswith("stack/") for v in lm.graph.trainable_variables)
    lw = hf.lower_loaded(lm, spec, path)
    ids = torch.randint(0, vocab, (4, 17), generator=torch.Generator().manual_seed(5))
    logits, loss = lw.run([lm.logits, lm.loss], feeds={lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})
    with torch.no_grad():
        want = ref(ids[:, :-1]).logits
    want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, vocab), ids[:, 1:].reshape(-1)).item()
    torch.testing.assert_close(logits[..., :vocab], want, rtol=1e-5, atol=1e-5)
    assert abs(loss.item() - want_loss) <= 1e-5 * want_loss, (loss.item(), want_loss)
    hf.export(lw, lm, str(tmp_path / "out"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    src = load_file(os.path.join(path, "model.safetensors"))
    assert set(got) <= set(src) and len(got) > 10
    for key, value in got.items():
        assert torch.equal(value, src[key]), key


def _train_and_export(capsys, tmp_path, path, extra, data, name, *flags):
    """Train with ``flags`` and ``--log-dir`` (and ``--pipeline-trace`` under the stage executor), export: the
    losses (also those of metrics.jsonl) and the exported tensors."""
    ck, out, logs = str(tmp_path / name / "ck"), str(tmp_path / name / "hf"), str(tmp_path / name / "logs")
    trace = ["--pipeline-trace", str(tmp_path / name / "trace.json")] if "1f1b" in flags else []
    res = _run(["train", "--init-from", path, "--data", data, "--checkpoint-dir", ck, "--log-dir", logs, *extra,
                *FLAGS, *flags, *trace])
    rows = [json.loads(line) for line in open(os.path.join(logs, "metrics.jsonl"))]
    assert [r["loss"] for r in rows if "loss" in r] == pytest.approx(res["history"]["loss"], rel=1e-6), rows
    if trace:
        assert json.load(open(trace[1]))["traceEvents"], trace
    rc, log = _cli(capsys, "export", "--checkpoint-dir", ck, "--hf", out)
    assert rc == 0, log
    return res["history"]["loss"], load_file(os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gpipe_and_1f1b_train_as_the_unpipelined_run(dirs, family, tmp_path, capsys):
    """3 AdamW steps from the Hugging Face directory: the unpipelined run (data parallel), the pipeline layout
    (gpipe) and the stage executor (1f1b) give the same losses (1e-6) and, exported after training (gpipe's stacked
    checkpoint restored per layer), the same Hugging Face tensors (1e-6)."""
    (path, extra, ref), data = dirs[0][family], dirs[1]
    base, want = _train_and_export(capsys, tmp_path, path, extra, data, "flat", "--mesh", "data:2", "--layout",
                                   "batch:data")
    runs = {"gpipe": ("--mesh", "pipe:2,data:2", "--layout", "stage:pipe;batch:data", "--pipeline-schedule", "gpipe"),
            "1f1b": ("--mesh", "pipe:2" if family == "llama" else "pipe:2,data:2",
                     "--layout", "stage:pipe" if family == "llama" else "stage:pipe;batch:data",
                     "--pipeline-schedule", "1f1b")}
    for sched, flags in runs.items():
        losses, got = _train_and_export(capsys, tmp_path, path, extra, data, sched, *flags)
        assert len(losses) == STEPS
        for a, b in zip(losses, base, strict=True):
            assert abs(a - b) <= 1e-6, (sched, losses, base)
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=lambda m, k=key: f"{sched} {k}: {m}")
    assert max(float((want[k] - v).abs().max()) for k, v in ref.state_dict().items() if k in want) > 1e-4  # trained


def test_pipeline_refusals_name_the_flag(dirs, tmp_path, capsys, monkeypatch):
    """What a pipelined import cannot run is refused in one line naming the flag: a layer count the stages x repeats
    do not give, a T5 directory under the stage executor (T5 pipelines under the layout's program:
    test_hf_t5_pipeline.py), and a tied head on torchrun ranks under the stage executor."""
    (gpt2, extra, _), data = dirs[0]["gpt2"], dirs[1]
    t5 = F.save_t5(F.make_t5(), str(tmp_path / "t5"))
    capsys.readouterr()  # transformers' progress bar
    rc, out = _cli(capsys, "train", "--init-from", gpt2, "--data", data, *extra, *FLAGS, "--mesh", "pipe:2",
                   "--layout", "stage:pipe", "--pipeline-repeats", "2", "--checkpoint-dir", str(tmp_path / "a"))
    assert rc == 2 and "--pipeline-repeats" in out and "num_layers" in out and "config.json" in out, out
    rc, out = _cli(capsys, "train", "--init-from", t5, "--data", data, "--tokenizer", "byte", *FLAGS, "--mesh",
                   "pipe:2", "--layout", "stage:pipe", "--pipeline-schedule", "1f1b", "--checkpoint-dir",
                   str(tmp_path / "b"))
    assert rc == 2 and "--pipeline-schedule 1f1b cannot be combined with --init-from a T5" in out, out
    assert len(out.strip().splitlines()) == 1, out
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc, out = _cli(capsys, "train", "--init-from", gpt2, "--data", data, *extra, *FLAGS, "--mesh", "pipe:2",
                   "--layout", "stage:pipe", "--pipeline-schedule", "1f1b", "--checkpoint-dir", str(tmp_path / "c"))
    assert rc == 2 and "--pipeline-schedule 1f1b" in out and "tied" in out, out

"""``meshtorch train --init-from T5DIR --data PAIRS``: T5 fine-tuning from the command line through the one
training loop, against ``transformers``' ``T5ForConditionalGeneration(labels=...)`` and ``torch.optim.AdamW``."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.checkpoint import latest_checkpoint  # noqa: E402
from meshtorch.cli import build_parser, main  # noqa: E402
from meshtorch.data.hf_tokenizer import HFTokenizer  # noqa: E402
from meshtorch.testing import rel_error  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402

B, L, LR, STEPS = 4, 12, 3e-3, 4
MESH, LAYOUT = "data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PAIRS = [("the cat sat", "a dog ran"), ("a dog", "the cat sat on it"), ("on the mat", "ran"),
         ("it sat on the cat", "a mat"), ("the dog", "the cat"), ("a cat", "on the dog"), ("the mat", "a cat sat"),
         ("sat", "the dog ran")]  # B train + B validation (the last B)


def _setup(tmp_path, pairs=PAIRS):
    m = F.make_t5()
    path = F.save_t5(m, str(tmp_path / "t5"))
    F.bpe_tokenizer(f"{path}/tokenizer.json", " ".join(a + " " + b for a, b in pairs) * 4)
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{a}\t{b}\n" for a, b in pairs))
    return path, str(data)


def _batch(path):
    """The train pairs tokenized independently: EOS (1) appended, inputs padded with 0, labels with -100."""
    tok = HFTokenizer(f"{path}/tokenizer.json")
    x = torch.zeros(B, L, dtype=torch.int64)
    y = torch.full((B, L), -100, dtype=torch.int64)
    for r, (a, b) in enumerate(PAIRS[:B]):
        ia, ib = list(tok.encode(a)) + [1], list(tok.encode(b)) + [1]
        x[r, :len(ia)], y[r, :len(ib)] = torch.tensor(ia), torch.tensor(ib)
    return x, y


def _reference(path):
    """``transformers``' T5 trained STEPS steps with ``torch.optim.AdamW`` on the train batch (the only one):
    (the trained model, its losses)."""
    x, y = _batch(path)
    ref = F.make_t5().train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-8, weight_decay=0.0)
    frac = (y != -100).sum().item() / y.numel()  # Mesh TF divides the summed loss by all target positions
    theirs = []
    for _ in range(STEPS):
        loss = ref(input_ids=x, attention_mask=(x != 0).long(), labels=y).loss * frac
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # the CLI's default --clip-norm
        opt.step()
        theirs.append(loss.item())
    assert theirs[-1] < theirs[0]
    return ref, theirs


@pytest.mark.parametrize("mesh,layout", [("", ""), (MESH, LAYOUT)])
def test_t5_train_cli_matches_transformers_adamw(tmp_path, mesh, layout):
    path, data = _setup(tmp_path)
    ck = str(tmp_path / "run")
    out = main(["train", "--init-from", path, "--data", data, "--batch-size", str(B), "--length", str(L),
                "--steps", str(STEPS), "--lr", str(LR), "--schedule", "constant", "--optimizer", "adamw",
                "--mesh", mesh, "--layout", layout, "--checkpoint-dir", ck, "--plot", "", "--sample", "0",
                "--eval-every", "100"])
    assert out is not None and out != 2
    ours = json.load(open(f"{ck}/ckpt-{STEPS}/manifest.json"))["extra"]["history"]["loss"]
    ref, theirs = _reference(path)
    assert len(ours) == STEPS
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)
    # meshtorch sample of the fine-tuned run (greedy) == transformers' generate of the torch-trained model
    want = _generate(ref, path)
    assert _sample(ck, mesh, layout) == [want]
    base = _generate(F.make_t5(), path)  # the fine-tuning changed the greedy output: the sample read the run's weights
    assert len(want) > 0 and base != want, (want, base)


def _generate(model, path, prompt=PAIRS[0][0], n=6) -> list[int]:
    """``transformers``' greedy ``generate`` of ``model`` for ``prompt``, up to EOS (excluded)."""
    ids = torch.tensor([[int(i) for i in HFTokenizer(f"{path}/tokenizer.json").encode(prompt)]])
    with torch.no_grad():
        out = model.eval().generate(ids, max_new_tokens=n, do_sample=False, decoder_start_token_id=0, eos_token_id=1,
                                    pad_token_id=0)[0, 1:].tolist()
    return out[:out.index(1)] if 1 in out else out


def _sample(ck, mesh="", layout="", prompt=PAIRS[0][0], n=6):
    """``meshtorch sample`` (greedy) of the run in ``ck`` for ``prompt``."""
    args = build_parser().parse_args(["sample", "--checkpoint-dir", ck, "--prompt", prompt, "--max-new-tokens",
                                      str(n), "--temperature", "0", "--mesh", mesh, "--layout", layout])
    return args.func(args)


@pytest.mark.parametrize("flag", [["--layout", "auto"], ["--accumulate", "2"], ["--precision", "bf16"]])
def test_t5_train_cli_refusals(tmp_path, capsys, flag):
    path, data = _setup(tmp_path)
    capsys.readouterr()
    assert main(["train", "--init-from", path, "--data", data, "--batch-size", "4", "--length", str(L),
                 "--plot", ""] + flag) == 2
    err = capsys.readouterr().err
    assert flag[0] in err and len(err.strip().splitlines()) == 1, err


def test_t5_pairs_file_errors(tmp_path, capsys):
    path, _ = _setup(tmp_path)
    bad = tmp_path / "bad.tsv"
    bad.write_text("a cat\tthe dog\nno tab here\n")
    assert main(["train", "--init-from", path, "--data", str(bad), "--plot", ""]) == 2
    assert f"{bad}:2: a T5 pair is one line" in capsys.readouterr().err
    long = tmp_path / "long.tsv"
    long.write_text("a cat\tthe dog\n" + "the cat " * 20 + "\tthe dog\n")
    assert main(["train", "--init-from", path, "--data", str(long), "--length", str(L), "--batch-size", "1",
                 "--plot", ""]) == 2
    assert f"{long}:2: the input is" in capsys.readouterr().err


def test_t5_train_says_where_its_sample_is(tmp_path, capsys):
    """``--sample`` (default 200) is not decoded at the end of a T5 run (the run has no input text): the run says so
    and names ``meshtorch sample`` instead of ignoring the flag silently."""
    path, data = _setup(tmp_path)
    rc = main(["train", "--init-from", path, "--data", data, "--batch-size", str(B), "--length", str(L),
               "--steps", "1", "--checkpoint-dir", str(tmp_path / "run"), "--plot", "", "--sample", "5"])
    out = capsys.readouterr()
    assert rc in (0, None), out.err
    assert "T5 runs are not decoded here" in out.out + out.err and "meshtorch sample" in out.out + out.err


def _train_argv(path, data, ck, *extra, steps=STEPS):
    return ["train", "--init-from", path, "--data", data, "--batch-size", str(B), "--length", str(L), "--steps",
            str(steps), "--lr", str(LR), "--schedule", "constant", "--optimizer", "adamw", "--checkpoint-dir", ck,
            "--plot", "", "--sample", "0", "--eval-every", "100", *extra]


def test_t5_train_four_gloo_ranks_equal_placement(tmp_path, capsys):
    """T5 fine-tuning on 4 gloo ranks (one process per processor, ``data:2,model:2``, FSDP storage
    ``d_model:data``), run for 2 steps and continued with ``--resume`` to 4 in the same processes: each rank's
    losses equal the placement run's (one process, same flags, 4 steps at once) and ``transformers`` + AdamW's
    to 1e-5; only rank 0 prints; the checkpoint the ranks wrote decodes on one process as
    ``transformers.generate`` of the torch-trained model."""
    path, data = _setup(tmp_path)
    flags = ("--mesh", MESH, "--layout", LAYOUT, "--storage", "d_model:data")
    ck = str(tmp_path / "spmd")
    first = _train_argv(path, data, ck, *flags, steps=STEPS // 2)
    resume = ["train", "--resume", *_train_argv(path, data, ck, *flags)[3:]]  # without --init-from
    run = run_spmd("_hf_spmd:t5_train_worker", args=(first, resume), nprocs=4, timeout_s=150,
                   extra_path=[TESTS_DIR]).check()
    args = build_parser().parse_args(_train_argv(path, data, str(tmp_path / "placement"), *flags))
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        h = args.func(args)["history"]
    finally:
        torch.set_num_threads(n)
    capsys.readouterr()
    ref, theirs = _reference(path)
    assert len(h["loss"]) == STEPS and len(h["val_loss"]) == 1
    assert rel_error(torch.tensor(h["loss"]), torch.tensor(theirs)) <= 1e-5, (h["loss"], theirs)
    for rank, (_, (losses, val, out)) in enumerate(run.results):
        assert len(losses) == STEPS and len(val) == 2, (rank, losses, val)  # steps 1-2 restored, 3-4 trained
        assert rel_error(torch.tensor(losses), torch.tensor(h["loss"])) <= 1e-5, (rank, losses, h["loss"])
        assert rel_error(torch.tensor(val[-1:]), torch.tensor(h["val_loss"])) <= 1e-5, (rank, val, h["val_loss"])
        assert ("resumed from" in out) == (rank == 0) and (out.strip() == "") == (rank > 0), (rank, out)
    for rank, ((losses, _val, out), _) in enumerate(run.results):
        assert len(losses) == STEPS // 2, rank
        assert ("validation:" in out) == (rank == 0) and (out.strip() == "") == (rank > 0), (rank, out)
    assert _sample(ck) == [_generate(ref, path)]


def _resume_pairs(n=10, seed=3):
    """``n`` pairs of 1-3 :data:`F.WORDS` each side (seeded)."""
    rng = random.Random(seed)
    return [tuple(" ".join(rng.choice(F.WORDS) for _ in range(rng.randint(1, 3))) for _ in "ab") for _ in range(n)]


def test_t5_resume_continues_as_uninterrupted(tmp_path, monkeypatch, capsys):
    """A T5 run interrupted (SIGINT) after its step-3 checkpoint and continued with ``--resume`` (no model flags)
    gives bitwise the losses, validation losses and samples of the same run uninterrupted. 8 train pairs in
    batches of 2: 4 batches an epoch, so the resumed steps 4-6 cross an epoch boundary (the data position and the
    next epoch's shuffle must both be restored); the default warmup + cosine schedule reads the restored step."""
    path, data = _setup(tmp_path, _resume_pairs())
    flags = ["--data", data, "--batch-size", "2", "--steps", "6", "--lr", str(LR), "--optimizer", "adamw",
             "--checkpoint-every", "3", "--eval-every", "3", "--plot", "", "--sample", "0"]
    a, b = str(tmp_path / "whole"), str(tmp_path / "parts")
    assert main(["train", "--init-from", path, "--length", str(L), "--checkpoint-dir", a, *flags]) == 0
    monkeypatch.setenv("MESHTORCH_FAULT", "3:SIGINT")
    assert main(["train", "--init-from", path, "--length", str(L), "--checkpoint-dir", b, *flags]) == 130
    monkeypatch.delenv("MESHTORCH_FAULT")
    assert latest_checkpoint(b).endswith("ckpt-3")
    capsys.readouterr()
    assert main(["train", "--resume", "--checkpoint-dir", b, *flags]) == 0
    out = capsys.readouterr().out
    no_data = [f for f in flags if f != data and f != "--data"]
    assert main(["train", "--resume", "--checkpoint-dir", b, *no_data]) == 2  # the run's pairs file is named
    err = capsys.readouterr().err
    assert "--resume of the T5 run" in err and f"needs --data: give its 'input<TAB>target' file(s) again ({data}" \
        in err and len(err.strip().splitlines()) == 1, err
    whole, parts = (json.load(open(f"{d}/ckpt-6/manifest.json"))["extra"]["history"] for d in (a, b))
    assert len(whole["loss"]) == 6 and whole["val_step"] == [3, 6]
    assert parts["loss"] == whole["loss"] and parts["val_loss"] == whole["val_loss"], (parts, whole)  # bitwise
    assert "at step 3 (epoch 0, batch 3)" in out, out
    got = _sample(b, prompt="the cat")  # the resumed run decodes (6 tokens before EOS here) as the whole run
    assert got == _sample(a, prompt="the cat") and len(got[0]) > 0, got

"""``meshtorch train --init-from T5DIR --data PAIRS``: T5 fine-tuning from the command line through the one
training loop, against ``transformers``' ``T5ForConditionalGeneration(labels=...)`` and ``torch.optim.AdamW``."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.cli import build_parser, main  # noqa: E402
from meshtorch.data.hf_tokenizer import HFTokenizer  # noqa: E402

B, L, LR, STEPS = 4, 12, 3e-3, 4
PAIRS = [("the cat sat", "a dog ran"), ("a dog", "the cat sat on it"), ("on the mat", "ran"),
         ("it sat on the cat", "a mat"), ("the dog", "the cat"), ("a cat", "on the dog"), ("the mat", "a cat sat"),
         ("sat", "the dog ran")]  # B train + B validation (the last B)


def _setup(tmp_path):
    m = F.make_t5()
    path = F.save_t5(m, str(tmp_path / "t5"))
    F.bpe_tokenizer(f"{path}/tokenizer.json", " ".join(a + " " + b for a, b in PAIRS) * 4)
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{a}\t{b}\n" for a, b in PAIRS))
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


@pytest.mark.parametrize("mesh,layout", [("", ""), ("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model")])
def test_t5_train_cli_matches_transformers_adamw(tmp_path, mesh, layout):
    path, data = _setup(tmp_path)
    ck = str(tmp_path / "run")
    out = main(["train", "--init-from", path, "--data", data, "--batch-size", str(B), "--length", str(L),
                "--steps", str(STEPS), "--lr", str(LR), "--schedule", "constant", "--optimizer", "adamw",
                "--mesh", mesh, "--layout", layout, "--checkpoint-dir", ck, "--plot", "", "--sample", "0",
                "--eval-every", "100"])
    assert out is not None and out != 2
    ours = json.load(open(f"{ck}/ckpt-{STEPS}/manifest.json"))["extra"]["history"]["loss"]
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
    assert len(ours) == STEPS
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)
    # meshtorch sample of the fine-tuned run (greedy) == transformers' generate of the torch-trained model
    prompt, n = PAIRS[0][0], 6
    ids = torch.tensor([[int(i) for i in HFTokenizer(f"{path}/tokenizer.json").encode(prompt)]])
    with torch.no_grad():
        want = ref.eval().generate(ids, max_new_tokens=n, do_sample=False, decoder_start_token_id=0, eos_token_id=1,
                                   pad_token_id=0)[0, 1:].tolist()
    want = want[:want.index(1)] if 1 in want else want
    args = build_parser().parse_args(["sample", "--checkpoint-dir", ck, "--prompt", prompt, "--max-new-tokens",
                                      str(n), "--temperature", "0", "--mesh", mesh, "--layout", layout])
    assert args.func(args) == [want]
    with torch.no_grad():  # the fine-tuning changed the greedy output: the sample read the run's weights
        base = F.make_t5().generate(ids, max_new_tokens=n, do_sample=False, decoder_start_token_id=0,
                                    eos_token_id=1, pad_token_id=0)[0, 1:].tolist()
    assert len(want) > 0 and (base[:base.index(1)] if 1 in base else base) != want, (want, base)


@pytest.mark.parametrize("flag", [["--pipeline-stages", "2"], ["--layout", "auto"], ["--accumulate", "2"],
                                  ["--precision", "bf16"]])
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

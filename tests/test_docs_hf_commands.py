"""The Hugging Face command lines of README.md and docs/*.md run (issue 30: "every README and docs command for
these paths runs in CI"). ``tests/test_docs_shell.py`` skips the lines that name a model directory or a file the
docs only name; here the directories and files those lines name (``my-llama``, ``gpt2-dir``, ``llama-dir``,
``t5-dir``, ``my.txt``, ``pairs.tsv``) are made as tiny fixtures in a temporary working directory, and each line
runs as written (``meshtorch.cli.main``) with a few steps and tokens appended (argparse keeps the last value, so
every documented flag is still parsed and used); trains first, so a page's ``sample --checkpoint-dir t5-run``
decodes the run its ``train`` wrote."""

from __future__ import annotations

import os
import shlex

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.cli import main  # noqa: E402
from test_docs_shell import PAGES, commands  # noqa: E402

T5_PAIRS = [("translate: the cat", "le chat"), ("translate: the dog", "le chien"), ("the cat sat", "a dog ran"),
            ("a dog", "the cat sat on it")]
#: the files and directories the documented lines name, made by :func:`_fixtures`
NAMES = {"my-llama", "llama-dir", "gpt2-dir", "t5-dir", "my.txt", "pairs.tsv"}
CHEAP_TRAIN = ["--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--sample", "0", "--batch-size", "4",
               "--length", "16", "--plot", "", "--threads", "1", "--peak-tflops", "1"]


#: the model directories among :data:`NAMES`, and the run a documented T5 ``train`` writes
MODELS = {"my-llama", "llama-dir", "gpt2-dir", "t5-dir", "t5-run"}


def _hf_lines() -> list[tuple[str, list[str]]]:
    """``[(page, argv)]``: the documented train/sample lines that read a Hugging Face model (one of
    :data:`MODELS`)."""
    return [(page, argv) for page in PAGES for argv, _ in commands(page) if MODELS & set(argv)]


def _fixtures(root: str) -> None:
    """The model directories and data files the documented lines name, under ``root``."""
    text = F.text()
    with open(os.path.join(root, "my.txt"), "w") as f:
        f.write(text)
    llama = F.save(F.make_model("llama_gqa"), os.path.join(root, "llama-dir"))
    F.bpe_tokenizer(os.path.join(llama, "tokenizer.json"), text)
    os.symlink(llama, os.path.join(root, "my-llama"))
    F.save(F.make_model("gpt2", vocab=257), os.path.join(root, "gpt2-dir"))  # --tokenizer byte: >= 256 ids
    t5 = F.save_t5(F.make_t5(), os.path.join(root, "t5-dir"))
    F.bpe_tokenizer(os.path.join(t5, "tokenizer.json"), " ".join(a + " " + b for a, b in T5_PAIRS) * 4)
    with open(os.path.join(root, "pairs.tsv"), "w") as f:
        f.write("".join(f"{a}\t{b}\n" for a, b in T5_PAIRS * 2))


def test_every_documented_init_from_line_is_run_here():
    """Every documented ``train --init-from DIR`` line names a directory made here (a new one fails: add its
    fixture to :data:`NAMES`), and the pages hold the lines this file was written for."""
    init = [(p, a) for p in PAGES for a, _ in commands(p) if "--init-from" in a]
    missing = [f"{p}: meshtorch {shlex.join(a)}" for p, a in init if a[a.index("--init-from") + 1] not in NAMES]
    assert not missing, f"documented --init-from lines with no fixture here: {missing}"
    assert len(init) >= 4 and any(a[0] == "sample" for _, a in _hf_lines())


def test_documented_hugging_face_lines_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _fixtures(str(tmp_path))
    lines = sorted(_hf_lines(), key=lambda pa: ("train", "sample").index(pa[1][0]))
    for page, argv in lines:
        extra = CHEAP_TRAIN if argv[0] == "train" else ["--max-new-tokens", "4", "--no-progress"]
        rc = main(argv + extra)
        out = capsys.readouterr()
        assert rc == 0, f"{page}: `meshtorch {shlex.join(argv)}` exited {rc}:\n{(out.out + out.err)[-2000:]}"
        if argv[0] == "sample":
            assert out.out.strip(), f"{page}: `meshtorch {shlex.join(argv)}` printed nothing"

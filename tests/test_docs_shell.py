"""The ``meshtorch`` command lines of README.md and docs/*.md run (issue 25), made cheap where they train.

Every line of a ```bash block that starts with ``meshtorch train``, ``meshtorch plan`` or ``meshtorch sample``
runs in-process (``meshtorch.cli.main``) in a temporary working directory, one per page, trains first (so a
page's ``sample`` decodes the run its ``train`` wrote): ``train`` with ``--preset tiny`` and a few steps
appended (argparse keeps the last value, so every documented flag is still parsed and used), ``sample``
with a few tokens, ``plan`` as written. Lines that need files the docs only name (``my.txt``, a Hugging Face
directory, a run name), a launcher (torchrun, ``meshtorch launch``), minutes (``--compile``: tens of seconds
of compiling on 2 cores) or the MNIST data set are listed as skipped with the reason.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from meshtorch.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
_BLOCK = re.compile(r"^```(?:bash|sh)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
CHEAP_TRAIN = ["--preset", "tiny", "--layers", "1", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
               "--sample", "0", "--batch-size", "8", "--length", "32", "--plot", "", "--threads", "1"]
_NEEDS = {"my.txt": "a text file the docs only name", "--init-from": "a Hugging Face directory",
          "--compile": "tens of seconds of compiling", "--run-name": "a run the docs only name",
          "--checkpoint-dir": "a checkpoint directory the docs only name", "--beam": "a run the docs only name"}


def commands(path: str) -> list[tuple[list[str], str | None]]:
    """``[(argv, reason to skip or None)]`` of the meshtorch train/plan/sample lines of ``path``'s bash blocks."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    out = []
    for m in _BLOCK.finditer(text):
        for line in m.group(1).splitlines():
            line = line.strip()
            if not line.startswith("meshtorch "):
                continue
            argv = shlex.split(line, comments=True)[1:]
            if argv[0] not in ("train", "plan", "sample"):
                continue
            reason = next((why for token, why in _NEEDS.items() if token in argv), None)
            out.append((argv, reason))
    return out


def _cheap(argv: list[str]) -> list[str]:
    if argv[0] == "train":
        cheap = CHEAP_TRAIN
        if "--layers" in argv and any("stage:" in a for a in argv):  # a pipeline needs its stages x repeats layers
            i = cheap.index("--layers")
            cheap = cheap[:i] + cheap[i + 2:]
        return argv + cheap
    if argv[0] == "sample":
        return argv + ["--max-new-tokens", "4", "--no-progress"]
    return argv


@pytest.mark.parametrize("page", [p for p in PAGES if any(r is None for _, r in commands(p))])
def test_page_commands_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path / "cache"))  # `plan --calibrate` writes here only
    todo = [a for a, reason in commands(page) if reason is None]
    for argv in sorted(todo, key=lambda a: a[0] != "train"):  # trains first: a page's sample decodes them
        rc = main(_cheap(argv))
        out = capsys.readouterr()
        assert rc == 0, f"{page}: `meshtorch {shlex.join(argv)}` exited {rc}:\n{out.err[-2000:]}"


def test_skipped_commands_say_why():
    skipped = [(p, a, r) for p in PAGES for a, r in commands(p) if r is not None]
    ran = sum(r is None for p in PAGES for _, r in commands(p))
    print(f"doc command lines: {ran} run, {len(skipped)} skipped: "
          + "; ".join(f"{p}: {shlex.join(a)} ({r})" for p, a, r in skipped))
    assert ran >= 10 and all(r for _, _, r in skipped)

"""The ``meshtorch`` command lines of README.md and docs/*.md run (issue 25), made cheap where they train.

Every line of a ```bash block that starts with ``meshtorch train``, ``meshtorch plan`` or ``meshtorch sample``
runs in-process (``meshtorch.cli.main``) in a temporary working directory, one per page, plans first (so a
``train --layout auto`` uses the calibration a page's ``plan --calibrate`` cached instead of measuring it again),
then trains (so a page's ``sample`` decodes the run its ``train`` wrote): ``train`` with ``--preset tiny`` and a
few steps appended (argparse keeps the last value, so every documented flag is still parsed and used), ``sample``
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
    # plans first (one calibration per page), then trains (a page's sample decodes them)
    for argv in sorted(todo, key=lambda a: ("plan", "train", "sample").index(a[0])):
        rc = main(_cheap(argv))
        out = capsys.readouterr()
        assert rc == 0, f"{page}: `meshtorch {shlex.join(argv)}` exited {rc}:\n{out.err[-2000:]}"


#: skip reasons that are a cost, not a missing input (nothing to look for on disk)
_COSTS = {"--compile"}
#: flags whose value is a file or directory the command reads (``--run-name X`` reads ``runs/X``)
_PATH_FLAGS = {"--data": "{}", "--init-from": "{}", "--checkpoint-dir": "{}", "--run-name": "runs/{}"}


def _named_paths(argv: list[str]) -> list[str]:
    """The files and directories ``argv`` reads (the values of :data:`_PATH_FLAGS`; ``--data`` takes several)."""
    out, flag = [], None
    for a in argv:
        if a.startswith("--"):
            flag = a if a in _PATH_FLAGS else None
        elif flag is not None:
            out.append(_PATH_FLAGS[flag].format(a))
            flag = flag if flag == "--data" else None
    return out


def test_skipped_commands_say_why():
    """A command is skipped only for what it really lacks: a cost rule's flag, or a file or directory it reads
    that exists neither in the repository nor in a page's temporary directory (where only a page's own
    ``train`` writes); every skip rule matches some documented command (no rule left over to hide a new one)."""
    listed = [(p, a, r) for p in PAGES for a, r in commands(p)]
    skipped = [(p, a, r) for p, a, r in listed if r is not None]
    ran = len(listed) - len(skipped)
    print(f"doc command lines: {ran} run, {len(skipped)} skipped: "
          + "; ".join(f"{p}: {shlex.join(a)} ({r})" for p, a, r in skipped))
    assert ran >= 10 and ran > len(skipped)
    unused = [token for token in _NEEDS if not any(token in a for _, a, _ in listed)]
    assert not unused, f"skip rules no documented command uses (remove them): {unused}"
    for page, argv, reason in skipped:
        missing = [q for q in _named_paths(argv) if not os.path.exists(os.path.join(ROOT, q))]
        assert missing or _COSTS & set(argv), (
            f"{page}: `meshtorch {shlex.join(argv)}` is skipped ({reason}) but reads no missing file or directory "
            f"and has no costly flag: run it")

"""The rest of issue 30's flag matrix (``tests/test_train_matrix.py`` holds the first part): every ``meshtorch
train`` flag x {native tiny preset, GPT-2 directory, Llama directory} runs or exits 2 naming the flag. Here: the
run-level flags (``--accumulate``, ``--precision bf16``, ``--reduce-dtype``, ``--no-async-collectives``,
``--run-name``, ``--debug``; then ``--resume-from`` with ``--force-data`` on other data and ``--checkpoint-dir``),
the flags that act only with another one (refused alone: ``--force-data``, ``--auto-candidates``,
``--memory-limit``, ``--pipeline-schedule``, ``--pipeline-trace``), and a check that every flag argparse defines
is in the matrix (a flag added later without a matrix entry fails it)."""

from __future__ import annotations

import argparse
import json
import os
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.cli import build_parser  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = ["--batch-size", "4", "--length", "16", "--eval-every", "2", "--eval-batches", "1", "--plot", "",
        "--sample", "0", "--lr", "1e-3", "--warmup-steps", "1", "--peak-tflops", "1"]
#: run-level flags every model takes, trained 1 step (the resumed run's flags: test_run_flags_...)
RUN = ["--accumulate", "2", "--precision", "bf16", "--reduce-dtype", "bfloat16", "--no-async-collectives",
       "--run-name", "a", "--debug"]
#: flags that act only with another flag: given alone, each exits 2 naming it
ALONE = [("--force-data",), ("--auto-candidates", "2"), ("--pipeline-schedule", "1f1b"),
         ("--pipeline-trace", "trace.json")]
#: flags run for the three models by a test in another file (flag: "file::test" that gives it to each)
ELSEWHERE = {"--resume": "test_hf_train.py::test_resume_takes_the_model_flags_from_run_json",  # native, Llama
             "--pipeline-schedule": "test_hf_pipeline.py::test_gpipe_and_1f1b_train_as_the_unpipelined_run",
             "--pipeline-trace": "test_hf_pipeline.py::test_gpipe_and_1f1b_train_as_the_unpipelined_run"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``({kind: source flags}, data file, other data file)``."""
    root = tmp_path_factory.mktemp("flags")
    d = F.train_dirs(root)
    other = root / "other.txt"
    other.write_text(F.text(seed=1))
    return ({"native": ["--preset", "tiny"], "gpt2": ["--init-from", d["gpt2"][0], "--tokenizer", "byte"],
             "llama": ["--init-from", d["llama"][0]]}, d["data"], str(other))


def _train_flags() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(max(a.option_strings, key=len) for a in sub.choices["train"]._actions
                  if a.option_strings and "--help" not in a.option_strings)


def test_every_train_flag_is_in_the_matrix():
    """Each flag of ``meshtorch train`` appears in this file's or test_train_matrix.py's runs and refusals, or
    in the named test of :data:`ELSEWHERE` (which must exist and give it)."""
    src = open(os.path.join(HERE, "test_train_matrix.py")).read() + open(__file__).read()
    covered = set(re.findall(r'"(--[a-z0-9-]+)"', src))
    for flag, where in ELSEWHERE.items():
        path, name = where.split("::")
        text = open(os.path.join(HERE, path)).read()
        assert f"def {name}(" in text and f'"{flag}"' in text, (flag, where)
    missing = [f for f in _train_flags() if f not in covered]
    assert not missing, f"train flags in no matrix run or refusal (add them to a test here): {missing}"


@pytest.mark.parametrize("kind", ["native", "gpt2", "llama"])
def test_run_flags_then_resume_from_with_force_data(models, tmp_path, capsys, kind):
    """1 step with :data:`RUN` (bf16 compute, 2 microbatches), then ``--resume-from`` its ckpt-1 on other data
    with ``--force-data`` (refused without it, naming it) into a new ``--checkpoint-dir``: step 2 logged there."""
    spec, data, other = models
    runs, ck = str(tmp_path / "runs"), str(tmp_path / "ck")
    rc, out = F.cli(capsys, "train", *spec[kind], *RUN, "--data", data, "--runs-dir", runs, "--steps", "1", *BASE)
    assert rc == 0, out
    first = os.path.join(runs, "a", "ckpt", "ckpt-1")
    assert json.load(open(os.path.join(first, "manifest.json")))["step"] == 1
    resume = ["train", "--resume-from", first, "--data", other, "--checkpoint-dir", ck, "--steps", "2", *BASE]
    rc, out = F.cli(capsys, *resume)
    assert rc == 2 and "--force-data" in out.strip().splitlines()[-1], out
    rc, out = F.cli(capsys, *resume, "--force-data")
    assert rc == 0, out
    assert os.listdir(ck) and json.load(open(os.path.join(ck, "ckpt-2", "manifest.json")))["step"] == 2


@pytest.mark.parametrize("flags", ALONE + [("--memory-limit", "1GiB")], ids=lambda f: f[0])
@pytest.mark.parametrize("kind", ["native", "gpt2", "llama"])
def test_flags_that_need_another_are_refused_alone(models, tmp_path, capsys, kind, flags):
    spec, data, _ = models
    rc, out = F.cli(capsys, "train", *spec[kind], *flags, "--data", data, "--runs-dir", str(tmp_path), "--steps",
                    "2", *BASE)
    last = out.strip().splitlines()[-1]
    assert rc == 2 and flags[0] in last and "Traceback" not in out, out
    assert not os.listdir(tmp_path)  # refused before anything was written

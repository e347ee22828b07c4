"""Bad inputs to every command: exit status 2 (input) or 1 (run failure), a message naming the flag, file,
rule, rank or tensor, no traceback, and for input errors nothing trained (no model line, no progress)."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from meshtorch.cli import main
from meshtorch.core.errors import FeedError, LayoutError
from meshtorch.core.layout import check_rules_strict
from meshtorch.lowering import Lowering
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.models.transformer import build_lm, preset

TINY = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "",
        "--checkpoint-dir", "", "--steps", "2", "--eval-every", "2", "--warmup-steps", "1"]
PLAN = ["plan", "--preset", "tiny", "--layers", "1", "--length", "16", "--batch-size", "4", "--vocab", "64"]
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def run_cli(argv, capsys):
    capsys.readouterr()  # drop what fixtures printed
    t0 = time.perf_counter()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out + err, time.perf_counter() - t0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of a 2-step tiny run (for sample and resume rows)."""
    d = tmp_path_factory.mktemp("ckpt")
    assert main(["train", *TINY, "--checkpoint-dir", str(d)]) == 0
    return str(d)


def _bad_dirs(tmp):
    empty = tmp / "empty"
    empty.mkdir(exist_ok=True)
    nomanifest = tmp / "nomanifest" / "ckpt-5"
    nomanifest.mkdir(parents=True, exist_ok=True)
    text = tmp / "other.txt"
    text.write_text("Some other text than the built-in corpus. " * 50)
    return {"EMPTY": str(empty), "NOMANIFEST": str(tmp / "nomanifest"), "TEXT": str(text)}


# (command argv, expected status, words the message must contain)
INPUT_ERRORS = [
    # meshtorch train: every row of the table, and more
    (["train", *TINY, "--checkpoint-dir", "/proc/nope"], ["--checkpoint-dir", "/proc/nope"]),
    (["train", *TINY, "--plot", "/proc/nope/x.png"], ["--plot"]),
    (["train", *TINY, "--sample", "5", "--prompt", "x" * 40], ["--prompt", "16"]),
    (["train", *TINY, "--eval-every", "0"], ["--eval-every"]),
    (["train", *TINY, "--threads", "-3"], ["--threads"]),
    (["train", *TINY, "--lr", "nan"], ["--lr", "finite"]),
    (["train", *TINY, "--lr", "-1"], ["--lr"]),
    (["train", *TINY, "--lr", "inf"], ["--lr", "finite"]),
    (["train", *TINY, "--layout", "batch:nonexistent_axis"],
     ["--layout", "nonexistent_axis", "data, model", "d_model"]),
    (["train", *TINY, "--layout", "bogus_dim:data"], ["--layout", "bogus_dim", "batch", "heads", "data, model"]),
    (["train", *TINY, "--layout", "batch"], ["--layout", "batch", "tensor_dim:mesh_axis"]),
    (["train", *TINY, "--storage", "bogus_dim:data"], ["--storage", "bogus_dim"]),
    (["train", *TINY, "--mesh", "rows:0"], ["--mesh", "rows", "positive integer"]),
    (["train", *TINY, "--mesh", "rows:x"], ["--mesh", "positive integer"]),
    (["train", *TINY, "--mesh", "rows:-2"], ["--mesh", "positive integer"]),
    (["train", *TINY, "--data", "EMPTY"], ["--data", "directory"]),
    (["train", *TINY, "--data", "/nonexistent/corpus.txt"], ["--data", "/nonexistent/corpus.txt"]),
    (["train", *TINY, "--steps", "0"], ["--steps"]),
    (["train", *TINY, "--dropout", "1.0"], ["--dropout"]),
    (["train", *TINY, "--dropout", "-0.1"], ["--dropout"]),
    (["train", *TINY, "--batch-size", "0"], ["--batch-size"]),
    (["train", *TINY, "--warmup-steps", "-1"], ["--warmup-steps"]),
    (["train", *TINY, "--clip-norm", "nan"], ["--clip-norm"]),
    (["train", *TINY, "--keep", "0"], ["--keep"]),
    (["train", *TINY, "--log-dir", "/proc/nope"], ["--log-dir"]),
    (["train", *TINY, "--sample", "5", "--prompt", ""], ["--prompt"]),
    (["train", *TINY, "--resume"], ["--resume", "--checkpoint-dir"]),
    (["train", *TINY, "--resume-from", "/nonexistent/ckpt-3"], ["--resume-from"]),
    (["train", *TINY, "--resume", "--checkpoint-dir", "NOMANIFEST"], ["--resume", "ckpt-5", "manifest"]),
    (["train", *TINY, "--resume", "--checkpoint-dir", "EMPTY"], ["--resume", "nothing to resume", "EMPTY"]),
    (["train", *TINY, "--resume", "--checkpoint-dir", "CKPT", "--d-model", "64"],
     ["--resume", "'d_model'", "--d-model", "32", "64"]),
    (["train", *TINY, "--resume", "--checkpoint-dir", "CKPT", "--data", "TEXT"],
     ["--resume", "--data", "--force-data"]),
    (["train", *TINY, "--checkpoint-dir", "CKPT"], ["--checkpoint-dir", "CKPT", "already holds", "--resume"]),
    (["train", *TINY, "--run-name", "a/b"], ["--run-name", "a/b"]),
    (["sample", "--run-name", "latest"], ["--run-name", "latest"]),
    (["sample", "--checkpoint-dir", "CKPT", "--threads", "-1"], ["--threads"]),
    (["train", *TINY, "--heads", "3", "--mesh", "data:2,model:2"], ["--layout", "heads", "divisible", "model"]),
    # meshtorch mnist
    (["mnist", "--steps-per-epoch", "0"], ["--steps-per-epoch"]),
    (["mnist", "--steps-per-epoch", "-3"], ["--steps-per-epoch"]),
    (["mnist", "--lr", "nan"], ["--lr"]),
    (["mnist", "--lr", "-1"], ["--lr"]),
    (["mnist", "--threads", "-3"], ["--threads"]),
    (["mnist", "--epochs", "0"], ["--epochs"]),
    (["mnist", "--mesh", "rows:0"], ["--mesh", "positive integer"]),
    (["mnist", "--layout", "batch:nonexistent_axis"], ["--layout", "nonexistent_axis", "rows, cols", "hidden"]),
    (["mnist", "--layout", "bogus_dim:rows"], ["--layout", "bogus_dim", "hidden"]),
    (["mnist", "--data-dir", "/nonexistent/mnist"], ["--data-dir", "/nonexistent/mnist"]),
    # meshtorch sample
    (["sample", "--checkpoint-dir", "/nonexistent/ckpt"], ["--checkpoint-dir"]),
    (["sample", "--checkpoint-dir", "NOMANIFEST"], ["--checkpoint-dir", "NOMANIFEST", "manifest"]),
    (["sample", "--checkpoint-dir", "EMPTY"], ["--checkpoint-dir", "EMPTY", "manifest"]),
    (["sample", "--checkpoint-dir", "CKPT", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["sample", "--checkpoint-dir", "CKPT", "--prompt", "x" * 40], ["--prompt", "16"]),
    (["sample", "--checkpoint-dir", "CKPT", "--temperature", "-1"], ["--temperature"]),
    (["sample", "--checkpoint-dir", "CKPT", "--num-samples", "99"], ["--num-samples", "batch"]),
    (["sample", "--checkpoint-dir", "CKPT", "--mesh", "all:0"], ["--mesh", "positive integer"]),
    (["sample", "--checkpoint-dir", "CKPT", "--mesh", "all:2", "--layout", "bogus_dim:all"],
     ["--layout", "bogus_dim", "all"]),
    # meshtorch plan
    ([*PLAN, "--mesh", "rows:0"], ["--mesh", "positive integer"]),
    ([*PLAN, "--layout", "bogus_dim:data"], ["--layout", "bogus_dim"]),
    ([*PLAN, "--layout", "batch:nonexistent_axis"], ["--layout", "nonexistent_axis"]),
    ([*PLAN, "--storage", "d_model:nope"], ["--storage", "nope"]),
    ([*PLAN, "--top", "0"], ["--top"]),
    ([*PLAN, "--search", "--storage", "d_model:data"], ["--storage", "--search"]),
    ([*PLAN, "--search", "--memory-limit", "12XB"], ["--memory-limit", "12XB"]),
    ([*PLAN, "--flop-rate", "-1"], ["--flop-rate"]),
    ([*PLAN, "--layout", "batch:data;length:model"], ["--layout", "length"]),
    # meshtorch launch (arguments checked before any process starts)
    (["launch", "-n", "0", "--", "train"], ["-n"]),
    (["launch", "-n", "2"], ["meshtorch launch: error", "command after `--`"]),
    (["launch", "-n", "2", "--timeout", "0", "--", "train"], ["--timeout"]),
    (["launch", "-n", "2", "--grace", "nan", "--", "train"], ["--grace"]),
]


@pytest.mark.parametrize("argv, words", INPUT_ERRORS, ids=[" ".join(a[:1] + a[-2:])[:60] for a, _ in INPUT_ERRORS])
def test_bad_input_is_refused_before_training(argv, words, tmp_path, capsys, request):
    subs = _bad_dirs(tmp_path)
    if "CKPT" in argv:
        subs["CKPT"] = request.getfixturevalue("ckpt")
    argv = [subs.get(a, a) for a in argv]
    words = [subs.get(w, w) for w in words]
    rc, out, elapsed = run_cli(argv, capsys)
    assert rc == 2, out
    assert "Traceback" not in out
    for w in words:
        assert w in out, (w, out)
    assert "parameters" not in out and "it/s" not in out and "validation loss" not in out  # nothing built or trained
    assert elapsed < 20, elapsed  # refused up front, not after a run (generous: a loaded 2-core machine)


@pytest.mark.parametrize("argv", [["launch", "-n", "0", "--", "train"], ["launch", "-n", "2"],
                                  ["launch", "-n", "2", "--timeout", "0", "--", "train", "--steps", "1"]])
def test_launch_errors_name_the_launch_command(argv, capsys):
    """The error line names the subcommand (`meshtorch launch: error: ...`), not the launched command's words."""
    rc, out, _ = run_cli(argv, capsys)
    assert rc == 2, out
    assert out.startswith("meshtorch launch: error: ") and "['" not in out and out.count("\n") == 1, out


@pytest.mark.slow
def test_launch_reports_one_input_error_with_status_2():
    """Under `meshtorch launch` every rank refuses the bad flag; the job exits 2 and says it once."""
    env = dict(os.environ, PYTHONPATH=SRC)
    p = subprocess.run([sys.executable, "-m", "meshtorch", "launch", "-n", "2", "--", "train", "--lr", "nan",
                        "--mesh", "all:2", "--layout", "batch:all"], capture_output=True, text=True, env=env,
                       timeout=300)  # a hang (the ranks waiting for each other) ends here
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert out.count("--lr must be a finite number") == 1, out
    assert "failed first (status 2: invalid input" in out and "Traceback" not in out


def test_python_api_float_fed_to_integer_placeholder_is_a_feed_error():
    lm = build_lm(preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=8, batch_size=2,
                         vocab_size=32))
    lw = lm.lowering()
    ids = torch.randint(0, 32, (2, 8))
    with pytest.raises(FeedError, match="inputs.*int64.*float32"):
        lw.run(lm.loss, feeds={lm.inputs: ids.float(), lm.targets: ids})
    with pytest.raises(FeedError, match="expects shape"):
        lw.run(lm.loss, feeds={lm.inputs: ids[:1], lm.targets: ids})
    lw.run(lm.loss, feeds={lm.inputs: ids, lm.targets: ids})  # integers are fine


def test_python_api_layout_rules_strict_check_and_lenient_library():
    lm = build_lm(preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=8, batch_size=2,
                         vocab_size=32))
    # the library keeps Mesh TF's behaviour: a rule naming an unknown dim or axis is ignored
    Lowering(lm.graph, {lm.mesh: PlacementMeshImpl("data:2", "bogus_dim:data;batch:nope")}, materialize=False)
    with pytest.raises(LayoutError, match="bogus_dim.*batch, d_ff.*data"):
        check_rules_strict("bogus_dim:data", ["batch", "d_ff"], "data:2")
    with pytest.raises(LayoutError, match="'nope' is not an axis"):
        check_rules_strict("batch:nope", ["batch"], "data:2")
    odd = build_lm(preset("tiny", num_layers=1, d_model=32, num_heads=3, d_kv=8, d_ff=64, length=8, batch_size=2,
                          vocab_size=32))
    with pytest.raises(LayoutError, match="heads.*divisible"):
        Lowering(odd.graph, {odd.mesh: PlacementMeshImpl("model:2", "heads:model")}, materialize=False)


def test_divergence_stops_at_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    d = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-dir", str(d)]) == 0
    files = {p: p.read_bytes() for p in (d / "ckpt-2").iterdir()}
    capsys.readouterr()
    rc, out, _ = run_cli(["train", *TINY, "--steps", "40", "--eval-every", "40", "--checkpoint-dir", str(d),
                          "--resume", "--lr", "1e6", "--clip-norm", "0", "--optimizer", "sgd",
                          "--schedule", "constant"], capsys)
    assert rc == 1, out
    assert "diverged" in out and "step" in out and "Traceback" not in out, out
    assert str(d / "ckpt-2") in out  # the last good checkpoint, named
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-2"]  # nothing saved after
    assert {p: p.read_bytes() for p in (d / "ckpt-2").iterdir()} == files  # intact


def test_corrupt_newest_checkpoint_names_older_and_resume_from_uses_one(ckpt, tmp_path, capsys):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(os.path.join(ckpt, "ckpt-2"), d / "ckpt-2")
    shutil.copytree(os.path.join(ckpt, "ckpt-2"), d / "ckpt-3")
    (d / "ckpt-3" / "manifest.json").write_text("{not json")
    rc, out, _ = run_cli(["train", *TINY, "--steps", "4", "--eval-every", "4", "--checkpoint-dir", str(d),
                          "--resume"], capsys)
    assert rc == 2 and "ckpt-3" in out and "ckpt-2" in out and "--resume-from" in out, out
    rc, out, _ = run_cli(["train", *TINY, "--steps", "4", "--eval-every", "4", "--checkpoint-dir", str(d),
                          "--resume-from", str(d / "ckpt-2")], capsys)
    assert rc == 0 and "resumed from" in out and "at step 2" in out, out


def test_sample_slides_past_the_context(ckpt, capsys):
    rc, out, _ = run_cli(["sample", "--checkpoint-dir", ckpt, "--max-new-tokens", "40", "--no-progress"], capsys)
    assert rc == 0, out
    assert "exceed the context of 16" in out


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


@pytest.mark.slow
def test_killed_rank_is_named_by_every_survivor_and_the_launcher(tmp_path):
    """SIGKILL rank 2 of 4 in the middle of training: every surviving rank and the launcher name rank 2,
    no traceback, all ranks gone within 60 s."""
    env = dict(os.environ, PYTHONPATH=SRC)
    ck = tmp_path / "ck"
    argv = [sys.executable, "-m", "meshtorch", "launch", "-n", "4", "--", "train", *TINY, "--steps", "100000",
            "--eval-every", "100000", "--mesh", "all:4", "--layout", "batch:all", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "1", "--keep", "1"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not any(ck.glob("ckpt-*")) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert p.poll() is None, p.communicate()[0]
        ranks = {_rank_of(c): c for c in _children(p.pid)}
        assert sorted(ranks) == [0, 1, 2, 3]
        os.kill(ranks[2], 9)
        t_kill = time.monotonic()
        out, _ = p.communicate(timeout=60)
        assert time.monotonic() - t_kill < 60
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, out
    assert "rank 2 failed first (killed by signal SIGKILL)" in out, out
    assert "Traceback" not in out, out
    survivors = [ln for ln in out.splitlines() if "stopping because" in ln]
    assert len(survivors) >= 2 and all("because rank 2: stopped responding" in ln for ln in survivors), out
    # each survivor prints its flight recorder: the data-parallel all-reduces it ran last, with their ranks
    # (counted anywhere in a line: a dump may follow rank 0's progress bar, which ends without a newline)
    assert out.count("meshtorch flight recorder: last ") >= 2, out
    # one record per collective call (a bucket of n all-reduces reads "allreduce xn")
    assert any(re.search(r" allreduce( x\d+)? over all ", ln) and ln.lstrip().startswith("#")
               for ln in out.splitlines()), out
    assert not any(os.path.exists(f"/proc/{c}") and open(f"/proc/{c}/stat").read().split()[2] != "Z"
                   for c in ranks.values())


def _idx(path, array):
    array = np.asarray(array, dtype=np.uint8)
    header = (0x0800 | array.ndim).to_bytes(4, "big") + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    path.write_bytes(header + array.tobytes())


def test_mnist_divergence_stops_with_status_1(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 400), ("t10k", 100)):
        _idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _idx(tmp_path / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    rc, out, _ = run_cli(["mnist", "--data-dir", str(tmp_path), "--lr", "1e6", "--epochs", "1", "--hidden", "64",
                          "--batch-size", "10",
                          "--no-progress", "--threads", "1"], capsys)
    assert rc == 1, out
    assert "training diverged" in out and "at step" in out and "--lr" in out and "Traceback" not in out
    assert "test accuracy" not in out  # stopped at the step, not reported as a finished run


def test_sample_reports_a_newer_checkpoint_without_manifest(ckpt, tmp_path, capsys):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(os.path.join(ckpt, "ckpt-2"), d / "ckpt-2")
    (d / "ckpt-10").mkdir()  # damaged: no manifest
    rc, out, _ = run_cli(["sample", "--checkpoint-dir", str(d), "--max-new-tokens", "3", "--no-progress"], capsys)
    assert rc == 0, out
    assert "ckpt-10" in out and "no manifest" in out and "ckpt-2" in out


def test_data_directory_reads_the_text_files_in_it(tmp_path, capsys):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    (d / "b.md").write_text("Pack my box with five dozen liquor jugs. " * 200)
    (d / "image.png").write_bytes(b"\x89PNG not text")  # not a text file: ignored
    rc, out, _ = run_cli(["train", *TINY, "--data", str(d), "--steps", "1", "--eval-every", "1"], capsys)
    assert rc == 0, out
    assert "validation loss" in out
    n_train = int(re.search(r"(\d+) train / (\d+) validation sequences", out).group(1))
    text_bytes = len((d / "a.txt").read_text()) + len((d / "b.md").read_text())
    assert n_train * 17 <= text_bytes  # only the two text files were packed (the built-in corpus is ~465 kB)

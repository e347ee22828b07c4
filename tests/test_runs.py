"""Run identity (issue 25): each run in its own directory, ``runs/latest``, resume checks, retention per run.

The newcomer sequence: run A on one text, run B on another text in the default location, resume B on
another layout, sample; A's checkpoints are never read or deleted, a mismatched resume is refused naming
the field, and ``--resume`` with nothing to resume is an error.
"""

import json
import os
import re

from meshtorch.checkpoint import latest_checkpoint, load_manifest, save
from meshtorch.cli import main
from meshtorch.lowering import Lowering
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.models.transformer import build_lm, preset
from meshtorch.runtime.runs import data_fingerprint, read_latest

TINY = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "",
        "--warmup-steps", "1", "--mesh", "all:2", "--layout", "batch:all"]


def _cli(capsys, *argv):
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out + err


def _ckpts(d):
    return sorted(p.name for p in d.iterdir() if p.name.startswith("ckpt-")) if d.is_dir() else []


def test_newcomer_sequence_runs_never_share_checkpoints(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 100)
    (tmp_path / "b.txt").write_text("Pack my box with five dozen liquor jugs, said the sphinx. " * 100)
    runs = tmp_path / "runs"

    rc, out = _cli(capsys, "train", *TINY, "--data", "a.txt", "--steps", "4", "--eval-every", "4",
                   "--checkpoint-every", "2", "--keep", "1")
    assert rc == 0, out
    a = read_latest(str(runs))
    a_ckpt = runs / a / "ckpt"
    assert f"saved checkpoint {os.path.abspath(a_ckpt / 'ckpt-4')}" in out, out  # train says where it saved
    assert _ckpts(a_ckpt) == ["ckpt-4"]  # --keep 1 within the run
    a_files = {p.name: p.read_bytes() for p in (a_ckpt / "ckpt-4").iterdir()}
    run_json = json.loads((a_ckpt / "run.json").read_text())
    assert run_json["data_fingerprint"] == data_fingerprint([(tmp_path / "a.txt").read_text()])
    assert run_json["config"]["d_model"] == 32 and run_json["layout"] == "batch:all" and run_json["run"] == a

    # run B on another text, in the default location: its own directory, latest moves to it
    rc, out = _cli(capsys, "train", *TINY, "--data", "b.txt", "--steps", "2", "--eval-every", "2", "--keep", "1")
    assert rc == 0, out
    b = read_latest(str(runs))
    assert b != a
    b_ckpt = runs / b / "ckpt"
    assert _ckpts(b_ckpt) == ["ckpt-2"]

    # resume (follows latest = B) on another layout; continues B's data position
    rc, out = _cli(capsys, "train", *TINY, "--data", "b.txt", "--steps", "4", "--eval-every", "2", "--keep", "1",
                   "--mesh", "data:2,model:2", "--layout", "batch:data;heads:model", "--resume")
    assert rc == 0, out
    assert f"resumed from {os.path.abspath(b_ckpt / 'ckpt-2')} at step 2" in out, out
    assert _ckpts(b_ckpt) == ["ckpt-4"]  # B's retention deleted only B's ckpt-2
    assert load_manifest(str(b_ckpt / "ckpt-4"))["run"] == b
    assert {p.name: p.read_bytes() for p in (a_ckpt / "ckpt-4").iterdir()} == a_files  # A untouched

    # sample follows latest and names the checkpoint it decodes
    rc, out = _cli(capsys, "sample", "--max-new-tokens", "3", "--no-progress", "--temperature", "0")
    assert rc == 0, out
    assert f"decoding checkpoint {os.path.abspath(b_ckpt / 'ckpt-4')} (step 4)" in out, out
    rc, out = _cli(capsys, "sample", "--run-name", a, "--max-new-tokens", "3", "--no-progress")
    assert rc == 0 and str(a_ckpt / "ckpt-4") in out, out


def test_mismatched_resume_is_refused_naming_the_field(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 100)
    (tmp_path / "b.txt").write_text("Pack my box with five dozen liquor jugs, said the sphinx. " * 100)
    rc, out = _cli(capsys, "train", *TINY, "--data", "a.txt", "--steps", "2", "--eval-every", "2")
    assert rc == 0, out
    ckpt = tmp_path / "runs" / read_latest("runs") / "ckpt"
    before = _ckpts(ckpt)

    rc, out = _cli(capsys, "train", *TINY, "--data", "a.txt", "--steps", "4", "--eval-every", "4", "--resume",
                   "--d-model", "64")
    assert rc == 2 and "'d_model'" in out and "--d-model" in out and "32" in out and "64" in out, out
    assert len(out.strip().splitlines()[-1]) > 0 and "Traceback" not in out
    rc, out = _cli(capsys, "train", *TINY, "--data", "b.txt", "--steps", "4", "--eval-every", "4", "--resume")
    assert rc == 2 and "--data" in out and "fingerprint" in out and "--force-data" in out, out
    assert _ckpts(ckpt) == before  # nothing trained or saved
    rc, out = _cli(capsys, "train", *TINY, "--data", "b.txt", "--steps", "4", "--eval-every", "4", "--resume",
                   "--force-data")
    assert rc == 0 and "at step 2 (epoch 0, batch 0)" in out and "data position starts over" in out, out
    assert load_manifest(latest_checkpoint(str(ckpt)))["extra"]["data_fingerprint"] == data_fingerprint(
        [(tmp_path / "b.txt").read_text()])


def test_resume_with_nothing_to_resume_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out = _cli(capsys, "train", *TINY, "--steps", "2", "--resume")
    assert rc == 2 and "--resume" in out and "nothing to resume" in out and "runs/latest" in out, out
    (tmp_path / "empty").mkdir()
    rc, out = _cli(capsys, "train", *TINY, "--steps", "2", "--resume", "--checkpoint-dir", "empty")
    assert rc == 2 and "--resume" in out and "nothing to resume" in out and "empty" in out, out
    rc, out = _cli(capsys, "sample")
    assert rc == 2 and "--checkpoint-dir" in out and "latest" in out, out
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def _tiny_lowering():
    lm = build_lm(preset("tiny", num_layers=1, d_model=16, num_heads=2, d_kv=8, d_ff=32, length=8, batch_size=2,
                         vocab_size=32))
    return Lowering(lm.graph, {lm.mesh: PlacementMeshImpl("all:2", "batch:all")})


def test_retention_deletes_only_the_saving_runs_checkpoints(tmp_path):
    """Two runs saving into one directory with keep=1: each keeps its newest, never deletes the other's."""
    lw = _tiny_lowering()
    d = str(tmp_path / "shared")
    for step in (1, 2):
        save(lw, d, step, keep=1, run="A")
    for step in (3, 4):
        save(lw, d, step, keep=1, run="B")
    assert _ckpts(tmp_path / "shared") == ["ckpt-2", "ckpt-4"]
    save(lw, d, 5, keep=1, run="A")
    assert _ckpts(tmp_path / "shared") == ["ckpt-4", "ckpt-5"]
    save(lw, d, 6, keep=1)  # no run: Mesh TF-style retention over the whole directory
    assert _ckpts(tmp_path / "shared") == ["ckpt-6"]


def test_new_run_in_a_directory_of_another_runs_checkpoints_is_refused(tmp_path, capsys):
    d = tmp_path / "ck"
    rc, out = _cli(capsys, "train", *TINY, "--steps", "2", "--eval-every", "2", "--checkpoint-dir", str(d))
    assert rc == 0, out
    rc, out = _cli(capsys, "train", *TINY, "--steps", "2", "--eval-every", "2", "--checkpoint-dir", str(d))
    assert rc == 2 and "--checkpoint-dir" in out and "ckpt-2" in out and "--resume" in out, out
    assert re.search(r"already holds checkpoints", out)

"""Faults survived with nothing lost (issue 35): a save that fails for lack of space, or because a file
grows past ``RLIMIT_FSIZE``, leaves the previous checkpoint intact, verifying and resuming bitwise;
retention (``--keep 1``) never leaves zero good checkpoints; the error is one line naming the cause."""

from __future__ import annotations

import importlib
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from meshtorch.checkpoint.format import verify_checkpoint
from meshtorch.cli import main

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
TINY = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "",
        "--warmup-steps", "1", "--mesh", "all:2", "--layout", "batch:all", "--eval-every", "100"]


def _small_filesystem(tmp_path):
    """argv prefix that runs a command with a 512 KiB tmpfs mounted on ``tmp_path`` (a user namespace), or
    None where this machine does not allow it."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    pre = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=512k tmpfs "{mnt}" && exec "$0" "$@"']
    try:
        ok = subprocess.run([*pre, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (pre, str(mnt)) if ok else (None, str(mnt))


def test_full_disk_keeps_the_last_good_checkpoint(tmp_path):
    """A save on a full file system (a 512 KiB tmpfs; where none can be mounted, RLIMIT_FSIZE): at a new step
    and at the step of the good checkpoint, with keep=1. One line naming the cause and the file; ckpt-1 stays
    the only checkpoint, verifies and restores bitwise; once space is free, the next save retires it."""
    pre, mnt = _small_filesystem(tmp_path)
    mode, cause = ("tmpfs", "no space left on device") if pre else ("fsize", "file too large")
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fault_jobs.py")
    p = subprocess.run([*(pre or []), sys.executable, job, mnt, mode], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=SRC))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for msg in r["errors"]:
        assert msg and cause in msg and "\n" not in msg, msg
        assert re.search(r"\(writing '.*/ck/\.tmp-ckpt-[12]/mesh\.p0000\d\.safetensors'\)", msg), msg
        assert f"the last good checkpoint {r['good']} is untouched" in msg, msg
    assert r["listings"] == [["ckpt-1"], ["ckpt-1"]]  # no temporary directory left, nothing retired
    assert r["restored"] == [True, True]
    assert r["after"] == ["ckpt-2"]


def _limit_file_size(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def test_file_size_limit_during_training_then_bitwise_resume(tmp_path, capsys):
    """`meshtorch train --resume` under RLIMIT_FSIZE (the shard files exceed it): exit 2, one line naming
    "file too large" and the file; ckpt-4 stays the only, verifying checkpoint (--keep 1); resumed without
    the limit, the run ends bitwise where an uninterrupted run with the same checkpoints ends."""
    ck, ref = tmp_path / "ck", tmp_path / "ref"
    common = [*TINY, "--checkpoint-every", "2", "--keep", "1", "--schedule", "constant"]  # lr not a function of --steps
    assert main(["train", *common, "--steps", "6", "--checkpoint-dir", str(ref)]) == 0
    assert main(["train", *common, "--steps", "4", "--checkpoint-dir", str(ck)]) == 0
    capsys.readouterr()
    good = ck / "ckpt-4"
    limit = 16384  # above run.json, below a shard file (the embedding alone is 256 x 32 float32 = 32 KiB)
    assert (ck / "run.json").stat().st_size < limit < max(f.stat().st_size for f in good.iterdir())
    p = subprocess.run([sys.executable, "-m", "meshtorch", "train", *common, "--steps", "6", "--checkpoint-dir",
                        str(ck), "--resume"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=SRC), preexec_fn=_limit_file_size(limit))
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and err[-1].startswith("meshtorch train: error: save: checkpoint step 6 "), err
    assert "file too large" in err[-1] and str(ck / ".tmp-ckpt-6") in err[-1], err[-1]
    assert f"the last good checkpoint {good} is untouched" in err[-1], err[-1]
    assert sorted(f.name for f in ck.iterdir()) == ["ckpt-4", "run.json"]
    verify_checkpoint(str(good))
    assert main(["train", *common, "--steps", "6", "--checkpoint-dir", str(ck), "--resume"]) == 0
    a, b = ck / "ckpt-6", ref / "ckpt-6"
    for f in sorted(x.name for x in b.glob("*.safetensors")):
        ta, tb = safetensors.torch.load_file(a / f), safetensors.torch.load_file(b / f)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in tb), f


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import _hf_fixtures as F
    from test_hf_cli import _text, _tokenizer

    root = tmp_path_factory.mktemp("hf")
    d = F.save(F.make_model("gpt2"), str(root / "gpt2"))
    _tokenizer(os.path.join(d, "tokenizer.json"), _text())
    (root / "data.txt").write_text(_text())
    return d, str(root / "data.txt")


@pytest.mark.parametrize("damage", ["truncated data", "truncated header", "corrupt header", "corrupt offsets"])
def test_damaged_model_safetensors_under_init_from(hf_dir, tmp_path, capsys, damage):
    """A damaged model.safetensors under `train --init-from`: exit 2, one line naming the file (not a raw
    SafetensorError with exit 1)."""
    src, data = hf_dir
    d = tmp_path / "hf"
    shutil.copytree(src, d)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    if damage == "truncated data":
        raw = raw[:len(raw) - 1000]
    elif damage == "truncated header":
        raw = raw[:n // 2]
    elif damage == "corrupt header":
        raw[8 + n // 2:8 + n // 2 + 16] = b"\xff" * 16  # not JSON any more
    else:  # valid JSON, one tensor's offsets moved past the end of the file
        header = raw[8:8 + n].decode()
        i = header.index('"data_offsets":[') + len('"data_offsets":[')
        raw[8 + i] = ord("9") if chr(raw[8 + i]) != "9" else ord("8")
    f.write_bytes(bytes(raw))
    capsys.readouterr()
    rc = main(["train", "--init-from", str(d), "--data", data, "--steps", "1", "--plot", "", "--sample", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err[-1].startswith("meshtorch train: error: hf: ") and repr(str(f)) in err[-1], err
    assert ("truncated" if "truncated" in damage else "corrupt") in err[-1], err[-1]
    assert not any("Traceback" in ln or "SafetensorError" in ln for ln in err), err


def test_truncated_checkpoint_shard_under_resume(tmp_path, capsys):
    """A truncated shard of the newest checkpoint under `train --resume`: exit 2 naming the file and the older
    checkpoint to resume from."""
    ck = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(ck)]) == 0
    f = ck / "ckpt-4" / "mesh.p00000.safetensors"  # batch:all: every variable replicated, owned by p0
    f.write_bytes(f.read_bytes()[:-100])
    capsys.readouterr()
    rc = main(["train", *TINY, "--steps", "6", "--checkpoint-dir", str(ck), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and repr(str(f)) in err[-1] and "truncated" in err[-1], err
    assert "--resume-from " + str(ck / "ckpt-2") in err[-1] and "Traceback" not in "".join(err), err


def _ckpt_tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(f))
    return out


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupt_names_the_last_checkpoint_and_the_resume_command(tmp_path, capsys, sig):
    """SIGINT/SIGTERM after step 5 of a run checkpointing every 2 steps: exit 130 and one line naming ckpt-4 (not
    the step interrupted) and the command that resumes it; that command (SIGINT case) ends bitwise where an
    uninterrupted run ends (6 steps: 66 steps checkpointing every 20 until 2026-11-28, the same path)."""
    runs_dir = tmp_path / "runs"
    argv = ["train", *TINY, "--steps", "6", "--checkpoint-every", "2", "--runs-dir", str(runs_dir)]
    p = subprocess.run([sys.executable, "-m", "meshtorch", *argv], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=SRC, MESHTORCH_FAULT=f"5:{sig}"))
    assert p.returncode == 130, p.stdout + p.stderr
    last = p.stderr.strip().splitlines()[-1]
    (name,) = [d.name for d in runs_dir.iterdir() if d.name != "latest"]
    ckpt = runs_dir / name / "ckpt" / "ckpt-4"
    assert last.startswith(f"meshtorch train: interrupted ({sig}); the last checkpoint is {ckpt}; resume with: "
                           "meshtorch train "), last
    again = shlex.split(last.split("resume with: ", 1)[1])
    assert again[-4:] == ["--run-name", name, "--resume-from", str(ckpt)], again
    if sig == "SIGTERM":
        return
    capsys.readouterr()
    assert main(again[1:]) == 0
    assert f"resumed from {ckpt} at step 4" in capsys.readouterr().out
    assert main(["train", *TINY, "--steps", "6", "--checkpoint-every", "2", "--checkpoint-dir",
                 str(tmp_path / "ref")]) == 0
    got, want = _ckpt_tensors(runs_dir / name / "ckpt" / "ckpt-6"), _ckpt_tensors(tmp_path / "ref" / "ckpt-6")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_refused_run_leaves_no_directories(tmp_path, capsys):
    """A run refused after its run directory is resolved (a prompt longer than the context) leaves no empty
    runs/<name>/ckpt (nor runs/) behind."""
    runs_dir = tmp_path / "runs"
    rc = main(["train", *TINY[:-6], "--steps", "2", "--runs-dir", str(runs_dir), "--sample", "3", "--prompt",
               "x" * 40, "--plot", str(runs_dir / "plots" / "loss.png")])
    assert rc == 2 and "--prompt" in capsys.readouterr().err
    assert not runs_dir.exists(), sorted(str(p) for p in runs_dir.rglob("*"))


def _launch(tmp_path, name, *extra, env=None, steps=6):
    argv = [sys.executable, "-m", "meshtorch", "launch", "-n", "2", "--timeout", "20", *extra, "--", "train", *TINY,
            "--mesh", "all:2", "--layout", "batch:all", "--steps", str(steps), "--checkpoint-every", "2",
            "--runs-dir", str(tmp_path / "runs"), "--run-name", name]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=SRC, **(env or {})))


@pytest.mark.slow
def test_launcher_restarts_a_killed_rank_and_ends_bitwise(tmp_path):
    """A 2-rank launch where rank 1 SIGKILLs itself after step 3 (checkpoints every 2 steps), --max-restarts 1:
    the launcher restarts the job from ckpt-2 (logged in restarts.jsonl with its cause) and it ends with
    variables bitwise equal to an uninterrupted 2-rank run with the same checkpoints."""
    p = _launch(tmp_path, "chaos", "--max-restarts", "1", env={"MESHTORCH_FAULT": "3:SIGKILL:1"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    run = tmp_path / "runs" / "chaos"
    assert "rank 1 failed first (killed by signal SIGKILL)" in out, out
    assert f"restart 1 of 1: after rank 1 killed by signal SIGKILL, resuming from {run / 'ckpt' / 'ckpt-2'}" in out
    (log,) = [json.loads(ln) for ln in (run / "restarts.jsonl").read_text().splitlines()]
    assert log["attempt"] == 1 and log["cause"] == "rank 1 killed by signal SIGKILL", log
    assert log["resume_from"] == str(run / "ckpt" / "ckpt-2") and log["exit_statuses"][1] == -9, log
    ref = _launch(tmp_path, "ref")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    got, want = _ckpt_tensors(run / "ckpt" / "ckpt-6"), _ckpt_tensors(tmp_path / "runs" / "ref" / "ckpt" / "ckpt-6")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _full_from_regions(ckpt):
    """Every variable's full tensor assembled from the files' regions the manifest lists (the reference
    for a restore): ``{name: tensor}``."""
    m, files = mtf_manifest(ckpt), {}
    out = {}
    for name, v in m["variables"].items():
        t = None
        for r in v["regions"]:
            if r["file"] not in files:
                files[r["file"]] = safetensors.torch.load_file(os.path.join(ckpt, r["file"]))
            part = files[r["file"]][r["key"]]
            t = torch.empty([s for _, s in v["shape"]], dtype=part.dtype) if t is None else t
            t[tuple(slice(b, b + s) for b, s in zip(r["begin"], r["size"], strict=True))] = part
        out[name] = t
    return out


def _restores_bitwise(ckpt, mesh):
    """A one-process lowering of the checkpoint's LM on ``mesh`` (storage d_model:data) restores every variable
    bitwise equal to the regions the checkpoint's files hold."""
    from meshtorch.checkpoint.restore import restore
    from meshtorch.lowering import Lowering
    from meshtorch.mesh.placement import PlacementMeshImpl
    from meshtorch.models.transformer import build_lm, preset
    from meshtorch.optim import AdamWOptimizer
    cfg = mtf_manifest(ckpt)["extra"]["config"]
    model = preset("tiny", **{k: cfg[k] for k in ("num_layers", "d_model", "num_heads", "d_kv", "d_ff", "length",
                                                  "batch_size", "vocab_size")})
    g = build_lm(model, optimizer=AdamWOptimizer(1e-3))  # train's default optimizer: the same slot variables
    lw = Lowering(g.graph, {g.mesh: PlacementMeshImpl(mesh, "batch:data", storage="d_model:data")})
    restore(lw, ckpt)
    full = _full_from_regions(ckpt)
    assert set(full) == set(lw.variable_names)
    for name, t in full.items():
        assert torch.equal(lw.variable_value(name), t), (ckpt, name)


def _history(ckpt):
    return mtf_manifest(ckpt)["extra"]["history"]


def mtf_manifest(ckpt):
    with open(os.path.join(ckpt, "manifest.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_resume_1_process_then_4_ranks_then_2_then_1_with_fsdp_storage(tmp_path, capsys):
    """One process trains the reference run to step 8 (storage d_model:data, checkpoints every 2); 4 gloo ranks
    resume its ckpt-2 and save ckpt-4; 2 ranks resume that and save ckpt-6; one process resumes that to step 8.
    Each resume reports what changed (mesh, processes) at the same data position; the losses of steps 3-8 (2 steps
    on each process count) equal the reference run's within float32 rounding; each restore is bitwise; a model
    change is refused."""
    lm = [*TINY[:TINY.index("--mesh")], "--schedule", "constant", "--layout", "batch:data", "--storage",
          "d_model:data", "--steps", "8", "--checkpoint-every", "2", "--eval-every", "100", "--keep", "10"]
    env = dict(os.environ, PYTHONPATH=SRC)
    ref, a, b, c = tmp_path / "ref", tmp_path / "a", tmp_path / "b", tmp_path / "c"

    def launch(n, *extra):
        p = subprocess.run([sys.executable, "-m", "meshtorch", "launch", "-n", str(n), "--timeout", "30", "--",
                            "train", *lm, "--mesh", f"data:{n}", *extra], capture_output=True, text=True,
                           timeout=400, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    assert main(["train", *lm, "--mesh", "data:2", "--checkpoint-dir", str(ref)]) == 0
    out = launch(4, "--checkpoint-dir", str(a), "--resume-from", str(ref / "ckpt-2"), "--steps", "4")
    assert (f"resumed from {ref / 'ckpt-2'} at step 2 (epoch 0, batch 2); mesh 'data:2' -> 'data:4', "
            "processes 1 -> 4") in out, out
    out = launch(2, "--checkpoint-dir", str(b), "--resume-from", str(a / "ckpt-4"), "--steps", "6")
    assert (f"resumed from {a / 'ckpt-4'} at step 4 (epoch 0, batch 4); mesh 'data:4' -> 'data:2', "
            "processes 4 -> 2") in out, out
    capsys.readouterr()
    assert main(["train", *lm, "--mesh", "data:2", "--checkpoint-dir", str(c), "--resume-from",
                 str(b / "ckpt-6")]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {b / 'ckpt-6'} at step 6 (epoch 0, batch 6); processes 2 -> 1" in out, out
    want, got = _history(str(ref / "ckpt-8"))["loss"], _history(str(c / "ckpt-8"))["loss"]
    assert len(want) == len(got) == 8 and got[:2] == want[:2]
    rel = max(abs(x - y) / abs(y) for x, y in zip(got[2:], want[2:], strict=True))
    with capsys.disabled():
        print(f"1 -> 4 -> 2 -> 1 processes: steps 3-8 losses, max relative difference to the one-process run {rel:.2e}")
    assert rel <= 1e-6, (got, want)
    # each restore itself is exact: a lowering on the next run's layout holds the checkpoint's values bitwise
    _restores_bitwise(str(ref / "ckpt-2"), "data:4")
    _restores_bitwise(str(a / "ckpt-4"), "data:2")
    _restores_bitwise(str(b / "ckpt-6"), "data:2")
    assert main(["train", *lm, "--mesh", "data:2", "--d-model", "64", "--checkpoint-dir", str(tmp_path / "d"),
                 "--resume-from", str(b / "ckpt-6")]) == 2
    assert "--d-model 64 differs from the resumed run's 32" in capsys.readouterr().err


def test_one_rank_failing_fails_the_save_in_every_rank(tmp_path):
    """2 gloo ranks; rank 1's write fails (ENOSPC): both ranks raise the same line naming rank 1's file, the
    temporary directory is gone and ckpt-1 is the only checkpoint and verifies (no rank hangs in a barrier)."""
    from meshtorch.testing.spmd import run_spmd

    root = str(tmp_path / "ck")
    results = run_spmd("_fault_jobs:failing_rank_save", args=(root,), nprocs=2, timeout_s=120,
                       extra_path=[os.path.dirname(os.path.abspath(__file__))]).check().results
    (err0, ls0), (err1, ls1) = results
    assert err0 == err1 and "no space left on device" in err0 and ".tmp-ckpt-2/mesh.p00001.safetensors" in err0, err0
    assert ls0 == ls1 == ["ckpt-1"]


def test_retention_waits_for_the_new_checkpoint_to_verify(tmp_path, monkeypatch):
    """keep=1: when the committed checkpoint does not read back as written (a flipped byte on disk after the
    write), the older checkpoint is kept and the save fails naming the file."""
    import _checkpoint_mlp as M
    import meshtorch as mtf
    save_mod = importlib.import_module("meshtorch.checkpoint.save")  # the module (the package exports save())
    m = M.build(*M.LAYOUT_A)
    root = str(tmp_path / "ck")
    mtf.save(m[0], root, step=1, keep=1)
    real = save_mod._commit

    def commit_then_rot(root_, tmp, final):
        real(root_, tmp, final)
        f = os.path.join(final, "mesh.p00001.safetensors")
        data = bytearray(open(f, "rb").read())
        data[-1] ^= 0xFF
        open(f, "wb").write(bytes(data))

    monkeypatch.setattr(save_mod, "_commit", commit_then_rot)
    with pytest.raises(mtf.CheckpointError, match=r"does not verify.*mesh\.p00001\.safetensors.*sha256.*older "
                                                  r"checkpoints were kept"):
        mtf.save(m[0], root, step=2, keep=1)
    assert sorted(os.listdir(root)) == ["ckpt-1", "ckpt-2"]
    verify_checkpoint(os.path.join(root, "ckpt-1"))


def test_resume_auto_starts_then_continues_bitwise(tmp_path, capsys):
    """``--resume auto`` (the one command line of every attempt of a restarted job): the first attempt finds no
    checkpoint and starts the run; the second continues its newest checkpoint. The final variables equal an
    uninterrupted run's bitwise. Without --run-name / --checkpoint-dir it is refused before any work; the
    launcher's restart line drops ``--resume auto`` for ``--resume-from``."""
    from meshtorch.runtime.failures import resume_argv
    lm = [*TINY, "--schedule", "constant", "--checkpoint-every", "2", "--runs-dir", str(tmp_path / "runs")]
    assert main(["train", *lm, "--steps", "4", "--checkpoint-dir", str(tmp_path / "whole")]) == 0
    assert main(["train", *lm, "--steps", "2", "--run-name", "job", "--resume", "auto"]) == 0
    assert "resumed from" not in capsys.readouterr().out
    assert main(["train", *lm, "--steps", "4", "--run-name", "job", "--resume", "auto"]) == 0
    assert f"resumed from {tmp_path / 'runs' / 'job' / 'ckpt' / 'ckpt-2'} at step 2" in capsys.readouterr().out
    want, got = _full_from_regions(str(tmp_path / "whole" / "ckpt-4")), \
        _full_from_regions(str(tmp_path / "runs" / "job" / "ckpt" / "ckpt-4"))
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert main(["train", *lm, "--steps", "2", "--resume", "auto"]) == 2
    assert "--resume auto needs --run-name or --checkpoint-dir" in capsys.readouterr().err
    assert resume_argv(["--steps", "4", "--resume", "auto", "--run-name", "job"], None, "c/ckpt-2") == \
        ["--steps", "4", "--run-name", "job", "--resume-from", "c/ckpt-2"]

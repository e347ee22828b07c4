"""``meshtorch train --layout auto`` (issue 23): the chosen layout is legal, fits --memory-limit per the planner,
and is what runs; ``--trace-collectives`` reports the collectives that ran."""

import json
import os

import pytest

import meshtorch as mtf
from meshtorch.cli import main
from meshtorch.models.transformer import build_lm, preset
from meshtorch.planning import memory_report
from meshtorch.runtime import calibrate as cal_mod

ARGS = ["train", "--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "", "--checkpoint-dir",
        "", "--steps", "2", "--eval-every", "2", "--mesh", "data:2,model:2"]


@pytest.fixture
def calibration(tmp_path, monkeypatch):
    """A cached calibration (fixed numbers, so nothing is measured)."""
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    cal = cal_mod.Calibration(host=cal_mod._host_key(), backend="placement", threads=1, gemm_flop_rate=5e10,
                              kernel_overhead=5e-6, memory_bandwidth=1e10,
                              collectives={k: [1e-5, 1e-10] for k in cal_mod.KINDS})
    path = cal_mod.cache_path("placement", 1)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(cal.__dict__, f)
    monkeypatch.setattr(cal_mod, "_gemm_rate", lambda *a: (_ for _ in ()).throw(AssertionError("measured")))
    return cal


def _total_bytes(layout, storage=""):
    spec = mtf.MeshSpec("data:2,model:2", layout, storage=storage or None)
    cfg = preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                 vocab_size=256, vocab_multiple=spec.axis_size_for("vocab"))
    lm = build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: spec}, materialize=False)
    return memory_report(lw, [lm.loss] + lm.updates).total_bytes


def _chosen(out):
    """(layout, storage) of the start-up line."""
    line = next(ln for ln in out.splitlines() if ln.startswith("mesh 'data:2,model:2' layout"))
    layout = line.split("layout ")[1].split(" storage")[0].strip("'")
    storage = line.split(" storage ")[1].split(";")[0].strip("'")
    return layout, "" if storage.startswith("(") else storage


def test_layout_auto_picks_a_layout_that_fits_the_limit_and_runs_it(calibration, capsys):
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--trace-collectives"]) == 0
    out = capsys.readouterr().out
    free = _chosen(out)
    assert "--layout auto:" in out and "calibrated placement" in out
    assert "collective time by kind and mesh axes" in out
    # a limit below that layout's planned memory forces another one, which the planner says fits
    limit = _total_bytes(*free) - 1
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--memory-limit", str(limit)]) == 0
    tight = _chosen(capsys.readouterr().out)
    assert tight != free and _total_bytes(*tight) <= limit


def test_layout_auto_refusals(calibration, capsys):
    assert main(ARGS + ["--layout", "auto", "--threads", "1", "--memory-limit", "1KiB"]) == 2
    assert "--layout auto" in capsys.readouterr().err
    assert main(ARGS + ["--storage", "auto", "--threads", "1"]) == 2
    assert "--storage auto needs --layout auto" in capsys.readouterr().err

"""MFU that cannot exceed 100% (issue 21): a stable measured peak, ``--peak-tflops``, and the bounded ratio."""

import json

import pytest
import torch

from meshtorch.cli import main
from meshtorch.core.errors import UsageError
from meshtorch.runtime import metrics
from meshtorch.runtime.metrics import measure_peak_flops, mfu

TINY = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--warmup-steps", "1",
        "--checkpoint-dir", "", "--plot", ""]


def test_mfu_is_the_ratio_below_the_peak_and_capped_above_it():
    assert mfu(2e9, 8e9) == pytest.approx(0.25)
    assert mfu(9e9, 8e9) == 1.0  # an achieved rate above a (busy-host) measured peak is itself a lower bound
    with pytest.raises(ValueError, match="peak"):
        mfu(1e9, 0.0)


def test_measured_peak_is_the_best_round(monkeypatch):
    """Rounds slowed down by other work do not lower the estimate: the fastest round counts.

    A fake clock: each matmul costs 1 time unit in round 1, 0.2 in round 2 (the quiet one), 0.5 in
    round 3; rounds last 10 units, so they run 10, 50 and 20 calls (call 1 is the warm-up)."""
    clock, calls = [0.0], [0]
    real_mm = torch.mm

    def fake_mm(a, b, out=None):
        calls[0] += 1
        c = calls[0]
        clock[0] += 0.0 if c == 1 else 1.0 if c <= 11 else 0.2 if c <= 61 else 0.5
        return real_mm(a, b, out=out)

    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(metrics.torch, "mm", fake_mm)
    n = 8
    assert measure_peak_flops(seconds=30.0, n=n, rounds=3) == pytest.approx(2 * n ** 3 * 5.0, rel=0.05)


def test_train_peak_tflops_override_sets_the_mfu(tmp_path):
    log = tmp_path / "logs"
    assert main(["train", *TINY, "--steps", "2", "--eval-every", "2", "--log-dir", str(log),
                 "--peak-tflops", "1e-9"]) == 0  # 1 kFLOP/s: every step beats it, MFU is capped at 1
    rows = [json.loads(ln) for ln in (log / "metrics.jsonl").read_text().splitlines() if '"mfu"' in ln]
    assert rows and all(r["mfu"] == 1.0 for r in rows)
    assert main(["train", *TINY, "--steps", "2", "--eval-every", "2", "--log-dir", str(tmp_path / "b"),
                 "--peak-tflops", "1e6"]) == 0  # an exaflop: a tiny fraction
    rows = [json.loads(ln) for ln in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines() if '"mfu"' in ln]
    assert rows and all(0 < r["mfu"] < 1e-6 for r in rows)


def test_peak_tflops_must_be_positive(capsys):
    with pytest.raises((SystemExit, UsageError)):
        rc = main(["train", *TINY, "--steps", "1", "--peak-tflops", "0"])
        assert rc != 0
        raise SystemExit(rc)
    assert "--peak-tflops" in capsys.readouterr().err

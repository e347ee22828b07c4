"""`meshtorch train --log-dir`: TensorBoard event files (read back with tensorboard's own reader), metrics.jsonl,
and an MFU denominator that counts the processor share each process really has."""

import json
import math

import pytest
from tensorboard.backend.event_processing import event_accumulator  # the test extra installs tensorboard

from meshtorch.cli import main
from meshtorch.runtime.metrics import available_cores, job_peak_flops

TINY = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--warmup-steps", "1",
        "--checkpoint-dir", ""]


def test_log_dir_writes_tensorboard_events_and_metrics_jsonl(tmp_path, capsys):
    log, plot = tmp_path / "logs", tmp_path / "plots" / "loss.png"
    assert main(["train", *TINY, "--steps", "4", "--eval-every", "2", "--log-dir", str(log), "--plot",
                 str(plot)]) == 0
    out = capsys.readouterr().out
    assert plot.is_file()
    rows = [json.loads(ln) for ln in (log / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "validation_loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4] and [r["step"] for r in val_rows] == [2, 4]
    for r in train_rows:
        assert {"bits_per_byte", "learning_rate", "tokens_per_s", "tokens_per_s_per_process", "mfu",
                "grad_norm"} <= set(r)
        assert 0 < r["mfu"] <= 1 and math.isfinite(r["loss"]) and r["grad_norm"] > 0
    ea = event_accumulator.EventAccumulator(str(log))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert {"loss", "validation_loss", "learning_rate", "tokens_per_s", "mfu"} <= set(tags)
    assert [e.step for e in ea.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in ea.Scalars("loss")] == pytest.approx([r["loss"] for r in train_rows])
    # the final validation line is the one logged at the last step
    assert ea.Scalars("validation_loss")[-1].value == pytest.approx(val_rows[-1]["validation_loss"])
    assert "validation: " in out and f"{val_rows[-1]['validation_loss']:.4f}" in out


def test_job_peak_counts_the_core_share_of_each_process():
    cores = available_cores()
    one = 1e10
    # one process, one thread: one core's peak
    assert job_peak_flops(one, 1, 1, 1) == pytest.approx(one)
    # 2 * cores processes with one thread each on this host share its cores: half a core each, cores in all
    n = 2 * cores
    assert job_peak_flops(one, 1, n, n) == pytest.approx(one * cores)
    # processes on other hosts add their own share
    assert job_peak_flops(one, 1, n, 2 * n) == pytest.approx(2 * one * cores)

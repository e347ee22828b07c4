"""``meshtorch train --init-from DIR --layout auto`` (issue 30, deliverable 1): the layout search ranks the
imported model's own graph (its dims: ``kv_heads`` of grouped-query attention, the padded vocabulary), measures its
candidates as for a native run, trains the checkpoint's weights with the measured choice (the same losses as the
run given that layout), records it, and a second run reads the cached choice; the cache key holds the imported
model, so a native preset's cached choice is never taken for it; T5 is refused by name."""

from __future__ import annotations

import json
import os

import pytest

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
from _fixed_calibration import write_fixed_calibration  # noqa: E402
from meshtorch.models.hf_config import HFModelConfig  # noqa: E402
from meshtorch.runtime import autolayout  # noqa: E402
from meshtorch.runtime.train_config import DEFAULT_LAYOUT  # noqa: E402

MESH = "data:2,model:2"
SHORT = ["--steps", "2", "--batch-size", "4", "--length", "16", "--eval-every", "2", "--eval-batches", "1",
         "--sample", "0", "--plot", "", "--threads", "1", "--mesh", MESH]


@pytest.fixture
def cached_calibration(tmp_path, monkeypatch):
    """A cached placement calibration (fixed numbers: nothing measured) in a fresh cache directory."""
    return write_fixed_calibration(tmp_path / "cache", monkeypatch)


def _losses(log_dir):
    return [r["loss"] for r in map(json.loads, open(os.path.join(log_dir, "metrics.jsonl"))) if "loss" in r]


def test_init_from_layout_auto_trains_the_measured_choice(tmp_path, capsys, monkeypatch, cached_calibration):
    d = F.train_dirs(tmp_path)
    llama, data = d["llama"][0], d["data"]
    seen = []
    real = autolayout.prepare_candidate

    def timed(config, mesh_shape, c, **kw):  # decided step times; the default and the challenger really built
        seen.append((config(1), c))
        t = 1.0 if c.default else 0.5 if len(seen) == 2 else 3.0
        step = real(config, mesh_shape, c, **kw) if t < 3 else (lambda: 0.0)
        return lambda: step() * 0 + t

    monkeypatch.setattr(autolayout, "prepare_candidate", timed)
    runs = str(tmp_path / "runs")
    auto = ["train", "--init-from", llama, "--data", data, "--runs-dir", runs, "--layout", "auto",
            "--auto-candidates", "1", *SHORT]
    rc, out = F.cli(capsys, *auto, "--run-name", "auto", "--log-dir", str(tmp_path / "la"))
    assert rc == 0, out
    assert all(isinstance(cfg, HFModelConfig) and cfg.family == "llama" and cfg.num_kv_heads == 2 for cfg, _ in seen)
    chosen = seen[1][1]
    assert seen[0][1].default and not chosen.default and "default replaced" in out, out
    record = json.load(open(os.path.join(runs, "auto", "ckpt", "run.json")))
    assert record["layout"] == chosen.layout and record["layout"] != DEFAULT_LAYOUT
    # the imported weights trained under the choice: the same losses as the run given that layout
    rc, out = F.cli(capsys, "train", "--init-from", llama, "--data", data, "--runs-dir", runs, "--layout",
                    chosen.layout, "--run-name", "given", "--log-dir", str(tmp_path / "lg"), *SHORT)
    assert rc == 0, out
    got, want = _losses(tmp_path / "la"), _losses(tmp_path / "lg")
    assert len(got) == 2 and got == pytest.approx(want, rel=1e-6, abs=0)
    n = len(seen)  # a second run of the same job reads the cached choice
    rc, out = F.cli(capsys, *auto, "--run-name", "again")
    assert rc == 0 and len(seen) == n and "measured 0 candidates" in out, out


def test_the_cached_choice_is_keyed_by_the_imported_model(tmp_path):
    """The native preset and the imported model of the same sizes, mesh and flags get different cache files."""
    from meshtorch.models.transformer import preset
    from meshtorch.runtime import hf_train
    from meshtorch.runtime.train_config import TrainConfig

    d = F.train_dirs(tmp_path)
    cfg = TrainConfig(init_from=d["llama"][0], batch_size=4, length=16)
    imported = hf_train.model_config(cfg, 1)
    native = preset("tiny", num_layers=imported.num_layers, d_model=imported.d_model, num_heads=imported.num_heads,
                    d_kv=imported.d_kv, d_ff=imported.d_ff, length=16, batch_size=4, vocab_size=imported.vocab_size)
    keys = [autolayout.cache_file(autolayout._cache_key(lambda m, c=c: c, MESH, "", None, "placement", 1, None, 3,
                                                        None, "codegen", 1)) for c in (native, imported)]
    assert keys[0] != keys[1]


def test_t5_layout_auto_is_refused_by_name(tmp_path, capsys):
    t5 = F.save_t5(F.make_t5(seed=0), str(tmp_path / "t5"))
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"a b c {i}\tc b a {i}\n" for i in range(20)))
    rc, out = F.cli(capsys, "train", "--init-from", t5, "--data", str(pairs), "--runs-dir", str(tmp_path / "r"),
                    "--tokenizer", "byte", "--layout", "auto", *SHORT)
    last = out.strip().splitlines()[-1]
    assert rc == 2 and "--layout auto" in last and "T5" in last and "Traceback" not in out, out
    assert not os.path.exists(tmp_path / "r")

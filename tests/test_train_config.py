"""TrainConfig (runtime/train_config.py): the typed configuration of `meshtorch train`, built from the parsed
arguments once and checked once. The training itself runs in tests/test_train_cli.py."""

import dataclasses

import pytest

from meshtorch.cli import build_parser
from meshtorch.core.errors import UsageError
from meshtorch.runtime.train_config import TrainConfig


def _parsed(*flags):
    return build_parser().parse_args(["train", *flags])


def test_every_flag_is_a_field_with_the_flag_default():
    ns = _parsed()
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    # argparse's own entries are not settings of the run
    assert set(vars(ns)) - fields == {"command", "debug", "func"}
    assert fields - set(vars(ns)) == set()
    assert TrainConfig.from_args(ns) == TrainConfig()


def test_from_args_reads_the_flags_and_is_frozen():
    cfg = TrainConfig.from_args(_parsed("--d-model", "64", "--mesh", "all:2", "--data", "a.txt", "b.txt",
                                        "--compile", "--storage", "d_model:all"))
    assert (cfg.d_model, cfg.mesh, cfg.data, cfg.executor, cfg.storage) == (64, "all:2", ("a.txt", "b.txt"),
                                                                          "compile", "d_model:all")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mesh = "all:4"
    assert cfg.replace(mesh="all:4").mesh == "all:4" and cfg.mesh == "all:2"
    assert TrainConfig.from_args(cfg) is cfg
    assert TrainConfig.from_args(object()) == TrainConfig()  # missing attributes: the defaults
    assert cfg.bucket_bytes == 25 * 2 ** 20 and not cfg.resuming and cfg.replace(resume_from="x").resuming


def test_checked_resolves_the_run_without_changing_the_config(tmp_path):
    cfg = TrainConfig.from_args(_parsed("--runs-dir", str(tmp_path), "--run-name", "r1", "--mesh", "", "--layout",
                                        "", "--preset", "tiny"))
    checked, paths = cfg.checked()
    assert cfg.checkpoint_dir is None and cfg.plot is None  # the original is untouched
    assert checked.checkpoint_dir == paths.checkpoint_dir == str(tmp_path / "r1" / "ckpt")
    assert checked.plot == str(tmp_path / "r1" / "loss.png") and checked.data == ()


@pytest.mark.parametrize("flags,match", [
    (("--steps", "0"), "--steps must be > 0, got 0"),
    (("--dropout", "1.5"), "--dropout"),
    (("--mesh", "data:x"), "--mesh"),
    (("--resume", "--checkpoint-dir", ""), "--resume needs --checkpoint-dir"),
    (("--prompt", "", "--preset", "tiny"), "--prompt is empty"),
])
def test_checked_names_the_flag(tmp_path, flags, match):
    cfg = TrainConfig.from_args(_parsed("--runs-dir", str(tmp_path), *flags))
    with pytest.raises(UsageError, match=match):
        cfg.checked()

"""TrainConfig (runtime/train_config.py): the typed configuration of `meshtorch train`, built from the parsed
arguments once and checked once. The training itself runs in tests/test_train_cli.py."""

import dataclasses

import pytest

from meshtorch.cli import build_parser
from meshtorch.core.errors import UsageError
from meshtorch.runtime.train_config import DEFAULT_LAYOUT, DEFAULT_MESH, TrainConfig


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
    assert cfg.bucket_bytes is None  # no --bucket-mb: the Lowering's default (DDP's, with its 1 MiB first bucket)
    assert cfg.replace(bucket_mb=2.5).bucket_bytes == int(2.5 * 2 ** 20)
    assert not cfg.resuming and cfg.replace(resume_from="x").resuming


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


def _checked_under(monkeypatch, tmp_path, world, rank, *flags):
    """``checked()`` with torchrun's environment of ``world`` processes, as rank ``rank``."""
    if world > 1:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", str(rank))
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        monkeypatch.delenv("RANK", raising=False)
    cfg = TrainConfig.from_args(_parsed("--runs-dir", str(tmp_path), "--run-name", "r", "--preset", "tiny", *flags))
    return cfg.checked()[0]


@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_without_mesh_and_layout_is_data_parallel(monkeypatch, tmp_path, capsys, world):
    """Under torchrun with W processes and neither --mesh nor --layout: mesh data:W, layout batch:data (DDP's
    job), said once by rank 0; one process keeps the simulated data:2,model:2 default."""
    cfg = _checked_under(monkeypatch, tmp_path, world, 0)
    assert (cfg.mesh, cfg.layout) == (f"data:{world}", "batch:data")
    out = capsys.readouterr().out
    assert out.count("data parallel") == 1 and f"--mesh data:{world} --layout batch:data" in out
    cfg = _checked_under(monkeypatch, tmp_path, world, 1)
    assert (cfg.mesh, cfg.layout) == (f"data:{world}", "batch:data")
    assert capsys.readouterr().out == ""  # only rank 0 says it
    cfg = _checked_under(monkeypatch, tmp_path, 1, 0)
    assert (cfg.mesh, cfg.layout) == (DEFAULT_MESH, DEFAULT_LAYOUT) == ("data:2,model:2",
                                                                     "batch:data;heads:model;d_ff:model;vocab:model")
    assert capsys.readouterr().out == ""


def test_torchrun_explicit_mesh_and_layout_are_kept(monkeypatch, tmp_path, capsys):
    cfg = _checked_under(monkeypatch, tmp_path, 4, 0, "--mesh", "data:2,model:2")
    assert (cfg.mesh, cfg.layout) == ("data:2,model:2", DEFAULT_LAYOUT)  # --mesh alone: the default layout
    cfg = _checked_under(monkeypatch, tmp_path, 4, 0, "--layout", "batch:data;heads:model")
    assert (cfg.mesh, cfg.layout) == (DEFAULT_MESH, "batch:data;heads:model")  # --layout alone: the default mesh
    cfg = _checked_under(monkeypatch, tmp_path, 2, 0, "--mesh", "all:2", "--layout", "d_ff:all")
    assert (cfg.mesh, cfg.layout) == ("all:2", "d_ff:all")
    assert "data parallel" not in capsys.readouterr().out


@pytest.mark.parametrize("flags", [("--mesh", "data:2,model:2"), ("--layout", "batch:data"), ("--mesh", "")])
def test_torchrun_mesh_of_another_size_names_the_flag(monkeypatch, tmp_path, flags):
    """An explicit --mesh (or the default one, when only --layout is given) whose size differs from the world
    size fails in checked(), before the job joins, naming --mesh and both counts."""
    size = 4 if flags[0] == "--layout" or flags[1] else 1
    with pytest.raises(UsageError, match=rf"--mesh .* has {size} processor\(s\) but torchrun started 2 processes"):
        _checked_under(monkeypatch, tmp_path, 2, 0, *flags)

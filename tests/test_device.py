"""``meshtorch train/sample --device`` (issue 25): where a simulated mesh's slices live, and a clear error
when CUDA is asked for but unavailable. (CPU runs here; the CUDA path needs a GPU, see docs/distributed.md.)"""

import pytest
import torch

from meshtorch.cli import main
from meshtorch.mesh.factory import make_mesh_impl, placement_devices

TINY = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
        "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "",
        "--checkpoint-dir", "", "--steps", "3", "--eval-every", "3", "--warmup-steps", "1"]


def test_cuda_spreads_a_simulated_mesh_over_the_visible_gpus():
    cuda = [torch.device("cuda", i) for i in range(4)]
    assert placement_devices("cuda", 4, 4) == cuda  # all:4 on 4 GPUs: one processor each
    assert placement_devices("cuda", 8, 4) == cuda + cuda  # round-robin
    assert placement_devices("cuda", 4, 2) == [cuda[0], cuda[1], cuda[0], cuda[1]]
    assert placement_devices("cuda:1", 3, 4) == [cuda[1]] * 3
    assert placement_devices("cpu", 2) == [torch.device("cpu")] * 2
    assert make_mesh_impl("all:2", "batch:all", device="cpu").devices == [torch.device("cpu")] * 2


def test_device_cpu_trains_the_same_losses_as_the_default(capsys):
    from test_train_cli import _args

    a = _args("train", *TINY, "--mesh", "all:2", "--layout", "batch:all")
    b = _args("train", *TINY, "--mesh", "all:2", "--layout", "batch:all", "--device", "cpu")
    assert a.func(a)["history"]["loss"] == b.func(b)["history"]["loss"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for --device cuda on a machine without CUDA")
@pytest.mark.parametrize("cmd", [["train", *TINY], ["sample", "--checkpoint-dir", "."]])
def test_device_cuda_without_cuda_names_the_flag(cmd, capsys):
    rc = main([*cmd, "--device", "cuda"])
    out = capsys.readouterr()
    msg = out.out + out.err
    assert rc == 2 and "--device cuda" in msg and "CUDA is not available" in msg and "--device cpu" in msg, msg
    assert "parameters" not in msg and "Traceback" not in msg


def test_unknown_device_names_the_flag(capsys):
    assert main(["train", *TINY, "--device", "tpu"]) == 2
    assert "--device 'tpu'" in capsys.readouterr().err

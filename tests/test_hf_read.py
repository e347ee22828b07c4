"""checkpoint/hf_read.py's BoxReader against safetensors' own get_slice: every box of 1-D to 3-D tensors of
several dtypes, and a truncated file."""

from __future__ import annotations

import itertools
import os

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from meshtorch.checkpoint.hf_read import BoxReader
from meshtorch.core.errors import CheckpointError


@pytest.fixture
def path(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, generator=g), "b": torch.randn(5, 6, generator=g).to(torch.bfloat16),
               "c": torch.randn(3, 4, 5, generator=g).to(torch.float16), "d": torch.arange(24).reshape(4, 6),
               "e": torch.tensor(3.5)}
    p = str(tmp_path / "t.safetensors")
    save_file(tensors, p)
    return p


def _ranges(n):
    return [(b, e) for b in range(n) for e in range(b + 1, n + 1)]


def test_every_box_equals_get_slice(path):
    r = BoxReader(path)
    n = 0
    with safetensors.safe_open(path, framework="pt") as h:
        for key in ("a", "b", "c", "d"):
            shape = h.get_slice(key).get_shape()
            for box in itertools.product(*[_ranges(s) for s in shape]):
                want = h.get_slice(key)[tuple(slice(b, e) for b, e in box)]
                got = r.read(key, box)
                assert got.dtype == want.dtype and torch.equal(got, want), (key, box)
                n += 1
        assert torch.equal(r.read("e", []), h.get_tensor("e"))
    r.close()
    assert n > 1000


def test_truncated_and_unknown(path):
    r = BoxReader(path)
    with pytest.raises(CheckpointError, match="'zz' is not in"):
        r.read("zz", [None])
    r.close()
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(CheckpointError, match=r"t\.safetensors' has \d+ bytes but its header describes \d+: it is "
                       "truncated"):
        BoxReader(path)  # refused when opened, before any tensor is read

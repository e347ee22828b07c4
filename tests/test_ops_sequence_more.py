"""dynamic_shift and left_halo_exchange (ops/sequence_more.py): every layout vs PyTorch."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


OFFSETS = torch.tensor([0, 1, -2, 3], dtype=torch.int32)


def _dynamic_shift_ref(x, off, wrap):
    out = torch.zeros_like(x)
    n = x.shape[1]
    for b in range(x.shape[0]):
        for i in range(n):
            j = i - int(off[b])  # out[i] = x[i - offset]
            if wrap:
                out[b, i] = x[b, j % n]
            elif 0 <= j < n:
                out[b, i] = x[b, j]
    return out


def _left_halo_ref(x, halo, wrap):
    # x [blocks, block_size, c]: each block gets the last `halo` rows of the rows to its left
    nb, bs, c = x.shape
    flat = x.reshape(nb * bs, c)
    out = []
    for b in range(nb):
        rows = []
        for r in range(b * bs - halo, b * bs + bs):
            if 0 <= r:
                rows.append(flat[r])
            else:
                rows.append(flat[r % (nb * bs)] if wrap else torch.zeros(c))
        out.append(torch.stack(rows))
    return torch.stack(out)


OP_CASES = [
    OpCase("dynamic_shift_zero_fill", lambda mesh, x, off: mtf.dynamic_shift(x, off, mtf.Dimension("l", 8), False),
           {"x": ("b:4,l:8", _x(4, 8)), "off": ("b:4", OFFSETS)}, lambda x, off: _dynamic_shift_ref(x, off, False)),
    OpCase("dynamic_shift_wrap", lambda mesh, x, off: mtf.dynamic_shift(x, off, "l", True),
           {"x": ("b:4,l:8", _x(4, 8)), "off": ("b:4", OFFSETS)}, lambda x, off: _dynamic_shift_ref(x, off, True)),
    OpCase("left_halo_partial", lambda mesh, x: mtf.left_halo_exchange(x, "blocks", mtf.Dimension("rows", 2), 1),
           {"x": ("blocks:4,rows:2,c:4", _x(4, 2, 4))}, lambda x: _left_halo_ref(x, 1, False)),
    OpCase("left_halo_wrap_long", lambda mesh, x: mtf.left_halo_exchange(x, "blocks", mtf.Dimension("rows", 2), 3,
                                                                        wrap=True),
           {"x": ("blocks:4,rows:2,c:4", _x(4, 2, 4))}, lambda x: _left_halo_ref(x, 3, True)),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert any(m == "rows:2;cols:2" for m, _ in layouts)


def test_dynamic_shift_rejects_offset_with_the_shifted_dim():
    mesh = mtf.Mesh(mtf.Graph())
    x = mtf.zeros(mesh, "b:4,l:8")
    off = mtf.zeros(mesh, "l:8", dtype=torch.int32)
    with pytest.raises(mtf.ShapeError, match="offset"):
        mtf.dynamic_shift(x, off, "l", False)

"""permute_blocks (ops/sequence_more.py; JAX's lax.ppermute in the global view): every layout vs PyTorch,
the collective each case lowers to (collective_permute, or the broadcast kind for a fan-out of one block),
and the input checks. The SPMD suite (tests/test_spmd.py) runs OP_CASES again on 4 gloo ranks."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase
from meshtorch.testing.layouts import run_layout


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ref(x, axis, source):
    """Element ``i`` of ``axis`` comes from element ``source[i // b] * b + i % b`` (zeros for None)."""
    b = x.shape[axis] // len(source)
    idx = [(source[i // b] * b + i % b) if source[i // b] is not None else -1 for i in range(x.shape[axis])]
    padded = torch.cat([x, torch.zeros_like(x.narrow(axis, 0, 1))], dim=axis)  # index -1: the zero row
    return padded.index_select(axis, torch.tensor([i if i >= 0 else x.shape[axis] for i in idx]))


SOURCES = {
    "permutation4": (2, 0, 3, None),   # non-uniform pairs, one target without a source
    "broadcast4": (1, 1, 1, 1),        # every block takes block 1: the broadcast kind
    "fan_out4": (0, 0, None, 2),       # block 0 feeds two targets: the gradient sums them
    "swap2": (1, 0),
    "broadcast2": (1, 1),
}

OP_CASES = [
    OpCase(f"permute_blocks_{name}", lambda mesh, x, s=src: mtf.permute_blocks(x, "l", s),
           {"x": ("b:2,l:8", _x(2, 8))}, lambda x, s=src: _ref(x, 1, s))
    for name, src in SOURCES.items()
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert ("all:4", "l:all") in layouts and any(m == "rows:2;cols:2" for m, _ in layouts)


@pytest.mark.parametrize("mesh_shape,layout,source,kind", [
    ("all:4", "l:all", SOURCES["permutation4"], "collective_permute"),
    ("all:4", "l:all", SOURCES["fan_out4"], "collective_permute"),
    ("all:4", "l:all", SOURCES["broadcast4"], "broadcast"),
    ("rows:2;cols:2", "l:cols", SOURCES["broadcast2"], "broadcast"),
])
def test_one_block_per_processor_is_one_collective(mesh_shape, layout, source, kind):
    x = _x(2, 8)
    outs, _, lw = run_layout(lambda mesh, x: mtf.permute_blocks(x, "l", source), {"x": ("b:2,l:8", x)},
                             mesh_shape, layout, grad=False)
    assert torch.equal(outs[0], _ref(x, 1, source))
    c = lw.counters  # the collectives the backend executed (flight recorder)
    assert c.count() == 1 and c.count(kind) == 1, c.summary()
    assert c.collectives(kind=kind)[0][0].bytes_per_processor == 2 * 8 // len(source) * 4  # the slice, float32


def test_other_block_counts_move_locally_after_a_gather():
    x = _x(2, 8)
    outs, _, lw = run_layout(lambda mesh, x: mtf.permute_blocks(x, "l", SOURCES["swap2"]), {"x": ("b:2,l:8", x)},
                             "all:4", "l:all", grad=False)
    assert torch.equal(outs[0], _ref(x, 1, SOURCES["swap2"]))
    assert lw.counters.count("allgather") == 1 and lw.counters.count() == 1


@pytest.mark.parametrize("source,error,match", [
    ((0, 1, 2), mtf.ShapeError, "source names 3 blocks"),
    ((), mtf.ShapeError, "source names 0 blocks"),
    ((0, 4, 1, 2), ValueError, r"block numbers in \[0, 4\), got 4"),
    ((0, True), ValueError, "got True"),
])
def test_bad_source_is_a_clear_error(source, error, match):
    mesh = mtf.Mesh(mtf.Graph())
    x = mtf.zeros(mesh, "b:2,l:8")
    with pytest.raises(error, match=match):
        mtf.permute_blocks(x, "l", source)


def test_missing_dim_is_a_clear_error():
    mesh = mtf.Mesh(mtf.Graph())
    with pytest.raises(mtf.ShapeError, match="has no dimension 'q'"):
        mtf.permute_blocks(mtf.zeros(mesh, "b:2,l:8"), "q", (0, 1))

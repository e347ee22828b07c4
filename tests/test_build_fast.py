"""Programs that build in seconds (issue 33): the fast initial-value draw gives the former values bit for bit
(hence the same losses), draws through the NumPy hash, and planning work grows linearly with depth.

References are independent of ``meshtorch.ops.rng``: lowbias32 in plain Python integers, and a copy of the
int64 torch algorithm the initializers used at a78e386 (``_old_bits`` / ``_old_float``) for whole tensors.
"""

import hashlib
import math
import sys

import numpy as np
import pytest
import torch

import meshtorch as mtf
from meshtorch.lowering import stages
from meshtorch.models.transformer import LMConfig, build_lm
from meshtorch.ops import initializers, rng

M32 = 0xFFFFFFFF


def _key_words(seed, key):
    h = hashlib.blake2b(f"{int(seed)}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h[:4], "little"), int.from_bytes(h[4:], "little")


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _py_bits(seed, key, index: int, stream: int) -> int:
    k0, k1 = _key_words(seed, f"{key}#{stream}")
    h = _lowbias32((index & M32) ^ k0)
    h = _lowbias32(h ^ (index >> 32) ^ k1)
    return _lowbias32(h ^ k0)


def _old_mul32(x, a):
    lo, hi = a & 0xFFFF, a >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _old_hash32(x):
    x = x ^ (x >> 16)
    x = _old_mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _old_mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _old_bits(seed, key, index, stream):
    """a78e386's ``rng.random_bits``: int64 torch ops with 16-bit partial products."""
    k0, k1 = _key_words(seed, f"{key}#{stream}")
    h = _old_hash32((index & M32) ^ k0)
    h = _old_hash32(h ^ (index >> 32) ^ k1)
    return _old_hash32(h ^ k0)


def _old_float(kind, b0, b1=None, bound=2.0):
    """a78e386's float parts of ``rng.uniform`` / ``normal`` / ``truncated_normal`` (functional, as written then)."""
    u = (b0 >> 8).to(torch.float32) * (1.0 / (1 << 24))
    if kind == "uniform":
        return u
    if kind == "normal":
        u1 = ((b0 >> 8).to(torch.float32) + 1.0) * (1.0 / (1 << 24))
        u2 = (b1 >> 8).to(torch.float32) * (1.0 / (1 << 24))
        return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    u = u.to(torch.float64)
    lo, hi = 0.5 * (1 + math.erf(-bound / math.sqrt(2))), 0.5 * (1 + math.erf(bound / math.sqrt(2)))
    p = lo + u * (hi - lo)
    return (math.sqrt(2) * torch.erfinv(2 * p - 1)).clamp(-bound, bound).to(torch.float32)


def _old_draw(kind, seed, key, index):
    b1 = _old_bits(seed, key, index, 1) if kind == "normal" else None
    return _old_float(kind, _old_bits(seed, key, index, 0), b1)


DRAWS = {"uniform": rng.uniform, "normal": rng.normal, "truncated": rng.truncated_normal}


def test_hash_paths_equal_plain_python_lowbias32():
    idx = [0, 1, 2, 255, 12345, 2**31 + 1, M32, 2**32, 2**32 + 7, 2**40 + 3, 2**45 - 1]
    index = torch.tensor(idx, dtype=torch.int64)
    for stream in (0, 1):
        want = torch.tensor([_py_bits(5, "w", i, stream) for i in idx], dtype=torch.int64)
        assert torch.equal(_old_bits(5, "w", index, stream), want)
        assert torch.equal(rng.random_bits(5, "w", index, stream), want)
    lo = np.array([i & M32 for i in idx], dtype=np.uint32)
    hi = np.array([i >> 32 for i in idx], dtype=np.uint32)
    out, t = np.empty((2, len(idx)), np.uint32), np.empty((2, len(idx)), np.uint32)
    rng.random_bits_np(5, "w", (0, 1), lo, hi, out, t)
    for stream in (0, 1):
        assert [int(b) for b in out[stream]] == [_py_bits(5, "w", i, stream) for i in idx]


# (full sizes, slice begin, slice sizes): whole, split on the first dim, non-contiguous (split inner dims; runs
# longer than the test's chunks of 1000),
# and a slice beyond 2**32 elements of a 2**33-element tensor (never allocated: only the slice is drawn)
SLICES = [((40, 52), (0, 0), (40, 52)), ((40, 52), (10, 0), (20, 52)), ((6, 10, 4), (2, 5, 0), (3, 4, 4)),
          ((5, 8, 33), (1, 0, 11), (1, 8, 11)), ((3, 4, 2000), (0, 1, 0), (3, 2, 2000)),
          ((2**20, 2**13), (2**19 + 5, 0), (2, 300)),
          ((2**20, 2**13), (2**19 + 5, 0), (1, 2**13))]


@pytest.mark.parametrize("kind", list(DRAWS))
@pytest.mark.parametrize("full,begin,sizes", SLICES)
def test_draw_flat_bitwise_equals_old_algorithm(kind, full, begin, sizes):
    n = math.prod(sizes)
    ref = _old_draw(kind, 7, "v", rng.global_index(full, begin, sizes).reshape(-1))
    scratch = rng.DrawScratch(DRAWS[kind], 1000)
    for start in range(0, n, 1000):  # chunked as the initializers chunk, one scratch reused
        stop = min(n, start + 1000)
        got = rng.draw_flat(DRAWS[kind], 7, "v", full, begin, sizes, start, stop, scratch=scratch)
        assert torch.equal(got, ref[start:stop]), (kind, full, begin, sizes, start)
        out = torch.empty(stop - start)
        assert rng.draw_flat(DRAWS[kind], 7, "v", full, begin, sizes, start, stop, out=out) is out
        assert torch.equal(out, ref[start:stop])
    assert torch.equal(DRAWS[kind](7, "v", rng.global_index(full, begin, sizes).reshape(-1)), ref)



@pytest.mark.parametrize("kind", list(DRAWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_slice_draw_bitwise_equals_old_algorithm(kind, dtype, monkeypatch):
    """A slice drawn by several threads (each its chunks: w, w + threads, ...) holds the old whole-slice values."""
    monkeypatch.setattr(initializers, "DRAW_CHUNK", 100)  # 13 chunks, a short last one: uneven per thread
    full, begin, sizes = (40, 52), (10, 0), (24, 52)
    ref = (_old_draw(kind, 7, "v", rng.global_index(full, begin, sizes)) * 0.5).to(dtype)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3, 4):
            torch.set_num_threads(n)
            got = initializers._k_draw_slice(begin, sizes, full=full, dtype=dtype, seed=7, key="v",
                                             draw=DRAWS[kind], mul=0.5, add=None)
            assert torch.equal(got, ref), (kind, dtype, n)
            assert torch.get_num_threads() == n  # the draw's one-thread setting is undone
    finally:
        torch.set_num_threads(threads)

CFG = LMConfig(vocab_size=61, d_model=16, num_heads=2, d_kv=8, d_ff=40, num_layers=2, length=8, batch_size=4)


def _train(lw, lm, steps=3):
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, CFG.vocab_size, (CFG.batch_size, CFG.length + 1), generator=g)
        losses.append(lw.run([lm.loss] + lm.updates, {lm.inputs: ids[:, :-1], lm.targets: ids[:, 1:]})[0].item())
    return losses


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("all:2", "d_model:all")])
def test_lm_losses_equal_old_initial_values(mesh_shape, layout, monkeypatch):
    monkeypatch.setattr(initializers, "DRAW_CHUNK", 96)  # several chunks per variable, short last ones
    lm = build_lm(CFG, seed=4, optimizer=mtf.optim.AdamWOptimizer(1e-2, weight_decay=0.01))
    losses = _train(mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec(mesh_shape, layout)}), lm)
    # reference: every drawn variable set from the old algorithm over its whole tensor
    ref_lm = build_lm(CFG, seed=4, optimizer=mtf.optim.AdamWOptimizer(1e-2, weight_decay=0.01))
    lw = mtf.Lowering(ref_lm.graph, {ref_lm.mesh: mtf.MeshSpec(mesh_shape, layout)})
    kinds = {rng.uniform: "uniform", rng.normal: "normal", rng.truncated_normal: "truncated"}
    drawn = 0
    for var in ref_lm.graph.all_variables:
        params = initializers.convert_initializer(var.initializer).draw_params(var.shape)
        if params is None:
            continue
        draw, mul, add = params
        full = var.shape.to_integer_list()
        v = _old_draw(kinds[draw], 4, var.name, rng.global_index(full, [0] * len(full), full)) * mul
        lw.set_variable_value(var.name, v if add is None else v + add)
        drawn += 1
    assert drawn >= 4 * CFG.num_layers + 3
    ref = _train(lw, ref_lm)
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= 1e-6, (losses, ref)
    assert losses[-1] < losses[0]


def test_initial_values_drawn_by_numpy_hash_in_chunks(monkeypatch):
    """Structural speed check: no int64 torch hash during the draw, one ``draw_flat`` per DRAW_CHUNK elements."""
    monkeypatch.setattr(rng, "_hash32", lambda x: pytest.fail("initial values drawn by the int64 torch hash"))
    calls = []
    real = rng.draw_flat
    monkeypatch.setattr(rng, "draw_flat", lambda *a, **k: calls.append(a[7] - a[6]) or real(*a, **k))
    lm = build_lm(CFG, seed=4, optimizer=mtf.optim.AdamWOptimizer(1e-2))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec("", "")})
    drawn = [v for v in lm.graph.all_variables
             if initializers.convert_initializer(v.initializer).draw_params(v.shape) is not None]
    assert sum(calls) == sum(v.shape.size for v in drawn)
    assert len(calls) == sum(-(-v.shape.size // initializers.DRAW_CHUNK) for v in drawn)
    assert lw.variable_value("embedding").std() > 0.5


def _planning_lines(layers: int) -> int:
    """Python lines executed (``sys.settrace`` line events, loop iterations included) while building the graph,
    planning it and creating its (lazy) lowering: a count of work that wall time on a shared host is not."""
    def build():
        lm = build_lm(LMConfig(**{**CFG.to_dict(), "num_layers": layers}), seed=0,
                      optimizer=mtf.optim.AdamWOptimizer(1e-3))
        stages.plan(lm.graph, [lm.loss] + lm.updates, mtf.MeshSpec("", ""))
        lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.MeshSpec("", "")}, init="lazy")
        lw.plan([lm.loss] + lm.updates)

    build()  # warm: imports and caches
    lines = 0

    def count(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return count

    sys.settrace(count)
    try:
        build()
    finally:
        sys.settrace(None)
    return lines


def test_build_work_grows_linearly_with_layers():
    """Structural speed check (no wall time): each added block costs the same number of executed lines."""
    c2, c4, c6 = (_planning_lines(n) for n in (2, 4, 6))
    per_block = (c4 - c2) / 2
    assert per_block > 0
    assert abs((c6 - c4) / 2 - per_block) <= 0.02 * per_block, (c2, c4, c6)

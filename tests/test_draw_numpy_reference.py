"""The initial-value draw at its real chunk size (:data:`initializers.DRAW_CHUNK`) against an independent NumPy
implementation of the same generator (issue 33: a faster draw must give the same values bit for bit).

The reference computes each element's global index with ``np.ravel_multi_index`` on the full shape, the key
words with BLAKE2b, lowbias32 in uint64 with explicit masking (not the library's wrapping uint32 products), and
the float part out of place on the whole slice at once (the same float32/float64 torch operations, so the
rounding is the generator's definition, not a copy of its in-place chunked code).
"""

import hashlib
import math

import numpy as np
import pytest
import torch

from meshtorch.ops import initializers, rng

M32 = np.uint64(0xFFFFFFFF)


def _words(seed, key):
    h = hashlib.blake2b(f"{int(seed)}|{key}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(h[:4], "little")), np.uint64(int.from_bytes(h[4:], "little"))


def _lowbias32(x):
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & M32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & M32
    return x ^ (x >> np.uint64(16))


def _bits(seed, key, idx, stream):
    k0, k1 = _words(seed, f"{key}#{stream}")
    h = _lowbias32((idx & M32) ^ k0)
    h = _lowbias32(h ^ (idx >> np.uint64(32)) ^ k1)
    return _lowbias32(h ^ k0)


def _top(bits):
    return torch.from_numpy((bits >> np.uint64(8)).astype(np.float32))  # < 2**24: exact


def _reference(kind, seed, key, full, begin, sizes, mul, add):
    grids = np.meshgrid(*[np.arange(b, b + s, dtype=np.int64) for b, s in zip(begin, sizes, strict=True)],
                        indexing="ij")
    idx = np.ravel_multi_index([g.ravel() for g in grids], full).astype(np.uint64)
    s24 = 2.0 ** -24
    t0 = _top(_bits(seed, key, idx, 0))
    if kind == "uniform":
        v = t0 * s24
    elif kind == "normal":
        t1 = _top(_bits(seed, key, idx, 1))
        v = torch.sqrt(torch.log((t0 + 1.0) * s24) * -2.0) * torch.cos(t1 * (s24 * 2.0 * math.pi))
    else:  # truncated normal on [-2, 2] by the inverse CDF, in float64
        lo, hi = (0.5 * (1 + math.erf(b / math.sqrt(2))) for b in (-2.0, 2.0))
        p = lo + (t0 * s24).to(torch.float64) * (hi - lo)
        v = (math.sqrt(2) * torch.erfinv(2 * p - 1)).clamp(-2.0, 2.0).to(torch.float32)
    v = v * mul
    if add is not None:
        v = v + add
    return v.reshape(sizes)


DRAWS = {"uniform": rng.uniform, "normal": rng.normal, "truncated": rng.truncated_normal}

# (full shape, slice begin, slice sizes): whole tensors and slices spanning several DRAW_CHUNKs with a short last
# one; contiguous runs at an offset (the ramp path) and column slices (the strided index path); one slice of a
# tensor past 2**32 elements (the index's high word)
CASES = [
    ((300, 700), (0, 0), (300, 700)),
    ((1000, 400), (317, 0), (400, 400)),
    ((512, 1000), (0, 250), (512, 300)),
    ((3, 70, 1100), (1, 20, 0), (2, 50, 1100)),
    ((70000, 70000), (65000, 69000), (3, 1000)),
]


@pytest.mark.parametrize("kind", list(DRAWS))
@pytest.mark.parametrize("full,begin,sizes", CASES)
def test_chunked_draw_bitwise_equals_numpy_reference(kind, full, begin, sizes):
    assert initializers.DRAW_CHUNK >= 65536  # the real chunk size (other tests shrink it)
    ref = _reference(kind, 11, "w/kernel", full, begin, sizes, 0.02, None)
    got = initializers._k_draw_slice(begin, sizes, full=full, dtype=torch.float32, seed=11, key="w/kernel",
                                     draw=DRAWS[kind], mul=0.02, add=None)
    assert torch.equal(got, ref), (kind, full, begin, sizes)


@pytest.mark.parametrize("dtype,threads", [(torch.bfloat16, 1), (torch.float32, 2), (torch.float16, 2)])
def test_rounded_and_threaded_draw_bitwise_equals_numpy_reference(dtype, threads):
    full, begin, sizes = (900, 500), (100, 0), (700, 500)  # 350000 elements: 6 chunks, over 2 threads
    ref = _reference("normal", 3, "emb", full, begin, sizes, 0.5, 1.0).to(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = initializers._k_draw_slice(begin, sizes, full=full, dtype=dtype, seed=3, key="emb", draw=rng.normal,
                                         mul=0.5, add=1.0)
    finally:
        torch.set_num_threads(old)
    assert got.dtype == dtype and torch.equal(got, ref)

"""Counter-based random numbers: a pure function of (seed, key, global element index).

Each element's random bits are a hash of its *global* (logical-tensor) index, so a processor
computes exactly its slice's values with no communication, and the values are identical under
every mesh and layout, on every replica. (Mesh TF draws per-slice from stateful generators, so
its random values change with the layout.) The hash is Chris Wellons' ``lowbias32`` applied to
the index words mixed with a 64-bit key derived from ``(seed, key)`` by BLAKE2b; the arithmetic
is done in int64 with 16-bit partial products, so it never overflows.

Initial values are drawn by :func:`draw_flat`: the same values bit for bit, the integer hash computed by NumPy
in uint32 (wrapping products, in place, over a whole chunk and both Box-Muller streams at once, the three
lowbias32 rounds' inner xorshifts folded away: :func:`_rounds_np`) and the float part (Box-Muller, inverse CDF)
by the torch code below on the values' device, so the float rounding is the torch path's; on the CPU the
normal and uniform float parts run their correctly rounded steps in NumPy (:func:`_normal24_np`; the same
values: ``tests/test_draw_float_exhaustive.py`` checks every possible input).
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_HASH_MULS = (0x7FEB352D, 0x846CA68B)
_SCALE24 = 1.0 / (1 << 24)


def key_words(seed: int, key: str) -> tuple[int, int]:
    """Two 32-bit words derived from ``(seed, key)``; ``key`` is usually an op or variable name."""
    h = hashlib.blake2b(f"{int(seed)}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h[:4], "little"), int.from_bytes(h[4:], "little")


def _mul32(x: torch.Tensor, a: int) -> torch.Tensor:
    lo, hi = a & 0xFFFF, a >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _HASH_MULS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _HASH_MULS[1])
    return x ^ (x >> 16)


def global_index(full_sizes, begin, slice_sizes, device=None) -> torch.Tensor:
    """int64 tensor of ``slice_sizes``: each element's row-major index in the full tensor."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    n = len(full_sizes)
    for i in reversed(range(n)):
        r = torch.arange(begin[i], begin[i] + slice_sizes[i], dtype=torch.int64, device=device) * stride
        shape = [1] * n
        shape[i] = slice_sizes[i]
        idx = idx + r.view(shape)
        stride *= full_sizes[i]
    return idx.expand(*slice_sizes) if n else idx


def flat_global_index(full_sizes, begin, slice_sizes, start: int, stop: int, device=None) -> torch.Tensor:
    """1-D int64 tensor: the row-major indices in the full tensor of the slice's elements at flat (row-major)
    positions ``start .. stop - 1`` of the slice; equal to ``global_index(...).reshape(-1)[start:stop]``
    without materialising the whole slice's indices (chunked initialisation, :mod:`meshtorch.ops.initializers`)."""
    k = torch.arange(start, stop, dtype=torch.int64, device=device)
    idx = torch.zeros(stop - start, dtype=torch.int64, device=device)
    stride = 1
    for i in reversed(range(len(full_sizes))):
        c = k % slice_sizes[i] if i else k
        idx += (c + begin[i]) * stride
        if i:
            k = k.div(slice_sizes[i], rounding_mode="floor")
        stride *= full_sizes[i]
    return idx


def random_bits(seed: int, key: str, index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """32 random bits (in int64) per element of ``index`` for stream ``stream``."""
    k0, k1 = key_words(seed, f"{key}#{stream}")
    lo = index & _MASK32
    hi = index >> 32
    h = _hash32(lo ^ k0)
    h = _hash32(h ^ hi ^ k1)
    return _hash32(h ^ k0)


def _top24(bits: torch.Tensor) -> torch.Tensor:
    """The top 24 of 32 random bits as float32 (exact)."""
    return (bits >> 8).to(torch.float32)


def _uniform24(top: torch.Tensor) -> torch.Tensor:
    """Uniform in [0, 1) from the top 24 bits (float32), in place in ``top``."""
    return top.mul_(_SCALE24)


def _normal24(top0: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
    """Box-Muller on the top 24 bits (float32) of streams 0 and 1 (u1 in (0, 1], u2 in [0, 1)): the standard
    normal values, computed in place in ``top0`` (``top1`` is overwritten)."""
    u1 = top0.add_(1.0).mul_(_SCALE24)
    # cos(2 pi u2) with u2 = top1 / 2**24: one product, the same float32 value as (top1 * 2**-24) * 2 pi (both
    # factors' scaling by a power of two is exact)
    return u1.log_().mul_(-2.0).sqrt_().mul_(top1.mul_(_SCALE24 * 2.0 * math.pi).cos_())


def _truncated24(top: torch.Tensor, bound: float = 2.0) -> torch.Tensor:
    u = _uniform24(top).to(torch.float64)
    lo = 0.5 * (1 + math.erf(-bound / math.sqrt(2)))
    hi = 0.5 * (1 + math.erf(bound / math.sqrt(2)))
    p = lo + u * (hi - lo)
    return (math.sqrt(2) * torch.erfinv(2 * p - 1)).clamp(-bound, bound).to(torch.float32)


def uniform(seed: int, key: str, index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """float32 uniform in [0, 1), 24 random bits per element."""
    return _uniform24(_top24(random_bits(seed, key, index, stream)))


def normal(seed: int, key: str, index: torch.Tensor) -> torch.Tensor:
    """float32 standard normal (Box-Muller on two independent uniform streams)."""
    return _normal24(_top24(random_bits(seed, key, index, 0)), _top24(random_bits(seed, key, index, 1)))


def truncated_normal(seed: int, key: str, index: torch.Tensor, bound: float = 2.0) -> torch.Tensor:
    """float32 standard normal truncated to [-bound, bound], by the inverse CDF (no resampling)."""
    return _truncated24(_top24(random_bits(seed, key, index)), bound)


def _uniform24_np(top: np.ndarray) -> None:
    """:func:`_uniform24` in place on a float32 NumPy array (an exact scaling: the same values)."""
    top *= np.float32(_SCALE24)


def _normal24_np(top0: np.ndarray, top1: np.ndarray) -> None:
    """:func:`_normal24` in place in ``top0`` (float32 NumPy arrays; ``top1`` is overwritten), bit for bit: the
    correctly rounded steps (``+ 1``, the products; NumPy's float32 product by ``np.float32(c)`` is torch's by a
    Python scalar, which torch rounds to float32 first) in NumPy, at about half the per-pass cost of torch
    calls, and ``log``, ``sqrt`` and ``cos`` by torch as there (torch's float32 ``sqrt`` is not always
    correctly rounded: NumPy's differs on 2.9M of the 2**24 possible radii)."""
    np.add(top0, np.float32(1.0), out=top0)
    top0 *= np.float32(_SCALE24)
    torch.from_numpy(top0).log_()
    top0 *= np.float32(-2.0)
    torch.from_numpy(top0).sqrt_()
    top1 *= np.float32(_SCALE24 * 2.0 * math.pi)
    torch.from_numpy(top1).cos_()
    top0 *= top1


#: ``{draw function: (the streams it reads, its float part on their top 24 bits)}``, for :func:`draw_flat`.
_FLOAT_PARTS = {uniform: ((0,), _uniform24), normal: ((0, 1), _normal24), truncated_normal: ((0,), _truncated24)}
#: The float parts that :func:`draw_flat` runs on CPU values in NumPy, in place in the first row (the same values).
_FLOAT_PARTS_NP = {uniform: _uniform24_np, normal: _normal24_np}


def _xorshift16(x: int) -> int:
    """``x ^ (x >> 16)`` on 32 bits: lowbias32's first and last step, an involution (applied twice it is the
    identity) and linear over GF(2) (``f(x ^ c) == f(x) ^ f(c)``)."""
    return x ^ (x >> 16)


def _mix_np(x: np.ndarray, t: np.ndarray) -> None:
    """lowbias32 without its first and last :func:`_xorshift16` (multiply, ``x ^= x >> 15``, multiply), in place
    on a uint32 array (NumPy's uint32 product wraps modulo 2**32); ``t``: scratch of ``x``'s shape."""
    x *= np.uint32(_HASH_MULS[0])
    np.right_shift(x, 15, out=t)
    x ^= t
    x *= np.uint32(_HASH_MULS[1])


@functools.lru_cache(maxsize=64)
def _stream_words(seed: int, key: str, streams: tuple) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_xorshift16` of each stream's :func:`key_words` as two uint32 ``[len(streams), 1]`` columns
    (cached: a slice's chunks share them; read only)."""
    words = [key_words(seed, f"{key}#{s}") for s in streams]
    return tuple(np.array([[_xorshift16(w[j])] for w in words], dtype=np.uint32) for j in (0, 1))


def _rounds_np(words: tuple[np.ndarray, np.ndarray], f_hi, out: np.ndarray, t: np.ndarray) -> None:
    """:func:`random_bits` before its last :func:`_xorshift16`, in place in ``out`` (uint32 ``[streams, n]``),
    which holds ``f(lo) ^ f(k0)`` on entry; ``words``: :func:`_stream_words`; ``f_hi``: 0 or ``f(hi)`` (uint32
    ``[n]``); ``t``: scratch of ``out``'s shape.

    :func:`random_bits` is ``H(H(H(lo ^ k0) ^ hi ^ k1) ^ k0)`` with lowbias32 ``H = f . mix . f`` (``f``:
    :func:`_xorshift16`, ``mix``: :func:`_mix_np`). As ``f`` is a linear involution, ``f(f(y) ^ c) == y ^ f(c)``:
    between two rounds the last ``f`` of one and the first ``f`` of the next cancel to one XOR with a constant,
    so the three rounds are ``mix(mix(mix(f(lo) ^ f(k0)) ^ f(hi) ^ f(k1)) ^ f(k0))`` then ``f``: 13 NumPy passes
    per stream instead of 27 (the same bits)."""
    fk0, fk1 = words
    _mix_np(out, t)
    if not np.isscalar(f_hi):
        out ^= f_hi
    out ^= fk1
    _mix_np(out, t)
    out ^= fk0
    _mix_np(out, t)


def _xorshift16_np(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """:func:`_xorshift16` in place on a uint32 array (``t``: scratch of its shape); returns ``x``."""
    np.right_shift(x, 16, out=t)
    x ^= t
    return x


def random_bits_np(seed: int, key: str, streams, lo: np.ndarray, hi, out: np.ndarray, t: np.ndarray) -> None:
    """:func:`random_bits` of each stream in ``streams`` into the rows of ``out`` (uint32
    ``[len(streams), n]``), bit for bit, for the global indices ``lo + hi * 2**32`` (``lo``: uint32 ``[n]``;
    ``hi``: 0 or uint32 ``[n]``); ``t``: uint32 scratch of ``out``'s shape."""
    words = _stream_words(seed, key, tuple(streams))
    np.bitwise_xor(_xorshift16_np(lo.copy(), t[0]), words[0], out=out)
    _rounds_np(words, hi if np.isscalar(hi) else _xorshift16_np(np.array(hi, dtype=np.uint32), t[0]), out, t)
    _xorshift16_np(out, t)


@functools.lru_cache(maxsize=64)
def contiguous_start(full_sizes: tuple, begin: tuple, slice_sizes: tuple) -> int | None:
    """The global (row-major) index of a slice's first element if its elements are consecutive in the full
    tensor (every dim after the first one of size > 1 in the slice is whole), else None (cached: a slice's
    chunks share it)."""
    lead = next((i for i, s in enumerate(slice_sizes) if s != 1), len(slice_sizes))
    if any(s != f for s, f in zip(slice_sizes[lead + 1:], full_sizes[lead + 1:], strict=True)):
        return None
    first, stride = 0, 1
    for i in reversed(range(len(full_sizes))):
        first += begin[i] * stride
        stride *= full_sizes[i]
    return first


@functools.lru_cache(maxsize=64)
def contiguous_runs(full_sizes: tuple, begin: tuple, slice_sizes: tuple) -> tuple | None:
    """A slice whose elements are not consecutive in the full tensor as runs of consecutive ones: ``(run
    length, the outer dims' slice sizes, begins and strides in the full tensor, the runs' common offset)``; None
    if its last global index exceeds ``2**32 - 1`` (then :func:`draw_flat` takes the int64 path). A run is the
    slice's extent along the last dim that the slice cuts and every dim after it (cached: a slice's chunks share
    it)."""
    if not slice_sizes or math.prod(slice_sizes) == 0:
        return None
    strides = [1] * len(full_sizes)
    for i in reversed(range(len(full_sizes) - 1)):
        strides[i] = strides[i + 1] * full_sizes[i + 1]
    if sum((b + s - 1) * st for b, s, st in zip(begin, slice_sizes, strides, strict=True)) > _MASK32:
        return None
    cut = max((i for i, (s, f) in enumerate(zip(slice_sizes, full_sizes, strict=True)) if s != f), default=None)
    if cut is None:  # the whole tensor (contiguous)
        return None
    length = math.prod(slice_sizes[cut:])
    return length, slice_sizes[:cut], begin[:cut], tuple(strides[:cut]), begin[cut] * strides[cut]


def _run_indices(length: int, outer_sizes: tuple, outer_begin: tuple, outer_strides: tuple, offset: int,
                 ramp: np.ndarray, start: int, stop: int, lo: np.ndarray) -> None:
    """The global indices (uint32, into ``lo[:stop - start]``) of a slice's flat positions ``start .. stop - 1``,
    from its :func:`contiguous_runs`: each run's first index (one per run, from the outer dims) plus ``0, 1,
    ...`` along the run, as one broadcast sum over the chunk's whole runs (``ramp``: uint32 ``0, 1, ...``)."""
    r0, r1 = start // length, -(-stop // length)
    rs = np.arange(r0, r1, dtype=np.int64)
    base = np.full(len(rs), offset, dtype=np.int64)
    for size, b, st in zip(reversed(outer_sizes), reversed(outer_begin), reversed(outer_strides), strict=True):
        base += (rs % size + b) * st
        rs //= size
    base = base.astype(np.uint32)  # every index <= 2**32 - 1 (contiguous_runs)
    head = min(stop, (r0 + 1) * length) - start  # the rest of the first run
    np.add(ramp[:head], base[0] + np.uint32(start - r0 * length), out=lo[:head])
    whole = (stop - start - head) // length
    if whole:
        body = lo[head:head + whole * length].reshape(whole, length)
        np.add(base[1:1 + whole, None], ramp[None, :length], out=body)
    tail = stop - start - head - whole * length
    if tail:
        np.add(ramp[:tail], base[-1], out=lo[stop - start - tail:stop - start])


class DrawScratch:
    """NumPy buffers for :func:`draw_flat` calls of up to ``n`` elements of one draw (reused across a slice's
    chunks): uint32 0, 1, ..., indices, bits and scratch, float32 top bits: ``8 + 12 * streams`` bytes per
    element."""

    def __init__(self, draw, n: int):
        streams = len(_FLOAT_PARTS[draw][0])
        self.ramp = np.arange(n, dtype=np.uint32)
        self.lo = np.empty(n, dtype=np.uint32)
        self.bits, self.t = (np.empty((streams, n), dtype=np.uint32) for _ in range(2))
        self.top = np.empty((streams, n), dtype=np.float32)


def draw_flat(draw, seed: int, key: str, full_sizes, begin, slice_sizes, start: int, stop: int, device=None,
              scratch: DrawScratch | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``draw(seed, key, flat_global_index(full_sizes, begin, slice_sizes, start, stop, device))`` bit for bit:
    float32 ``[stop - start]`` on ``device``, the integer hash computed by NumPy (module docstring) and the
    float part by ``draw``'s own torch code on ``device`` (on the CPU: :data:`_FLOAT_PARTS_NP`, the same values).

    Args:
        draw: :func:`uniform`, :func:`normal` or :func:`truncated_normal`.
        scratch: buffers of at least ``stop - start`` elements for this ``draw``, reused between calls (on the
            CPU and without ``out`` the result may share them: it is valid until the next call).
        out: a contiguous float32 CPU tensor of ``stop - start`` elements to compute into (returned).

    Raises:
        KeyError: a ``draw`` that is none of the three.
    """
    streams, floats = _FLOAT_PARTS[draw]
    n = stop - start
    sc = scratch if scratch is not None else DrawScratch(draw, n)
    lo, bits, t, top = sc.lo[:n], sc.bits[:, :n], sc.t[:, :n], sc.top[:, :n]
    first = contiguous_start(tuple(full_sizes), tuple(begin), tuple(slice_sizes))
    words = _stream_words(seed, key, tuple(streams))
    runs = None if first is not None else contiguous_runs(tuple(full_sizes), tuple(begin), tuple(slice_sizes))
    hi = 0
    if first is not None and first + stop <= _MASK32 + 1:
        g = first + start
        np.add(sc.ramp[:n], np.uint32(g), out=lo)  # no wrap: first + stop <= 2**32
        # f(lo) ^ f(k0) = lo ^ (lo >> 16) ^ f(k0), and lo >> 16 is one constant per 2**16-aligned run of lo
        a = 0
        while a < n:
            b = min(n, a + 0x10000 - ((g + a) & 0xFFFF))
            np.bitwise_xor(lo[a:b], words[0] ^ np.uint32((g + a) >> 16), out=bits[:, a:b])
            a = b
    elif n and runs is not None:
        _run_indices(*runs, sc.ramp, start, stop, lo)
        np.bitwise_xor(_xorshift16_np(lo, t[0]), words[0], out=bits)
    else:
        idx = flat_global_index(full_sizes, begin, slice_sizes, start, stop).numpy()
        np.copyto(lo, idx & _MASK32, casting="unsafe")
        if n and int(idx.max()) > _MASK32:
            hi = _xorshift16_np((idx >> 32).astype(np.uint32), t[0])
        np.bitwise_xor(_xorshift16_np(lo, t[0]), words[0], out=bits)
    _rounds_np(words, hi, bits, t)
    np.right_shift(bits, 24, out=t)  # the top 24 bits of random_bits = f(bits) (f: _xorshift16) ...
    bits >>= 8
    bits ^= t  # ... are (bits >> 8) ^ (bits >> 24)
    dsts = [out.numpy() if i == 0 and out is not None else top[i] for i in range(len(streams))]
    for dst, row in zip(dsts, bits, strict=True):
        np.copyto(dst, row.view(np.int32), casting="unsafe")  # < 2**24: exact in float32 (int32: a SIMD cast)
    if draw in _FLOAT_PARTS_NP and (device is None or torch.device(device).type == "cpu"):
        _FLOAT_PARTS_NP[draw](*dsts)
        return out if out is not None else torch.from_numpy(dsts[0])
    v = floats(*[out if i == 0 and out is not None else torch.from_numpy(d).to(device) for i, d in enumerate(dsts)])
    return v if out is None or v is out else out.copy_(v)

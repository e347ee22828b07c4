"""Counter-based random numbers: a pure function of (seed, key, global element index).

Each element's random bits are a hash of its *global* (logical-tensor) index, so a processor
computes exactly its slice's values with no communication, and the values are identical under
every mesh and layout, on every replica. (Mesh TF draws per-slice from stateful generators, so
its random values change with the layout.) The hash is Chris Wellons' ``lowbias32`` applied to
the index words mixed with a 64-bit key derived from ``(seed, key)`` by BLAKE2b; the arithmetic
is done in int64 with 16-bit partial products, so it never overflows.
"""

from __future__ import annotations

import hashlib
import math

import torch

_MASK32 = 0xFFFFFFFF


def key_words(seed: int, key: str) -> tuple[int, int]:
    """Two 32-bit words derived from ``(seed, key)``; ``key`` is usually an op or variable name."""
    h = hashlib.blake2b(f"{int(seed)}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h[:4], "little"), int.from_bytes(h[4:], "little")


def _mul32(x: torch.Tensor, a: int) -> torch.Tensor:
    lo, hi = a & 0xFFFF, a >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
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


def uniform(seed: int, key: str, index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """float32 uniform in [0, 1), 24 random bits per element."""
    return (random_bits(seed, key, index, stream) >> 8).to(torch.float32) * (1.0 / (1 << 24))


def normal(seed: int, key: str, index: torch.Tensor) -> torch.Tensor:
    """float32 standard normal (Box-Muller on two independent uniform streams)."""
    u1 = ((random_bits(seed, key, index, 0) >> 8).to(torch.float32) + 1.0) * (1.0 / (1 << 24))
    u2 = uniform(seed, key, index, 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


def truncated_normal(seed: int, key: str, index: torch.Tensor, bound: float = 2.0) -> torch.Tensor:
    """float32 standard normal truncated to [-bound, bound], by the inverse CDF (no resampling)."""
    u = uniform(seed, key, index).to(torch.float64)
    lo = 0.5 * (1 + math.erf(-bound / math.sqrt(2)))
    hi = 0.5 * (1 + math.erf(bound / math.sqrt(2)))
    p = lo + u * (hi - lo)
    return (math.sqrt(2) * torch.erfinv(2 * p - 1)).clamp(-bound, bound).to(torch.float32)

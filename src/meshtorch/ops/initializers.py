"""Variable initializers, drawn from the counter-based generator (:mod:`meshtorch.ops.rng`).

Each processor computes its own slice from the global element indices, keyed by
``(graph seed, variable name)``: initial weights are identical under every mesh and layout and
need no communication. An initializer's ``slice_fn(shape, dtype, seed, key)`` returns
``fn(begin, slice_sizes, device) -> torch.Tensor``: a kernel (``functools.partial`` of a
module-level function with plain-data arguments, see :mod:`meshtorch.ops._kernels`), so that the
lowered program stays data.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import math
import mmap

import torch

from meshtorch.core.dims import Shape, convert_to_shape
from meshtorch.ops import rng
from meshtorch.ops._util import dim_names

#: Elements drawn per chunk. The transient of a draw is its :class:`rng.DrawScratch` (32 bytes per chunk
#: element for a normal draw, 2 MiB, allocated once per slice; :func:`rng.truncated_normal` adds float64
#: temporaries), whatever the variable's size. Each chunk costs ~40 NumPy and torch calls of ~1 us overhead
#: each: the 124M LM's draw alone took 4.8-6.5 s of CPU with 16384, 3.8-4.5 s with 65536 (one thread, 7
#: interleaved rounds; 262144 no better), though in the whole build benchmark the gain was inside the host's
#: spread (2026-11-28, docs/memory.md "Build time"). The values do not depend on the
#: chunk size (the float part is elementwise; :func:`rng.draw_flat` equals the int64 torch path bit for bit).
DRAW_CHUNK = 65536


def _k_draw_slice(begin, sizes, device=None, *, full, dtype: torch.dtype, seed: int, key: str, draw, mul: float,
                  add: float | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A slice (first element ``begin``, ``sizes``) of ``draw(seed, key, index) * mul (+ add)`` over the
    global indices of a tensor of ``full`` sizes, rounded to ``dtype`` (then to ``out_dtype`` if given);
    ``draw`` is an :mod:`rng` function.

    Drawn in chunks of :data:`DRAW_CHUNK` elements straight into the result (:func:`rng.draw_flat`: the
    integer hash in NumPy, float32 arithmetic; only :func:`rng.truncated_normal` uses float64 inside a
    chunk), so the transient memory is bounded by the chunk, not the slice; each element's value is the same
    as drawing the whole slice at once. On the CPU with ``torch.get_num_threads()`` T > 1 the chunks are split
    over T Python threads (chunk w, w + T, ..., each thread with its own scratch), whose torch ops run on one
    intra-op thread (:func:`one_thread`): the values do not depend on T.
    """
    sizes = tuple(int(s) for s in sizes)
    out = torch.empty(sizes, dtype=out_dtype or dtype, device=device)
    flat = out.view(-1)
    n = flat.numel()
    chunk = DRAW_CHUNK
    direct = flat.dtype == dtype == torch.float32 and flat.device.type == "cpu"  # drawn in place in ``out``
    workers = min(torch.get_num_threads(), -(-n // chunk)) if flat.device.type == "cpu" else 1

    def part(w: int) -> None:  # chunks w, w + workers, ... (each worker its own NumPy buffers)
        scratch = rng.DrawScratch(draw, min(n, chunk))
        for start in range(w * chunk, n, workers * chunk):
            stop = min(n, start + chunk)
            seg = flat[start:stop]
            v = rng.draw_flat(draw, seed, key, full, begin, sizes, start, stop, device, scratch,
                              out=seg if direct else None).mul_(mul)
            if add is not None:
                v.add_(add)
            if not direct:
                seg.copy_(v.to(dtype))  # (then to out_dtype: copy_ rounds as .to does)

    with one_thread():
        if workers <= 1:
            part(0)
        else:  # the intra-op threads' share as Python threads over the chunks (NumPy and torch drop the GIL)
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                list(pool.map(part, range(workers)))
    return out


@contextlib.contextmanager
def one_thread():
    """Run the enclosed torch ops on one intra-op thread (``torch.set_num_threads(1)``, restored after).

    A chunk's transcendental ops (log, cos, erfinv) are above PyTorch's small parallel grain for them, so with
    more threads each would start an OpenMP team for a few microseconds of work: on a shared, oversubscribed
    host (2 cores, load ~11) that made the draw 10x slower in CPU time (395 vs 31 ns per element, 2 vs 1
    threads, 2026-11-28). The values are the same: these ops are elementwise. The setting is process-wide: torch
    ops of other Python threads meanwhile run on one thread too."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _k_values_slice(begin, sizes, device=None, *, initializer, shape, dtype, seed, key,
                    out_dtype=None) -> torch.Tensor:
    """Fallback for a subclass that only implements ``values`` (its parameters are not plain data)."""
    idx = rng.global_index(shape.to_integer_list(), begin, sizes, device)
    v = initializer.values(shape, dtype, seed, key, idx).to(dtype)
    return v if out_dtype is None else v.to(out_dtype)


#: Zero-filled slices of at least this many bytes are mapped as untouched zero pages (:func:`untouched_zeros`);
#: smaller ones are ``torch.zeros`` (a mapping per tensor is page-granular and costs a system call).
ZERO_PAGES_MIN_BYTES = 1 << 20


def untouched_zeros(sizes, dtype: torch.dtype) -> torch.Tensor:
    """A writable, contiguous CPU tensor of zeros of ``sizes`` and ``dtype`` whose memory is not touched yet.

    At least :data:`ZERO_PAGES_MIN_BYTES`: a private anonymous mapping (``mmap``; page-aligned, zero-filled by the
    kernel on first access), so the memory becomes resident page by page when first written, as PyTorch's
    optimizers allocate their state at the first step; ``torch.zeros`` would write every page now (~0.6 ns per
    byte on the 2-core host: a third of the 1B AdamW build's bytes, docs/memory.md "Build time"). The tensor
    holds the mapping, which is unmapped when the tensor is freed. Its storage is not resizable (a value of
    another shape replaces it: :meth:`~meshtorch.lowering.variables.VariableStore.commit`). Smaller:
    ``torch.zeros``.
    """
    sizes = tuple(int(s) for s in sizes)
    n = math.prod(sizes)
    nbytes = n * dtype.itemsize
    if nbytes < ZERO_PAGES_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):  # (no anonymous mappings: Windows)
        return torch.zeros(sizes, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=n).view(sizes)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (<linux/mman.h>); Python's mmap module does not name it


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def populate(t: torch.Tensor) -> bool:
    """Make the pages of an :func:`untouched_zeros` tensor resident and writable now, in one system call
    (``madvise(MADV_POPULATE_WRITE)``): the page faults its first write takes anyway, without the extra fault per
    page a read-modify-write (AdamW's moments, ``m = b1 m + (1 - b1) g``) takes on untouched memory, whose read maps
    the shared zero page and whose write then copies it (measured: 2 faults per page at the first step, 638k vs
    136k for 1 GB of moments). The values stay zeros. Returns False (nothing done) for a tensor smaller than
    :data:`ZERO_PAGES_MIN_BYTES` or not page-aligned (not from :func:`untouched_zeros`), or where the kernel does
    not support it (then the first write faults page by page, with the same values)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < ZERO_PAGES_MIN_BYTES or t.data_ptr() % mmap.PAGESIZE:
        return False
    return _libc().madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(nbytes), _MADV_POPULATE_WRITE) == 0


def fills_zeros(kernel) -> bool:
    """Whether an initializer kernel (:meth:`Initializer.slice_fn`) fills its slices with +0 (:func:`untouched_zeros`
    on the CPU: see :func:`populate`)."""
    return getattr(kernel, "func", None) is _k_fill_slice and _is_plus_zero(kernel.keywords.get("value"))


def _is_plus_zero(value) -> bool:
    return value == 0 and math.copysign(1.0, value) > 0


def _k_fill_slice(begin, sizes, device=None, *, value: float, dtype: torch.dtype, out_dtype=None) -> torch.Tensor:
    if _is_plus_zero(value) and (device is None or torch.device(device).type == "cpu"):
        return untouched_zeros(sizes, out_dtype or dtype)  # (+0 in every dtype: the cast of the fill below)
    with one_thread():  # (see one_thread; a fill is memory-bound)
        v = torch.full(sizes, value, dtype=dtype, device=device)
    return v if out_dtype is None or out_dtype == dtype else v.to(out_dtype)


class Initializer:
    """Base class. Subclasses implement ``draw_params(shape)`` (plain data for a kernel) or
    ``values(shape, dtype, seed, key, index)`` on global indices."""

    def draw_params(self, shape: Shape):
        """``(draw, mul, add)``: values are ``draw(seed, key, index) * mul (+ add unless None)`` with
        ``draw`` one of :func:`rng.uniform`, :func:`rng.normal`, :func:`rng.truncated_normal`; None if
        the subclass implements only ``values``."""
        return None

    def slice_fn(self, shape: Shape, dtype: torch.dtype, seed: int, key: str, out_dtype: torch.dtype | None = None):
        """Kernel ``fn(begin, sizes, device=None) -> torch.Tensor`` computing one slice of the values in
        ``dtype`` (then cast to ``out_dtype`` if given: a variable's master dtype, then its slice dtype)."""
        params = self.draw_params(shape)
        if params is None:
            return functools.partial(_k_values_slice, initializer=self, shape=shape, dtype=dtype, seed=seed, key=key,
                                     out_dtype=out_dtype)
        draw, mul, add = params
        return functools.partial(_k_draw_slice, full=tuple(shape.to_integer_list()), dtype=dtype, seed=seed,
                                 key=key, draw=draw, mul=mul, add=add, out_dtype=out_dtype)

    def values(self, shape, dtype, seed, key, index):
        params = self.draw_params(shape)
        if params is None:
            raise NotImplementedError
        draw, mul, add = params
        v = draw(seed, key, index) * mul
        return v if add is None else v + add


class _Fill(Initializer):
    def __init__(self, value: float):
        self.value = value

    def slice_fn(self, shape, dtype, seed, key, out_dtype=None):
        return functools.partial(_k_fill_slice, value=self.value, dtype=dtype, out_dtype=out_dtype)

    def __repr__(self):
        return f"constant_initializer({self.value})"


def zeros_initializer() -> Initializer:
    """All zeros."""
    return _Fill(0.0)


def ones_initializer() -> Initializer:
    """All ones."""
    return _Fill(1.0)


def constant_initializer(value: float) -> Initializer:
    """Every element ``value``."""
    return _Fill(value)


class RandomNormal(Initializer):
    """Normal(mean, stddev) per element (Box-Muller on counter-based uniforms)."""

    def __init__(self, mean=0.0, stddev=1.0):
        self.mean, self.stddev = mean, stddev

    def draw_params(self, shape):
        return rng.normal, self.stddev, self.mean


class TruncatedNormal(Initializer):
    """Normal(mean, stddev) truncated to two standard deviations (as ``tf.truncated_normal``)."""

    def __init__(self, mean=0.0, stddev=1.0):
        self.mean, self.stddev = mean, stddev

    def draw_params(self, shape):
        return rng.truncated_normal, self.stddev, self.mean


class RandomUniform(Initializer):
    """Uniform on [minval, maxval)."""

    def __init__(self, minval=0.0, maxval=1.0):
        self.minval, self.maxval = minval, maxval

    def draw_params(self, shape):
        return rng.uniform, self.maxval - self.minval, self.minval


def random_normal_initializer(mean=0.0, stddev=1.0) -> Initializer:
    return RandomNormal(mean, stddev)


def truncated_normal_initializer(mean=0.0, stddev=1.0) -> Initializer:
    return TruncatedNormal(mean, stddev)


def random_uniform_initializer(minval=0.0, maxval=1.0) -> Initializer:
    return RandomUniform(minval, maxval)


class VarianceScalingInitializer(Initializer):
    """Variance scaling with fans from *named* dims (Mesh TF ``layers.VarianceScalingInitializer``).

    ``fan_in`` = product of the sizes of ``reduced_dims`` (the dims a layer contracts), ``fan_out``
    = product of ``new_dims``. If not given, ``new_dims`` is the variable's last dim and
    ``reduced_dims`` the others. ``n`` = fan_in, fan_out or their mean per ``mode``; the stddev is
    ``sqrt(scale / n)``: ``normal``; ``truncated_normal`` (2 sigma, stddev corrected by 0.8796 as
    in TF); ``uniform`` on ``[-sqrt(3 scale / n), +...]``.
    """

    def __init__(self, scale=1.0, mode="fan_in", distribution="normal", reduced_dims=None, new_dims=None):
        if mode not in ("fan_in", "fan_out", "fan_avg"):
            raise ValueError(f"VarianceScalingInitializer: mode {mode!r} is not fan_in, fan_out or fan_avg.")
        if distribution not in ("normal", "truncated_normal", "uniform"):
            raise ValueError(f"VarianceScalingInitializer: distribution {distribution!r} is not normal, "
                             "truncated_normal or uniform.")
        self.scale, self.mode, self.distribution = scale, mode, distribution
        self.reduced_dims = None if reduced_dims is None else dim_names(reduced_dims)
        self.new_dims = None if new_dims is None else dim_names(new_dims)

    def _n(self, shape: Shape) -> float:
        shape = convert_to_shape(shape)
        new = self.new_dims if self.new_dims is not None else [shape[-1].name] if shape.ndims else []
        red = self.reduced_dims if self.reduced_dims is not None else [d.name for d in shape if d.name not in new]
        fan_in = max(1, math.prod(shape.get_dim_by_name(n).size for n in red))
        fan_out = max(1, math.prod(shape.get_dim_by_name(n).size for n in new))
        return {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[self.mode]

    def draw_params(self, shape):
        n = self._n(shape)
        if self.distribution == "uniform":
            limit = math.sqrt(3.0 * self.scale / n)
            return rng.uniform, 2 * limit, -limit  # x + (-limit) is exactly x - limit in IEEE arithmetic
        std = math.sqrt(self.scale / n)
        if self.distribution == "normal":
            return rng.normal, std, None
        return rng.truncated_normal, std / 0.87962566103423978, None


def glorot_uniform_initializer(reduced_dims=None, new_dims=None) -> Initializer:
    """Glorot/Xavier uniform: variance scaling, scale 1, fan_avg, uniform."""
    return VarianceScalingInitializer(1.0, "fan_avg", "uniform", reduced_dims, new_dims)


def convert_initializer(init) -> Initializer:
    """None -> glorot uniform (TF's default for ``get_variable``); a number -> constant."""
    if init is None:
        return glorot_uniform_initializer()
    if isinstance(init, Initializer):
        return init
    if isinstance(init, int | float):
        return constant_initializer(float(init))
    raise TypeError(f"Not an initializer: {init!r}. Use mtf.zeros_initializer(), mtf.random_normal_initializer(), ...")

"""Reading boxes of safetensors tensors with positioned reads (``os.preadv``) into buffers of the box's size.

``safetensors.safe_open(...).get_slice`` maps the whole file: the pages a strided box touches (a column
block of an ``[vocab, d_model]`` table touches every page of it) count in the process's resident set while
the file is mapped. :class:`BoxReader` reads the same bytes with one ``preadv`` per contiguous run instead,
so a process's memory grows by the bytes of its slices only. The file layout is safetensors' own (an 8-byte
little-endian header length, a JSON header of ``dtype``, ``shape`` and ``data_offsets`` per tensor, then the
raw row-major data: https://github.com/huggingface/safetensors#format); headers are checked against
``safe_open`` by :func:`meshtorch.checkpoint.hf.check_files` first.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from meshtorch.core.errors import CheckpointError

__all__ = ["BoxReader"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class BoxReader:
    """One safetensors file: ``read(key, ranges)`` returns the box ``[start, stop)`` per axis of tensor ``key``.

    Raises:
        CheckpointError: naming the file: an unreadable header, or an unknown dtype / tensor.
    """

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            self.header = json.loads(os.pread(self.fd, n, 8))
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"hf: {path!r} has no readable safetensors header ({e}).") from e
        self.base = 8 + n

    def read(self, key: str, ranges) -> torch.Tensor:
        info = self.header.get(key)
        if info is None:
            raise CheckpointError(f"hf: tensor {key!r} is not in {self.path!r}.")
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"hf: tensor {key!r} in {self.path!r} has dtype {info['dtype']}, which is not read.")
        shape = [int(s) for s in info["shape"]]
        ranges = [(0, s) if r is None else (int(r[0]), int(r[1])) for r, s in zip(ranges, shape, strict=True)]
        item = torch.empty((), dtype=dtype).element_size()
        sizes = [e - b for b, e in ranges]
        out = torch.empty(int(torch.tensor(sizes).prod()) * item if sizes else item, dtype=torch.uint8)
        view = memoryview(out.numpy())
        strides = [item] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        k = len(shape)  # axes k.. are read whole: one run covers them
        while k > 0 and ranges[k - 1] == (0, shape[k - 1]):
            k -= 1
        run_axis = k - 1  # the innermost partial axis: its range is contiguous given the outer indices
        run = (sizes[run_axis] * strides[run_axis]) if run_axis >= 0 else len(view)
        start = self.base + int(info["data_offsets"][0])
        pos = 0
        for outer in _indices([r for r in ranges[:max(run_axis, 0)]]):
            off = start + sum(i * s for i, s in zip(outer, strides, strict=False))
            if run_axis >= 0:
                off += ranges[run_axis][0] * strides[run_axis]
            got = os.preadv(self.fd, [view[pos:pos + run]], off)
            if got != run:
                raise CheckpointError(f"hf: {self.path!r} ended while reading tensor {key!r}: it is truncated.")
            pos += run
        return out.view(dtype).reshape(sizes)

    def close(self):
        os.close(self.fd)


def _indices(ranges):
    """Row-major index tuples over ``[(start, stop)]`` (one empty tuple for no ranges)."""
    if not ranges:
        yield ()
        return
    (b, e), rest = ranges[0], ranges[1:]
    for i in range(b, e):
        for tail in _indices(rest):
            yield (i, *tail)

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

__all__ = ["BoxReader", "read_header"]

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
        except OSError as e:
            raise CheckpointError(f"hf: {path!r} cannot be opened ({os.strerror(e.errno).lower()}).") from e
        try:
            self.header, self.base = read_header(path, self.fd)
        except CheckpointError:
            os.close(self.fd)
            raise

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


def read_header(path: str, fd: int | None = None) -> tuple[dict, int]:
    """The JSON header of safetensors file ``path`` and the offset of its data, checked against the file's size:
    every tensor's ``data_offsets`` lie inside the file and match its dtype and shape, and the data end where
    the file ends (what a truncated copy or a corrupt header breaks).

    Raises:
        CheckpointError: naming the file and what is wrong: "it is truncated or corrupt".
    """
    own = fd is None
    try:
        if own:
            fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        raw = os.pread(fd, 8, 0)
        if len(raw) < 8:
            raise CheckpointError(f"hf: {path!r} has {size} bytes, fewer than a safetensors header: it is "
                                  "truncated or not a safetensors file.")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"hf: {path!r} has {size} bytes but its header says the header alone takes "
                                  f"{8 + n}: it is truncated or corrupt.")
        try:
            header = json.loads(os.pread(fd, n, 8))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"hf: {path!r} has a corrupt safetensors header ({e}).") from None
    except OSError as e:
        raise CheckpointError(f"hf: {path!r} cannot be read ({os.strerror(e.errno).lower()}).") from e
    finally:
        if own and fd is not None:
            os.close(fd)
    if not isinstance(header, dict):
        raise CheckpointError(f"hf: {path!r} has a corrupt safetensors header (not a JSON object).")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            b, e = (int(x) for x in info["data_offsets"])
            count = 1
            for d in info["shape"]:
                count *= int(d)
            item = torch.empty((), dtype=_DTYPES[info["dtype"]]).element_size() if info["dtype"] in _DTYPES else None
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"hf: {path!r}: the header entry of tensor {key!r} is corrupt ({err!r}).") from None
        if not 0 <= b <= e or (item is not None and e - b != count * item):
            raise CheckpointError(f"hf: {path!r}: tensor {key!r} has data offsets [{b}, {e}) that do not fit its "
                                  f"dtype {info['dtype']} and shape {info['shape']}: the header is corrupt.")
        end = max(end, e)
    if 8 + n + end != size:
        raise CheckpointError(f"hf: {path!r} has {size} bytes but its header describes {8 + n + end}: it is "
                              f"{'truncated' if size < 8 + n + end else 'corrupt'}.")
    return header, 8 + n


def _indices(ranges):
    """Row-major index tuples over ``[(start, stop)]`` (one empty tuple for no ranges)."""
    if not ranges:
        yield ()
        return
    (b, e), rest = ranges[0], ranges[1:]
    for i in range(b, e):
        for tail in _indices(rest):
            yield (i, *tail)

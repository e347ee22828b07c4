"""Reader for MNIST-format IDX files (MNIST, Fashion-MNIST), plain or gzip-compressed.

IDX format (LeCun et al., http://yann.lecun.com/exdb/mnist/): a big-endian header
``0x00 0x00 <type code> <ndim>``, then ``ndim`` big-endian uint32 sizes, then the data in C
order. MNIST uses type code 0x08 (unsigned byte): magic 2051 (``0x00000803``) for the
``[N, 28, 28]`` images and 2049 (``0x00000801``) for the ``[N]`` labels.

Parsing uses numpy only; the results are torch tensors. Every failure raises
:class:`~meshtorch.core.errors.DataError` naming the file.
"""

from __future__ import annotations

import gzip
import os

import numpy as np
import torch

from meshtorch.core.errors import DataError

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"

IMAGES_MAGIC = 2051  # 0x00000803: unsigned byte, 3 dims
LABELS_MAGIC = 2049  # 0x00000801: unsigned byte, 1 dim

_SPLIT_PREFIX = {"train": "train", "test": "t10k"}


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"Cannot read IDX file {path!r}: {e.strerror or e}.") from e
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file name says
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DataError(f"IDX file {path!r} is not a complete gzip stream ({e}); the file is truncated "
                            "or corrupt, download it again.") from e
    return raw


def load_idx(path: str, expected_magic: int | None = None) -> np.ndarray:
    """Read one IDX file of unsigned bytes into a numpy ``uint8`` array of its declared shape.

    Args:
        path: the file (gzip-compressed or raw; detected from its first bytes).
        expected_magic: if given, the magic number the header must hold (2051 images, 2049 labels).

    Returns:
        ``np.ndarray`` uint8 with the header's sizes, e.g. ``[N, 28, 28]`` for images.

    Raises:
        DataError: naming ``path``, if it cannot be read, has the wrong magic number or a data type
            other than unsigned byte, or holds fewer bytes than the header declares.
    """
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"IDX file {path!r} is truncated: {len(raw)} bytes, not even a 4-byte header.")
    magic = int.from_bytes(raw[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise DataError(f"IDX file {path!r} has magic number {magic} (0x{magic:08x}); expected {expected_magic} "
                        f"(0x{expected_magic:08x}). Is it the right file (images vs labels) and an IDX file?")
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"IDX file {path!r}: magic number 0x{magic:08x} does not describe unsigned-byte data "
                        "(expected 0x000008NN).")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"IDX file {path!r} is truncated: its header declares {ndim} dims ({header} bytes) but the "
                        f"file has {len(raw)} bytes.")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    need = int(np.prod(shape, dtype=np.int64))
    have = len(raw) - header
    if have < need:
        raise DataError(f"IDX file {path!r} is truncated: the header declares shape {list(shape)} ({need} bytes of "
                        f"data) but only {have} bytes follow the header.")
    if have > need:
        raise DataError(f"IDX file {path!r} has {have - need} bytes beyond the {need} its header declares "
                        f"(shape {list(shape)}); the file is corrupt.")
    return np.frombuffer(raw, dtype=np.uint8, count=need, offset=header).reshape(shape)


def _find(data_dir: str, stem: str) -> str:
    for name in (stem + ".gz", stem):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    raise DataError(f"No IDX file {stem!r} (or {stem + '.gz'!r}) in {data_dir!r}. For Fashion-MNIST on Debian: "
                    "apt-get install dataset-fashion-mnist, or pass the directory holding the files.")


def load_mnist(split: str = "train", data_dir: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels of one split of an MNIST-format data set.

    Args:
        split: ``"train"`` (files ``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``)
            or ``"test"`` (``t10k-...``).
        data_dir: directory of the files; default ``/usr/share/datasets/fashion-mnist``.

    Returns:
        ``(images, labels)``: ``torch.uint8`` ``[N, rows, cols]`` and ``torch.int64`` ``[N]``.

    Raises:
        DataError: naming the file, if a file is missing, truncated or has a wrong magic number, or if
            the images and labels files hold different numbers of examples.
        ValueError: on an unknown ``split``.
    """
    if split not in _SPLIT_PREFIX:
        raise ValueError(f"load_mnist: split must be 'train' or 'test', got {split!r}.")
    data_dir = data_dir or DEFAULT_DATA_DIR
    prefix = _SPLIT_PREFIX[split]
    images_path = _find(data_dir, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(data_dir, f"{prefix}-labels-idx1-ubyte")
    images = load_idx(images_path, IMAGES_MAGIC)
    labels = load_idx(labels_path, LABELS_MAGIC)
    if images.ndim != 3:
        raise DataError(f"IDX file {images_path!r}: images must have 3 dims [N, rows, cols], got {images.shape}.")
    if labels.ndim != 1:
        raise DataError(f"IDX file {labels_path!r}: labels must have 1 dim [N], got {labels.shape}.")
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"Example count mismatch: {images_path!r} holds {images.shape[0]} images but "
                        f"{labels_path!r} holds {labels.shape[0]} labels.")
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))

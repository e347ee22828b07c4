"""Feeding each process only its slice of a batch.

With :class:`~meshtorch.mesh.spmd.SpmdMeshImpl` every process holds one processor's slices, so a
data loader should read only the examples of that slice. The flow is::

    ids = local_batch_indices(lowering, images, indices=batch_ids)   # examples this process reads
    x = dataset[ids]                                                  # [len(ids), rows, cols]
    lowering.run(fetches, feeds={images: local_feed(lowering, images, x)}, feed_slices=True)

The same code runs on a :class:`~meshtorch.mesh.placement.PlacementMeshImpl`, where the process
holds every processor and so reads the whole batch. Processors that share a batch slice (the batch
dim replicated over some mesh axis) read the same examples. Mesh TF equivalent: the per-device
input pipelines of ``SimdMeshImpl`` / ``tpu_estimator`` with ``per_host_input_for_training``.
"""

from __future__ import annotations

import numpy as np
import torch

from meshtorch.core.errors import FeedError
from meshtorch.core.graph import Tensor


def _dim_index(t: Tensor, dim) -> int:
    if dim is None:
        if t.shape.ndims == 0:
            raise FeedError(f"Placeholder {t.name!r} is a scalar; it has no batch dimension to shard.")
        return 0
    name = dim if isinstance(dim, str) else dim.name
    names = t.shape.dimension_names
    if name not in names:
        raise FeedError(f"Placeholder {t.name!r} {t.shape} has no dimension {name!r} to shard the batch on.")
    return names.index(name)


def local_batch_range(lowering, t: Tensor, dim=None) -> tuple[int, int]:
    """``(begin, end)``: positions along ``dim`` (default: ``t``'s first dim) this process holds.

    Raises:
        FeedError: naming the placeholder if it lacks ``dim``.
    """
    k = _dim_index(t, dim)
    bounds = lowering.local_slice_bounds(t)
    return min(b[k].start for b in bounds), max(b[k].stop for b in bounds)


def local_batch_indices(lowering, t: Tensor, dim=None, indices=None) -> torch.Tensor:
    """Example indices this process must read for placeholder ``t``.

    Args:
        lowering: the Lowering.
        t: the placeholder (e.g. images ``[batch, rows, cols]``).
        dim: the batch dimension (name or Dimension); default ``t``'s first dim.
        indices: the global batch's example ids (1-D, length = ``dim``'s size); default
            ``arange(size)``.

    Returns:
        int64 tensor: ``indices[begin:end]`` for this process's range along ``dim`` (all of them on a
        placement mesh).

    Raises:
        FeedError: naming the placeholder if it lacks ``dim`` or ``indices`` has the wrong length.
    """
    k = _dim_index(t, dim)
    size = t.shape.dims[k].size
    lo, hi = local_batch_range(lowering, t, dim)
    if indices is None:
        return torch.arange(lo, hi, dtype=torch.int64)
    indices = torch.as_tensor(np.asarray(indices) if not isinstance(indices, torch.Tensor) else indices)
    if indices.ndim != 1 or indices.shape[0] != size:
        raise FeedError(f"local_batch_indices: placeholder {t.name!r} has {t.shape.dims[k].name!r} of size {size}, "
                        f"but indices has shape {list(indices.shape)}.")
    return indices[lo:hi].to(torch.int64)


def local_feed(lowering, t: Tensor, local_rows, dim=None):
    """The ``feed_slices=True`` value for ``t`` from the rows this process read.

    Args:
        local_rows: tensor with ``t``'s full sizes except along ``dim``, where it holds the rows
            :func:`local_batch_indices` named, in that order (dims in ``t``'s declared order).

    Returns:
        this process's slice (one processor held) or a list of slices, one per ``local_pnums()``.

    Raises:
        FeedError: naming the placeholder if ``local_rows`` has the wrong shape.
    """
    k = _dim_index(t, dim)
    if not isinstance(local_rows, torch.Tensor):
        local_rows = torch.as_tensor(np.asarray(local_rows))
    lo, hi = local_batch_range(lowering, t, dim)
    want = t.shape.to_integer_list()
    want[k] = hi - lo
    if list(local_rows.shape) != want:
        raise FeedError(f"local_feed: placeholder {t.name!r} {t.shape} needs local rows of shape {want} "
                        f"(rows {lo}:{hi} of {t.shape.dims[k].name!r}), got {list(local_rows.shape)}.")
    out = []
    for b in lowering.local_slice_bounds(t):
        idx = list(b)
        idx[k] = slice(b[k].start - lo, b[k].stop - lo)
        out.append(local_rows[tuple(idx)])
    return out[0] if len(out) == 1 else out


def batch_slice(full_batch, lowering, t: Tensor, dim=None):
    """The ``feed_slices=True`` value for ``t`` cut from a full batch (convenience; reads it all).

    Raises:
        FeedError: naming the placeholder on a shape mismatch.
    """
    if not isinstance(full_batch, torch.Tensor):
        full_batch = torch.as_tensor(np.asarray(full_batch))
    if list(full_batch.shape) != t.shape.to_integer_list():
        raise FeedError(f"batch_slice: placeholder {t.name!r} expects the full shape {t.shape}, got "
                        f"{list(full_batch.shape)}.")
    k = _dim_index(t, dim)
    lo, hi = local_batch_range(lowering, t, dim)
    return local_feed(lowering, t, full_batch.narrow(k, lo, hi - lo), dim)


__all__ = ["batch_slice", "local_batch_indices", "local_batch_range", "local_feed"]

"""Moving one laid-out value between layouts of the same shape, and whole-dimension helpers.

Used by reshape (before and after the local reshape) and by the ops that need one dimension
whole on every processor (slice, pad, concat, split, unstack). Everything goes through the
Lowering (``lw.allconcat``, ``lw.alltoall``, ``lw.slicewise`` with ``lw.laid_out_constant``
processor coordinates), so it works on every MeshImpl.

A *layout* here is a tuple with one entry per tensor dimension: the index of the mesh axis that
splits it, or None (as :class:`~meshtorch.core.layout.TensorLayout`). Mesh axes of size 1 are
ignored: splitting over them moves no data.
"""

from __future__ import annotations

import numpy as np
import torch

from meshtorch.core.graph import Tensor


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def coordinate_constant(lw, t: Tensor, mesh_axis: int) -> int:
    """A slot holding each processor's coordinate (a Python int) on ``mesh_axis``."""
    impl = lw.mesh_impl(t)
    return lw.laid_out_constant(t, lambda p: impl.pnum_to_processor_coordinates(p)[mesh_axis])


def local_narrow(lw, slot: int, t: Tensor, tensor_axis: int, mesh_axis: int, piece: int) -> int:
    """Each processor keeps piece ``coordinate`` (of length ``piece``) of ``tensor_axis``: no communication."""
    coords = coordinate_constant(lw, t, mesh_axis)

    def f(x, c):
        return x.narrow(tensor_axis, c * piece, piece)
    return lw.slicewise(f, slot, coords, mesh=t)


def relayout(lw, slot: int, t: Tensor, shape, src, dst) -> int:
    """Move ``slot`` (a value of global ``shape`` laid out as ``src``) to layout ``dst``.

    Per mesh axis ``a`` (size > 1):

    * same tensor dim in both: nothing;
    * split in ``src`` only: all-gather (``allconcat``) along its dim;
    * split in ``dst`` only: local slice (each processor keeps its piece; no communication);
    * split on dim i in ``src`` and dim j in ``dst``: all-to-all (split j, concatenate i), done
      once dim j is whole locally; if the moves form a cycle (a: i->j and b: j->i) one of them is
      all-gathered and sliced instead.

    ``t`` names the tensor in the collective records; bytes are those of the current slices.
    """
    impl = lw.mesh_impl(t)
    sizes = [d.size for d in shape]
    nax = {a: impl.shape[a].size for a in range(impl.ndims)}
    src = [a if a is not None and nax[a] > 1 else None for a in src]
    dst = [a if a is not None and nax[a] > 1 else None for a in dst]
    cur = list(src)
    local = [s // (nax[a] if a is not None else 1) for s, a in zip(sizes, cur, strict=True)]
    isz = itemsize(t.dtype)

    def nbytes():
        return int(np.prod(local, dtype=np.int64)) * isz

    src_dim = {a: i for i, a in enumerate(src) if a is not None}
    dst_dim = {a: i for i, a in enumerate(dst) if a is not None}

    def gather(a):
        i = cur.index(a)
        nonlocal slot
        slot = lw.allconcat(slot, a, i, t, nbytes=nbytes())
        cur[i] = None
        local[i] = sizes[i]

    for a in src_dim:
        if a not in dst_dim:
            gather(a)
    moves = [a for a in src_dim if a in dst_dim and dst_dim[a] != src_dim[a]]
    while moves:
        ready = [a for a in moves if cur[dst_dim[a]] is None]
        if ready:
            a = ready[0]
            i, j = src_dim[a], dst_dim[a]
            slot = lw.alltoall(slot, a, j, i, t, nbytes=nbytes())
            cur[i], cur[j] = None, a
            local[i], local[j] = sizes[i], sizes[j] // nax[a]
        else:
            a = moves[0]
            gather(a)
        moves.remove(a)
    for a, j in dst_dim.items():
        if cur[j] == a:
            continue
        assert cur[j] is None, (cur, dst)
        local[j] = sizes[j] // nax[a]
        slot = local_narrow(lw, slot, t, j, a, local[j])
        cur[j] = a
    return slot


def gather_dim(lw, t: Tensor, slot: int, dim_name: str) -> int:
    """``t``'s slot with dimension ``dim_name`` whole on every processor (all-gather if it is split)."""
    i = t.shape.get_dim_index(dim_name)
    src = tuple(lw.tensor_layout(t))
    dst = tuple(None if k == i else a for k, a in enumerate(src))
    return relayout(lw, slot, t, t.shape, src, dst)


def scatter_dim(lw, out: Tensor, slot: int, dim_name: str) -> int:
    """From a value of ``out`` with ``dim_name`` whole, keep each processor's piece (local; no communication)."""
    i = out.shape.get_dim_index(dim_name)
    dst = tuple(lw.tensor_layout(out))
    src = tuple(None if k == i else a for k, a in enumerate(dst))
    return relayout(lw, slot, out, out.shape, src, dst)

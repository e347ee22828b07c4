"""The KV-cache step's write is its ``assign`` (meshtorch.layers.kv_cache.Step): the in-place ``index_copy_`` of
:class:`~meshtorch.layers.kv_cache.CacheWriteOperation` is only the early form of that assignment (the plan donates a
variable to an in-place kernel only in a run that assigns the variable: meshtorch.lowering.donate). A run that reads
the written cache without assigning it leaves the cache as it was; with the assign the row is written in place (the
plan donates the cache, the storage stays). Reference: the same values written with plain ``index_copy``. Decoding
through the caches against ``transformers`` (tests/test_hf_kv_cache.py, tests/test_t5_kv_decode.py) fails when the
step's assigns are dropped."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mtf
from meshtorch.core.donation import kernel_of
from meshtorch.layers.kv_cache import MEMORY, CacheWriteOperation, _k_cache_write
from meshtorch.lowering.donate import donated_mask
from meshtorch.ops.variables import assign, placeholder


@pytest.mark.parametrize("mesh_shape,layout", [("", ""), ("data:2;model:2", "batch:data;heads:model")])
def test_cache_write_changes_the_cache_only_through_its_assign(mesh_shape, layout):
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "m")
    batch, heads, mem, key = (mtf.Dimension(n, s) for n, s in (("batch", 2), ("heads", 2), (MEMORY, 5), ("d_kv", 3)))
    start = torch.randn(2, 2, 5, 3, generator=torch.Generator().manual_seed(0))
    cache = mtf.get_variable(mesh, "k_cache", [batch, heads, mem, key], initializer=0.0, trainable=False)
    new = placeholder(mesh, "new", [key, heads, batch])  # another dim order: the write permutes
    pos = placeholder(mesh, "pos", [], dtype=torch.int64)
    full = CacheWriteOperation(cache, new, pos).outputs[0]
    total = mtf.reduce_sum(full, output_shape=[batch])
    write = assign(cache, full)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
    lw.set_variable_value("k_cache", start)
    x = torch.randn(3, 2, 2, generator=torch.Generator().manual_seed(1))
    want = start.index_copy(2, torch.tensor([3]), x.permute(2, 1, 0).unsqueeze(2))
    feeds = {new: x, pos: torch.tensor(3)}

    def donated(fetches):
        steps = [st for st in lw.plan(fetches).steps if st.kind == "slicewise" and kernel_of(st.fn) is _k_cache_write]
        assert steps
        return any(any(donated_mask(st)) for st in steps)

    # read, not assigned: the result holds the row, the cache does not
    assert not donated([total])
    torch.testing.assert_close(lw.run(total, feeds=feeds), want.sum((1, 2, 3)))
    torch.testing.assert_close(lw.variable_value("k_cache"), start)
    # assigned: written in place (donated; the cache's storage kept)
    ptrs = [t.data_ptr() for t in lw.store.impl("k_cache").local_slices(lw.store.values["k_cache"])]
    assert donated([total, write])
    lw.run([total, write], feeds=feeds)
    torch.testing.assert_close(lw.variable_value("k_cache"), want)
    assert [t.data_ptr() for t in lw.store.impl("k_cache").local_slices(lw.store.values["k_cache"])] == ptrs

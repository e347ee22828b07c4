"""Chunked initial values (issue 21): bitwise the values of the former whole-slice draw, under every layout.

The reference is a copy of the algorithm the initializers used before chunking: the int64 global
indices of the whole slice, one draw over them, ``* mul (+ add)``, cast to the master dtype, then
to the slice dtype. Both are computed here, per processor slice, and compared bitwise.
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch.ops import initializers, rng

LAYOUTS = [("", ""), ("all:4", ""), ("all:4", "a:all"), ("all:2", "b:all"), ("rows:2;cols:2", "a:rows;b:cols"),
           ("rows:2;cols:2", "b:rows;c:cols")]

INITS = {
    "normal": mtf.random_normal_initializer(0.5, 2.0),
    "truncated": mtf.truncated_normal_initializer(0.0, 1.0),
    "uniform": mtf.random_uniform_initializer(-1.0, 3.0),
    "variance_scaling": mtf.VarianceScalingInitializer(2.0, "fan_avg", "truncated_normal"),
    "glorot": None,
}


def _old_slice(init, shape, master, slice_dtype, seed, key, begin, sizes):
    """The former draw: whole-slice int64 indices, one draw (reference copy of the old algorithm)."""
    draw, mul, add = init.draw_params(shape)
    v = draw(seed, key, rng.global_index(shape.to_integer_list(), begin, sizes)) * mul
    if add is not None:
        v = v + add
    return v.to(master).to(slice_dtype)


def _graph(init, dtype):
    g = mtf.Graph(seed=3)
    mesh = mtf.Mesh(g, "m")
    ws = [mtf.get_variable(mesh, "w", "a:8,b:12,c:6", initializer=init, dtype=dtype),
          mtf.get_variable(mesh, "v", "a:8,b:12", initializer=init, dtype=dtype)]
    return g, mesh, ws


@pytest.mark.parametrize("name", list(INITS))
@pytest.mark.parametrize("dtype", [torch.float32, mtf.VariableDType(torch.float32, torch.bfloat16, torch.float32)])
def test_chunked_draw_bitwise_equals_whole_slice_draw(name, dtype, monkeypatch):
    monkeypatch.setattr(initializers, "DRAW_CHUNK", 64)  # several chunks per slice, a short last one
    init = initializers.convert_initializer(INITS[name])
    for mesh_shape, layout in LAYOUTS:
        g, mesh, ws = _graph(INITS[name], dtype)
        impl = mtf.PlacementMeshImpl(mesh_shape, layout)
        lw = mtf.Lowering(g, {mesh: impl})
        for w in ws:
            var = w.operation if isinstance(w.operation, mtf.Variable) else w.operation.inputs[0].operation
            lay = lw.store.layout(var.name)
            slices = lw.store.values[var.name]
            for p in range(impl.size):
                want = _old_slice(init, var.shape, var.master_dtype, var.slice_dtype, 3, var.name,
                                  impl.slice_begin(var.shape, p, lay), impl.slice_shape(var.shape, lay))
                assert slices[p].dtype == var.slice_dtype
                assert torch.equal(slices[p], want), (name, mesh_shape, layout, var.name, p)


def test_replicas_share_one_drawn_tensor():
    g, mesh, ws = _graph(None, torch.float32)
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("rows:2;cols:2", "a:rows")})
    s = lw.store.values["w"]
    assert s[0] is s[1] and s[2] is s[3] and s[0] is not s[2]


def test_flat_global_index_matches_global_index():
    full, begin, sizes = (6, 10, 4), (2, 5, 0), (3, 4, 4)
    ref = rng.global_index(full, begin, sizes).reshape(-1)
    for start, stop in [(0, 48), (5, 17), (40, 48)]:
        assert torch.equal(rng.flat_global_index(full, begin, sizes, start, stop), ref[start:stop])

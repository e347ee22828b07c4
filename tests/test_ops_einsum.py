"""einsum / matmul: values, gradients and communication under every layout."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase, run_layout

G = torch.Generator().manual_seed(7)
A = torch.randn(4, 8, 12, generator=G)   # [b:4, h:8, k:12]
B = torch.randn(12, 16, generator=G)     # [k:12, o:16]
C = torch.randn(8, 16, generator=G)      # [h:8, o:16]
V = torch.randn(12, generator=G)

OP_CASES = [
    OpCase("matmul", lambda m, a, b: mtf.matmul(a, b), {"a": ("b:4,h:8,k:12", A), "b": ("k:12,o:16", B)},
           lambda a, b: torch.einsum("bhk,ko->bho", a, b)),
    OpCase("einsum_output_shape", lambda m, a, b: mtf.einsum([a, b], output_shape="o:16,b:4"),
           {"a": ("b:4,h:8,k:12", A), "b": ("k:12,o:16", B)}, lambda a, b: torch.einsum("bhk,ko->ob", a, b)),
    OpCase("einsum_three", lambda m, a, b, c: mtf.einsum([a, b, c], output_shape="b:4"),
           {"a": ("b:4,h:8,k:12", A), "b": ("k:12,o:16", B), "c": ("h:8,o:16", C)},
           lambda a, b, c: torch.einsum("bhk,ko,ho->b", a, b, c)),
    OpCase("einsum_single_reduce", lambda m, a: mtf.einsum([a], output_shape="k:12,b:4"),
           {"a": ("b:4,h:8,k:12", A)}, lambda a: a.sum(1).T),
    OpCase("einsum_broadcast_grad", lambda m, a, v: mtf.einsum([a, v], output_shape="b:4,k:12"),
           {"a": ("b:4,h:8,k:12", A), "v": ("k:12", V)}, lambda a, v: a.sum(1) * v),
    OpCase("einsum_reduced_dims", lambda m, a, b: mtf.einsum([a, b], reduced_dims=["k", "h"]),
           {"a": ("b:4,h:8,k:12", A), "b": ("k:12,o:16", B)}, lambda a, b: torch.einsum("bhk,ko->bo", a, b)),
    OpCase("dense_layer", lambda m, a: mtf.layers.dense(a, mtf.Dimension("o", 16), activation=mtf.relu,
                                                        kernel_initializer=mtf.random_normal_initializer()),
           {"a": ("b:4,h:8,k:12", A)},
           # the kernel comes from the counter-based generator; recompute it for the reference
           lambda a: torch.relu(torch.einsum("bhk,ko->bho", a, _dense_kernel()))),
]


def _dense_kernel():
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "m")
    w = mtf.get_variable(mesh, "dense/kernel", "k:12,o:16", initializer=mtf.random_normal_initializer())
    return mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}).variable_value(w)


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    case.check()


def test_output_shape_inference_dims_appearing_once():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    a = mtf.zeros(mesh, "b:4,h:8,k:12")
    b = mtf.zeros(mesh, "k:12,o:16")
    assert mtf.einsum([a, b]).shape == mtf.Shape("b:4,h:8,o:16")


def test_same_mesh_axis_on_different_dims_is_gathered_not_wrong():
    """x[k] and y[c] both split over 'all': a naive local einsum pairs the wrong slices."""
    x = torch.randn(8)
    y = torch.randn(12)
    outs, grads, lw = run_layout(lambda m, x, y: mtf.einsum([x, y], output_shape="c:12"),
                                 {"x": ("k:8", x), "y": ("c:12", y)}, "all:4", "k:all;c:all")
    torch.testing.assert_close(outs[0], x.sum() * y)
    kinds = {c.kind for c, _ in lw.counters.records.items()}
    assert "allgather" in kinds


def test_hybrid_counters_bytes():
    """2x2 'b:rows;o:cols': weight-gradient einsum contracts b -> all-reduce over rows, bytes from shapes."""
    def build(m, a, w):
        return mtf.einsum([a, w], output_shape="b:4,o:16")
    a = torch.randn(4, 12)
    w = torch.randn(12, 16)
    _, grads, lw = run_layout(build, {"a": ("b:4,k:12", a), "w": ("k:12,o:16", w)}, "rows:2;cols:2",
                              "b:rows;o:cols")
    rows = [(c, n) for c, n in lw.counters.records.items() if c.mesh_axes == ("rows",)]
    # d(loss)/dw = einsum(a, dy) over b (split on rows): slice [k:12, o:8] float32 on each of 4 processors
    assert any(c.bytes_per_processor == 12 * 8 * 4 and c.num_processors == 4 for c, _ in rows), rows
    cols = [(c, n) for c, n in lw.counters.records.items() if c.mesh_axes == ("cols",)]
    # d(loss)/da = einsum(dy, w) over o (split on cols): slice [b:2, k:12]
    assert any(c.bytes_per_processor == 2 * 12 * 4 for c, _ in cols), cols


def test_output_dim_missing_from_inputs():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    a = mtf.zeros(mesh, "b:4,h:8")
    with pytest.raises(mtf.ShapeError, match="'q'.*appears in no input"):
        mtf.einsum([a], output_shape="b:4,q:3")


def test_one_name_two_sizes_in_einsum():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    a = mtf.zeros(mesh, "b:4,h:8")
    b = mtf.zeros(mesh, "h:6,o:2")
    with pytest.raises(mtf.ShapeError, match="'h'"):
        mtf.einsum([a, b])

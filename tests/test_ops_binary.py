"""Binary ops with broadcasting by name: values and gradients under every layout vs PyTorch."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase

G = torch.Generator().manual_seed(3)
X = torch.randn(4, 8, generator=G)          # [b:4, h:8]
Y = torch.randn(8, 4, generator=G)          # [h:8, b:4]  (same dims, other order)
V = torch.randn(8, generator=G)             # [h:8]
W = torch.randn(12, generator=G)            # [k:12]
POS = torch.rand(8, 12, generator=G) + 0.5  # [h:8, k:12]


def _case(name, op, ref, inputs, grad=True):
    return OpCase(name, op, inputs, ref, grad=grad)


_XV = {"x": ("b:4,h:8", X), "v": ("h:8", V)}
_XY = {"x": ("b:4,h:8", X), "y": ("h:8,b:4", Y)}
_OUTER = {"v": ("h:8", V), "w": ("k:12", W)}

OP_CASES = [
    _case("add_broadcast", lambda m, x, v: x + v, lambda x, v: x + v, _XV),
    _case("add_transposed", lambda m, x, y: mtf.add(x, y), lambda x, y: x + y.T, _XY),
    _case("sub_broadcast_left", lambda m, x, v: v - x, lambda x, v: (v - x).T, _XV),  # [h, b]: v first
    _case("mul_outer", lambda m, v, w: v * w, lambda v, w: v[:, None] * w[None, :], _OUTER),
    _case("div", lambda m, x, p: x / p, lambda x, p: x[:, :, None] / p[None], {"x": ("b:4,h:8", X),
                                                                                "p": ("h:8,k:12", POS)}),
    _case("div_output_shape", lambda m, x, p: mtf.divide(x, p, output_shape="k:12,h:8,b:4"),
          lambda x, p: (x[:, :, None] / p[None]).permute(2, 1, 0), {"x": ("b:4,h:8", X), "p": ("h:8,k:12", POS)}),
    _case("minimum", lambda m, x, y: mtf.minimum(x, y), lambda x, y: torch.minimum(x, y.T), _XY),
    _case("maximum_broadcast", lambda m, x, v: mtf.maximum(x, v), lambda x, v: torch.maximum(x, v), _XV),
    _case("maximum_ties", lambda m, x: mtf.maximum(x, x * 1.0), lambda x: torch.maximum(x, x * 1.0),
          {"x": ("b:4,h:8", X)}),
    _case("scalar_left_ops", lambda m, x: 1.0 - x + 2.0 * x / 3.0, lambda x: 1.0 - x + 2.0 * x / 3.0,
          {"x": ("b:4,h:8", X)}),
    # regression: with a Python scalar operand, output_shape used to be ignored silently
    _case("scalar_right_output_shape", lambda m, x: mtf.multiply(x, 3.0, output_shape="h:8,b:4"),
          lambda x: 3.0 * x.T, {"x": ("b:4,h:8", X)}),
    _case("scalar_left_output_shape", lambda m, x: mtf.subtract(2.0, x, output_shape="h:8,b:4"),
          lambda x: (2.0 - x).T, {"x": ("b:4,h:8", X)}),
]
for _n, _f, _t in [("equal", mtf.equal, torch.eq), ("not_equal", mtf.not_equal, torch.ne),
                   ("less", mtf.less, torch.lt), ("less_equal", mtf.less_equal, torch.le),
                   ("greater", mtf.greater, torch.gt), ("greater_equal", mtf.greater_equal, torch.ge)]:
    OP_CASES.append(_case(_n, lambda m, x, v, f=_f: f(x, mtf.relu(v)), lambda x, v, t=_t: t(x, torch.relu(v)),
                          _XV, grad=False))
OP_CASES.append(_case("logical_and", lambda m, x, v: mtf.logical_and(mtf.greater(x, 0.0), mtf.less(v, 0.5)),
                      lambda x, v: (x > 0) & (v < 0.5), _XV, grad=False))


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    case.check()


def test_sum_of_partial_sums_costs_one_allreduce():
    """Deferred all-reduce: einsum(a) + einsum(b), both contracting a split dim, is one all-reduce."""
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    b, k = mtf.Dimension("b", 4), mtf.Dimension("k", 8)
    x = mtf.import_tensor(mesh, torch.randn(4, 8), [b, k])
    y = mtf.import_tensor(mesh, torch.randn(4, 8), [b, k])
    w = mtf.import_tensor(mesh, torch.randn(8), [k])
    s = mtf.einsum([x, w], output_shape=[b]) + mtf.einsum([y, w], output_shape=[b]) * 2.0
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:4", "k:all")})
    out = lw.run(s)
    c = lw.counters.collectives(kind="allreduce")
    assert len(c) == 1 and c[0][1] == 1
    ref = x.operation.value @ w.operation.value + 2.0 * (y.operation.value @ w.operation.value)
    torch.testing.assert_close(out, ref)


def test_mismatched_sizes_rejected_naming_dimension():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    a = mtf.zeros(mesh, "b:4,h:8")
    c = mtf.zeros(mesh, "h:6")
    with pytest.raises(mtf.ShapeError, match="'h'.*8.*6"):
        a + c


def test_dtype_mismatch_rejected():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    with pytest.raises(TypeError, match="cast"):
        mtf.zeros(mesh, "h:8") + mtf.zeros(mesh, "h:8", dtype=torch.float64)

"""The two-operand einsum fast path (one mm/bmm) against torch.einsum, and under layouts."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.ops.einsum import _matmul_fn
from meshtorch.testing import OpCase

SIZES = {"a": 2, "b": 3, "c": 4, "d": 5, "e": 1}
EQUATIONS = [
    ("ab", "bc", "ac"), ("ab", "acd", "cdb"), ("abc", "bcd", "ad"), ("ab", "ab", ""), ("ab", "cd", "abcd"),
    ("ab", "cd", "cadb"), ("abc", "acd", "abd"), ("abc", "acd", "dba"), ("bac", "cad", "bd"), ("a", "a", "a"),
    ("ab", "b", "a"), ("ae", "eb", "ab"), ("", "ab", "ab"), ("ab", "abc", "cab"), ("abc", "cb", "ca"),
]


@pytest.mark.parametrize("eq", EQUATIONS, ids=["{},{}->{}".format(*e) for e in EQUATIONS])
def test_matmul_path_equals_torch_einsum(eq):
    a_names, b_names, out_names = eq
    g = torch.Generator().manual_seed(len(a_names) * 7 + len(b_names))
    a = torch.randn([SIZES[c] for c in a_names], generator=g, dtype=torch.float64)
    b = torch.randn([SIZES[c] for c in b_names], generator=g, dtype=torch.float64)
    f = _matmul_fn(list(a_names), list(b_names), list(out_names))
    assert f is not None
    ref = torch.einsum(f"{a_names},{b_names}->{out_names}", a, b)
    out = f(a, b)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_single_operand_sums_fall_back():
    assert _matmul_fn(["a", "b"], ["b", "c"], ["a"]) is None  # c is summed inside b alone


OP_CASES = [
    OpCase("weight_grad_order",  # [batch, hidden] x [batch, rows, cols] -> [rows, cols, hidden]
           lambda mesh, dy, x: mtf.einsum([dy, x], output_shape="r:2,c:4,h:8"),
           {"dy": ("b:4,h:8", torch.randn(4, 8, generator=torch.Generator().manual_seed(1))),
            "x": ("b:4,r:2,c:4", torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(2)))},
           lambda dy, x: torch.einsum("bh,brc->rch", dy, x)),
    OpCase("batched_swap",  # batch dim kept, output order right-then-left
           lambda mesh, x, y: mtf.einsum([x, y], output_shape="b:4,c:4,h:8"),
           {"x": ("b:4,h:8,k:2", torch.randn(4, 8, 2, generator=torch.Generator().manual_seed(3))),
            "y": ("k:2,b:4,c:4", torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(4)))},
           lambda x, y: torch.einsum("bhk,kbc->bch", x, y)),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert any(m == "rows:2;cols:2" for m, _ in layouts)

"""Reductions with Mesh TF's names (ops/reduce_more.py) and extra_logit: every layout vs PyTorch."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _lse_extra(x, extra, dim):
    return torch.logsumexp(torch.cat([x, extra.expand(*x.shape[:dim], 1, *x.shape[dim + 1:])], dim), dim)


OP_CASES = [
    OpCase("reduce_all", lambda mesh, x: mtf.reduce_all(mtf.greater(x, -1.0), reduced_dim="h"),
           {"x": ("b:4,h:8", _x(4, 8))}, lambda x: (x > -1.0).all(1), grad=False),
    OpCase("reduce_any_output_shape", lambda mesh, x: mtf.reduce_any(mtf.greater(x, 1.0), output_shape="h:8"),
           {"x": ("b:4,h:8", _x(4, 8))}, lambda x: (x > 1.0).any(0), grad=False),
    OpCase("reduce_first", lambda mesh, x: mtf.reduce_first(x, mtf.Dimension("h", 8)),
           {"x": ("b:4,h:8", _x(4, 8))}, lambda x: x[:, 0]),
    OpCase("nth_smallest_element", lambda mesh, x: mtf.nth_smallest_element(x, 2, "h"),
           {"x": ("b:4,h:8", _x(4, 8))}, lambda x: x.sort(1).values[:, 2]),
    OpCase("pool_tensor_1d_mean", lambda mesh, x: mtf.pool_tensor_1d(x, mtf.Dimension("l", 8), pool_size=2),
           {"x": ("b:4,l:8", _x(4, 8))}, lambda x: x.reshape(4, 4, 2).mean(2)),
    OpCase("pool_tensor_1d_max", lambda mesh, x: mtf.pool_tensor_1d(x, mtf.Dimension("l", 8), mtf.reduce_max, 4),
           {"x": ("b:4,l:8", _x(4, 8))}, lambda x: x.reshape(4, 2, 4).amax(2)),
    OpCase("stride_tensor_1d", lambda mesh, x: mtf.stride_tensor_1d(x, mtf.Dimension("l", 8), pool_size=2),
           {"x": ("b:4,l:8", _x(4, 8))}, lambda x: x[:, ::2]),
    OpCase("reduce_logsumexp_extra_logit", lambda mesh, x: mtf.reduce_logsumexp(x, "h", extra_logit=0.5),
           {"x": ("b:4,h:8", _x(4, 8))}, lambda x: _lse_extra(x, torch.tensor(0.5), 1)),
    OpCase("log_softmax_extra_logit_tensor", lambda mesh, x, e: mtf.log_softmax(x, "h", extra_logit=e),
           {"x": ("b:4,h:8", _x(4, 8)), "e": ("b:4", _x(4, seed=1))},
           lambda x, e: x - _lse_extra(x, e[:, None], 1)[:, None]),
    OpCase("softmax_extra_logit", lambda mesh, x: mtf.softmax(x, "h", extra_logit=0.0),
           {"x": ("b:4,h:8", _x(4, 8))}, lambda x: torch.exp(x - _lse_extra(x, torch.tensor(0.0), 1)[:, None])),
    OpCase("reduce_sum_mesh_tf_keywords", lambda mesh, x: mtf.reduce_sum(x, output_shape="h:8"),
           {"x": ("b:4,h:8", _x(4, 8))}, lambda x: x.sum(0)),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    layouts = case.check()
    assert any(m == "rows:2;cols:2" for m, _ in layouts)


def test_reduction_fn_strings():
    t = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    assert torch.equal(mtf.reduction_fn("MAX")(t, 1), torch.tensor([5.0, 3.0]))
    assert torch.equal(mtf.reduction_fn("SUM")(t, 0), torch.tensor([4.0, 7.0]))
    assert torch.equal(mtf.binary_reduction_fn("MIN")(t[0], t[1]), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="PROD"):
        mtf.reduction_fn("PROD")


def test_reduce_dim_given_twice_is_an_error():
    x = mtf.zeros(mtf.Mesh(mtf.Graph()), "b:4,h:8")
    with pytest.raises(ValueError, match="twice"):
        mtf.reduce_sum(x, "h", reduced_dim="b")

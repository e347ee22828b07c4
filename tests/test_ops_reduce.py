"""Reductions, softmax, cross-entropy: values and gradients under every layout vs PyTorch."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase

G = torch.Generator().manual_seed(5)
X = torch.randn(4, 8, 12, generator=G)  # [b:4, h:8, k:12]
S3 = "b:4,h:8,k:12"
IN = {"x": (S3, X)}


def _c(name, op, ref, inputs=IN, grad=True):
    return OpCase(name, lambda m, x: op(x), inputs, lambda x: ref(x), grad=grad)


OP_CASES = [
    _c("reduce_sum_all", mtf.reduce_sum, torch.sum),
    _c("reduce_sum_dim", lambda x: mtf.reduce_sum(x, reduced_dim=mtf.Dimension("h", 8)), lambda x: x.sum(1)),
    _c("reduce_sum_two_dims", lambda x: mtf.reduce_sum(x, reduced_dim=["b", "k"]), lambda x: x.sum((0, 2))),
    _c("reduce_sum_output_shape_reordered", lambda x: mtf.reduce_sum(x, output_shape="k:12,b:4"),
       lambda x: x.sum(1).T),
    _c("reduce_mean", lambda x: mtf.reduce_mean(x, reduced_dim="k"), lambda x: x.mean(2)),
    _c("reduce_mean_all", mtf.reduce_mean, torch.mean),
    _c("reduce_max", lambda x: mtf.reduce_max(x, reduced_dim="h"), lambda x: x.amax(1)),
    _c("reduce_min", lambda x: mtf.reduce_min(x, output_shape="h:8"), lambda x: x.amin((0, 2))),
    _c("reduce_logsumexp", lambda x: mtf.reduce_logsumexp(x, "k"), lambda x: torch.logsumexp(x, 2)),
    _c("softmax", lambda x: mtf.softmax(x, "h"), lambda x: torch.softmax(x, 1)),
    _c("log_softmax", lambda x: mtf.log_softmax(x, "k"), lambda x: torch.log_softmax(x, 2)),
    _c("transpose_via_reduce", lambda x: mtf.reduce_sum(x, output_shape="k:12,h:8,b:4"),
       lambda x: x.permute(2, 1, 0)),
]

_LOGITS = torch.randn(8, 12, generator=G)
_LABELS = torch.randint(0, 12, (8,), generator=G)


def _xent(m, logits, labels):
    k = logits.shape.get_dim_by_name("k")
    return mtf.layers.softmax_cross_entropy_with_logits(logits, mtf.one_hot(labels, k), k)


OP_CASES += [
    OpCase("softmax_cross_entropy", _xent, {"logits": ("b:8,k:12", _LOGITS), "labels": ("b:8", _LABELS)},
           lambda logits, labels: torch.nn.functional.cross_entropy(logits, labels, reduction="none")),
    OpCase("softmax_cross_entropy_z_loss",
           lambda m, logits, labels: mtf.layers.softmax_cross_entropy_with_logits(
               logits, mtf.one_hot(labels, logits.shape[1]), "k", z_loss=1e-2),
           {"logits": ("b:8,k:12", _LOGITS), "labels": ("b:8", _LABELS)},
           lambda logits, labels: torch.nn.functional.cross_entropy(logits, labels, reduction="none")
           + 1e-2 * torch.logsumexp(logits, 1) ** 2),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    case.check()


def test_reduce_unknown_dim_names_tensor():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    x = mtf.zeros(mesh, "b:4,h:8", name="acts")
    with pytest.raises(mtf.ShapeError, match="acts.*'q'"):
        mtf.reduce_sum(x, reduced_dim="q")

"""sparse_softmax_cross_entropy_with_logits: values and gradients under every layout (vocab split included:
its max / sum all-reduces) vs ``torch.nn.functional.cross_entropy(reduction="none")`` on full tensors."""

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mtf
from meshtorch.testing import OpCase

G = torch.Generator().manual_seed(21)
LOGITS = torch.randn(4, 6, 8, generator=G) * 3
TARGETS = torch.randint(0, 8, (4, 6), generator=G)
BAD = TARGETS.clone()
BAD[0, 0], BAD[1, 3], BAD[2, 5] = -1, 8, 100  # outside [0, vocab): loss 0, no gradient (ignore_index)


def _ref(logits, targets):
    return F.cross_entropy(logits.permute(0, 2, 1), targets, reduction="none")


def _ref_ignore(logits, targets):
    t = torch.where((targets >= 0) & (targets < 8), targets, torch.full_like(targets, -100))
    return F.cross_entropy(logits.permute(0, 2, 1), t, reduction="none", ignore_index=-100)


def _sparse(m, logits, targets, **kw):
    return mtf.sparse_softmax_cross_entropy_with_logits(logits, targets, "vocab", **kw)


INPUTS = {"logits": ("b:4,length:6,vocab:8", LOGITS), "targets": ("b:4,length:6", TARGETS)}

OP_CASES = [
    OpCase("sparse_xent_vocab_last", _sparse, INPUTS, _ref),
    OpCase("sparse_xent_vocab_first_targets_transposed", _sparse,
           {"logits": ("vocab:8,b:4,length:6", LOGITS.permute(2, 0, 1).contiguous()),
            "targets": ("length:6,b:4", TARGETS.T.contiguous())},
           lambda logits, targets: _ref(logits.permute(1, 2, 0), targets.T)),
    OpCase("sparse_xent_out_of_range_targets_ignored", _sparse,
           {"logits": ("b:4,length:6,vocab:8", LOGITS), "targets": ("b:4,length:6", BAD)}, _ref_ignore),
    OpCase("sparse_xent_z_loss", lambda m, logits, targets: _sparse(m, logits, targets, z_loss=1e-2), INPUTS,
           lambda logits, targets: _ref(logits, targets) + 1e-2 * torch.logsumexp(logits, -1) ** 2),
    OpCase("layers_xent_integer_targets_is_sparse",
           lambda m, logits, targets: mtf.reduce_mean(mtf.layers.softmax_cross_entropy_with_logits(
               logits, targets, "vocab")), INPUTS, lambda logits, targets: _ref(logits, targets).mean()),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c.name for c in OP_CASES])
def test_layout_invariance(case):
    case.check()


def test_integer_targets_build_no_one_hot():
    g = mtf.Graph()
    m = mtf.Mesh(g)
    logits = mtf.placeholder(m, "logits", "b:4,vocab:8")
    mtf.layers.softmax_cross_entropy_with_logits(logits, mtf.placeholder(m, "t", "b:4", dtype=torch.int64), "vocab")
    assert not any(isinstance(op, mtf.ops.indexing.OneHotOperation) for op in g.operations)


def test_errors_name_the_tensor_and_dim():
    g = mtf.Graph()
    m = mtf.Mesh(g)
    logits = mtf.placeholder(m, "logits", "b:4,vocab:8")
    with pytest.raises(mtf.ShapeError, match="'t'.*vocab"):
        mtf.sparse_softmax_cross_entropy_with_logits(logits, mtf.placeholder(m, "t", "c:4", dtype=torch.int64),
                                                     "vocab")
    with pytest.raises(mtf.ShapeError, match="no dimension 'classes'"):
        mtf.sparse_softmax_cross_entropy_with_logits(logits, mtf.placeholder(m, "u", "b:4", dtype=torch.int64),
                                                     "classes")
    with pytest.raises(TypeError, match="'s'.*integer"):
        mtf.sparse_softmax_cross_entropy_with_logits(logits, mtf.placeholder(m, "s", "b:4"), "vocab")

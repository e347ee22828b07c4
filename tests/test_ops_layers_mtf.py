"""Mesh TF ``mtf.layers`` functions the transformer package needs, under every layout vs plain PyTorch.

softmax_cross_entropy_with_logits with integer (hard) and soft targets and z-loss,
attention_mask_autoregressive / ignore_padding / same_segment, weights_nonzero, embedding; and
``mtf.variable_scope`` naming (Mesh TF 0.1.21 ``layers.py`` and TF1 variable-scope semantics).
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import OpCase

G = torch.Generator().manual_seed(7)
LOGITS = torch.randn(4, 6, 8, generator=G)                      # [b:4, length:6, vocab:8]
HARD = torch.randint(0, 8, (4, 6), generator=G)                 # class ids
SOFT = torch.rand(4, 6, 8, generator=G)                         # soft targets NOT summing to 1
IDS = torch.randint(0, 3, (4, 6), generator=G)                  # ids with zeros (padding)
SEG = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1], [2, 2, 1, 1, 0, 0]])
MEMSEG = torch.tensor([[1, 2, 2, 0], [3, 3, 1, 0], [1, 1, 1, 1], [2, 1, 0, 0]])
POS = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2], [3, 2, 1, 0, 5, 4], [0, 0, 1, 1, 2, 2]])
X = torch.randn(4, 6, 12, generator=G)                          # [b:4, length:6, d_model:12]


def _xent_ref(logits, targets, z_loss):
    """Mesh TF: -sum(targets * (logits - logsumexp)) + z_loss * logsumexp^2 (literally, for soft targets too)."""
    lse = torch.logsumexp(logits, -1)
    return -(targets * (logits - lse[..., None])).sum(-1) + z_loss * lse ** 2


def _embedding_table():
    """The table ``mtf.layers.embedding`` creates (counter-based initial values: the same for any layout)."""
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "mesh")
    mtf.layers.embedding_weights(mesh, mtf.Dimension("vocab", 3), mtf.Dimension("d_model", 12), torch.float32)
    return mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("", "")}).variable_value("embedding")


TABLE = _embedding_table()


def _embed_build(m, ids, x):
    return mtf.layers.embedding(ids, mtf.Dimension("vocab", 3), mtf.Dimension("d_model", 12), torch.float32) * x


OP_CASES = [
    OpCase("xent_integer_targets_z_loss",
           lambda m, logits, targets: mtf.layers.softmax_cross_entropy_with_logits(
               logits, targets, mtf.Dimension("vocab", 8), z_loss=1e-2),
           {"logits": ("b:4,length:6,vocab:8", LOGITS), "targets": ("b:4,length:6", HARD)},
           lambda logits, targets: _xent_ref(logits, torch.nn.functional.one_hot(targets, 8).float(), 1e-2)),
    OpCase("xent_soft_targets_not_normalised",
           lambda m, logits, targets: mtf.layers.softmax_cross_entropy_with_logits(logits, targets, "vocab"),
           {"logits": ("b:4,length:6,vocab:8", LOGITS), "targets": ("b:4,length:6,vocab:8", SOFT)},
           lambda logits, targets: _xent_ref(logits, targets, 0.0)),
    OpCase("attention_mask_autoregressive",
           lambda m, pos: mtf.layers.attention_mask_autoregressive(pos),
           {"pos": ("b:4,length:6", POS)},
           lambda pos: (pos[:, :, None] < pos[:, None, :]).float() * -1e9, grad=False),
    OpCase("attention_mask_ignore_padding",
           lambda m, ids: mtf.layers.attention_mask_ignore_padding(ids),
           {"ids": ("b:4,length:6", IDS)},
           lambda ids: (ids == 0).float() * -1e9, grad=False),
    OpCase("attention_mask_same_segment_self",
           lambda m, seg: mtf.layers.attention_mask_same_segment(seg),
           {"seg": ("b:4,length:6", SEG)},
           lambda seg: (seg[:, :, None] != seg[:, None, :]).float() * -1e9, grad=False),
    OpCase("attention_mask_same_segment_memory",
           lambda m, seg, mem: mtf.layers.attention_mask_same_segment(seg, mtf.rename_dimension(mem, "mlen", "length")),
           {"seg": ("b:4,length:6", SEG), "mem": ("b:4,mlen:4", MEMSEG)},
           lambda seg, mem: (seg[:, :, None] != mem[:, None, :]).float() * -1e9, grad=False),
    OpCase("weights_nonzero",
           lambda m, ids: mtf.layers.weights_nonzero(ids),
           {"ids": ("b:4,length:6", IDS)},
           lambda ids: (ids != 0).float(), grad=False),
    OpCase("embedding_lookup", _embed_build,
           {"ids": ("b:4,length:6", IDS), "x": ("b:4,length:6,d_model:12", X)},
           lambda ids, x: TABLE[ids] * x),
]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.name)
def test_layout_invariance(case):
    case.check()


def test_cross_entropy_errors_name_the_dims():
    g = mtf.Graph()
    m = mtf.Mesh(g)
    logits = mtf.placeholder(m, "logits", "b:4,vocab:8")
    with pytest.raises(mtf.ShapeError, match="hard .integer. targets"):
        mtf.layers.softmax_cross_entropy_with_logits(logits, mtf.placeholder(m, "t", "c:4", dtype=torch.int64),
                                                     "vocab")
    with pytest.raises(mtf.ShapeError, match="soft targets"):
        mtf.layers.softmax_cross_entropy_with_logits(logits, mtf.placeholder(m, "s", "b:4,c:8"), "vocab")
    with pytest.raises(mtf.ShapeError, match="no dimension 'classes'"):
        mtf.layers.softmax_cross_entropy_with_logits(logits, mtf.placeholder(m, "u", "b:4", dtype=torch.int64),
                                                     "classes")


def test_variable_scope_names_like_tf1():
    g = mtf.Graph()
    m = mtf.Mesh(g)
    with mtf.variable_scope("transformer"):
        assert mtf.get_variable_scope().name == "transformer"
        with mtf.variable_scope("block_000/layer_000"):
            with mtf.variable_scope("SelfAttention"):
                q = mtf.get_variable(m, "q", "d_model:4,heads:8")
        with mtf.variable_scope(None, default_name="dense"):
            mtf.get_variable(m, "kernel", "d:4")
        with mtf.variable_scope(None, default_name="dense") as scope:
            mtf.get_variable(m, "kernel", "d:4")
        with mtf.name_scope("ignored_for_variables"):
            mtf.get_variable(m, "bias", "d:4")
    with mtf.variable_scope(scope):  # a captured scope is re-entered by its full name
        again = mtf.get_variable(m, "kernel", "d:4")
    assert mtf.get_variable_scope().name == ""
    assert [v.name for v in g.all_variables] == [
        "transformer/block_000/layer_000/SelfAttention/q", "transformer/dense/kernel", "transformer/dense_1/kernel",
        "transformer/bias"]
    assert again is g.name_to_variable["transformer/dense_1/kernel"].outputs[0]
    with mtf.variable_scope("transformer/block_000/layer_000/SelfAttention", reuse=True):
        assert mtf.get_variable(m, "q", "d_model:4,heads:8") is q  # Mesh TF returns the existing variable
        with pytest.raises(mtf.ShapeError, match="exists with shape"):
            mtf.get_variable(m, "q", "d_model:4,heads:4")
    with pytest.raises(ValueError, match="default_name"):
        with mtf.variable_scope(None):
            pass

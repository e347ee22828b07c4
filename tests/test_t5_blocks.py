"""T5 on the one block builder (:mod:`meshtorch.models.hf_t5`): padded inputs and targets against ``transformers``
(``attention_mask`` / ``decoder_attention_mask`` = ids != 0) under 1 processor and the 2x2 Megatron layout, so the
padding masks, the relative bias's buckets and the encoder-decoder attention are checked where the existing T5 tests
(unpadded batches) cannot see them; and the builder's T5 options refuse what they cannot build."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.core.dims import Dimension  # noqa: E402
from meshtorch.core.graph import Graph, Mesh  # noqa: E402
from meshtorch.models.blocks import HF_NAMES, Attend, BlockSpec, RelativeBias, block  # noqa: E402
from meshtorch.ops.variables import placeholder  # noqa: E402
from meshtorch.testing import rel_error  # noqa: E402

B, L = 4, 12
LAYOUTS = [("", ""), ("data:2;model:2", "batch:data;heads:model;d_ff:model;vocab:model")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    m = F.make_t5()
    with torch.no_grad():  # larger weights: attention far from uniform, so a wrong mask moves the logits
        for p in m.parameters():
            p.mul_(2.0)
    return m, F.save_t5(m, str(tmp_path_factory.mktemp("t5") / "t5"))


def _padded(seed: int, ends: list[int]) -> torch.Tensor:
    x = F.t5_batch(B, L, seed=seed)
    for row, end in enumerate(ends):
        x[row, end:] = 0
    return x


@pytest.mark.parametrize("mesh,layout", LAYOUTS, ids=["1proc", "2x2"])
def test_padded_t5_logits_and_loss_match_transformers(saved, mesh, layout):
    ref, path = saved
    x, y = _padded(1, [L, 7, 3, 10]), _padded(2, [9, L, 5, 2])
    dec_in = torch.cat([torch.zeros(B, 1, dtype=y.dtype), y[:, :-1]], dim=1)
    with torch.no_grad():
        want = ref(input_ids=x, attention_mask=(x != 0).long(), decoder_input_ids=dec_in,
                   decoder_attention_mask=(dec_in != 0).long() | (torch.arange(L) == 0).long()).logits
    model, lw = hf.load(path, mtf.PlacementMeshImpl(mesh, layout), batch_size=B, length=L)
    logits, loss = lw.run([model.logits, model.loss], feeds={model.inputs: x, model.targets: y})
    keep = y != 0
    assert rel_error(logits[keep], want[keep]) <= 1e-5
    xent = torch.nn.functional.cross_entropy(want[keep], y[keep], reduction="sum") / (B * L)
    assert abs(loss.item() - xent.item()) <= 1e-5 * xent.item()


def test_t5_options_refuse_what_they_cannot_build():
    graph = Graph()
    mesh = Mesh(graph, "mesh")
    d = {n: Dimension(n, s) for n, s in (("batch", 2), ("length", 4), ("d_model", 8), ("heads", 2), ("d_kv", 4),
                                         ("d_ff", 8))}
    x = placeholder(mesh, "x", [d["batch"], d["length"], d["d_model"]])
    rotary_t5 = BlockSpec(HF_NAMES, rope_theta=10000.0, combined_heads=True)
    with pytest.raises(ValueError, match="combined_heads / Attend attention is T5's"):
        block(x, d, rotary_t5, "a/", Attend([]))
    relative = BlockSpec(HF_NAMES, relative=RelativeBias("table"))
    with pytest.raises(ValueError, match="combined_heads / Attend attention is T5's"):
        block(x, d, relative, "c/")  # the causal FullSequence has no relative bias
    with pytest.raises(ValueError, match="a relative bias needs keys on a dim other than 'length'"):
        block(x, d, relative, "b/", Attend([], memory_length="length"))

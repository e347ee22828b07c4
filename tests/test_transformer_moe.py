"""``transformer.moe.MoE1D`` in a Unitransformer: Mesh TF's variable names, layout invariance, the loss_coef term.

The routing math itself is checked against plain PyTorch in ``test_moe.py``; here the adapter:
names, shapes, the balancing loss added with ``loss_coef``, and the same loss and gradients under
expert-parallel layouts.
"""

import pytest
import torch

import meshtorch as mtf
from meshtorch.testing import rel_error
from meshtorch.transformer import moe, transformer, transformer_layers

B, L, D, V = 4, 8, 32, 128


def build(loss_coef=1e-2):
    graph = mtf.Graph(seed=2)
    mesh = mtf.Mesh(graph, "m")
    targets = mtf.placeholder(mesh, "targets", [mtf.Dimension("batch", B), mtf.Dimension("length", L)],
                              dtype=torch.int32)
    layers = [[transformer_layers.SelfAttention, {"num_heads": 2, "key_value_size": 8}],
              [moe.MoE1D, {"num_experts": 4, "hidden_size": 16, "loss_coef": loss_coef, "second_policy_train": "all",
                           "second_policy_eval": "all"}]]
    model = transformer.Unitransformer(layer_stack=transformer.make_layer_stack(layers, num_layers=1), d_model=D,
                                       input_vocab_size=V, output_vocab_size=V, autoregressive=True, max_length=L)
    _, loss = model.call_simple(transformer.autoregressive_inputs(targets), targets, True, mode="train")
    variables = graph.trainable_variables
    return graph, mesh, targets, loss, variables, mtf.gradients([loss], [v.outputs[0] for v in variables])


T = torch.randint(1, V, (B, L), generator=torch.Generator().manual_seed(0), dtype=torch.int32)


def test_names_and_shapes():
    graph, *_ = build()
    got = {v.name: [(d.name, d.size) for d in v.shape] for v in graph.all_variables if "MoE1D" in v.name}
    pre = "transformer/block_000/layer_001/MoE1D"
    assert got == {f"{pre}/top_2_gating/kernel": [("d_model", D), ("experts_unsplit", 4)],
                   f"{pre}/wi/kernel": [("experts", 4), ("d_model", D), ("expert_hidden", 16)],
                   f"{pre}/wo/kernel": [("experts", 4), ("expert_hidden", 16), ("d_model", D)]}
    assert "transformer/logits/kernel" in {v.name for v in graph.all_variables}  # not shared: Mesh TF's default


def test_same_loss_and_gradients_under_expert_parallel_layouts():
    ref = None
    for mesh_shape, layout in [("", ""), ("all:4", "batch:all;experts:all"), ("rows:2;cols:2",
                                                                             "batch:rows;experts:cols;heads:cols")]:
        graph, mesh, targets, loss, variables, grads = build()
        out = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}).run([loss] + grads,
                                                                                         feeds={targets: T})
        if ref is None:
            ref = out
            continue
        for i, (a, b) in enumerate(zip(out, ref, strict=True)):
            assert rel_error(a, b) <= 1e-5, f"{layout}: output {i}"


def test_balancing_loss_is_added_with_loss_coef():
    def loss_at(coef):
        graph, mesh, targets, loss, *_ = build(coef)
        return mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl("", "")}).run([loss], feeds={targets: T})[0].item()
    base, half, one = loss_at(0.0), loss_at(0.5), loss_at(1.0)
    assert one - base > 0.1  # the balancing loss is >= 1 for top-2 gating (about 1 when balanced)
    assert abs((one - base) - 2 * (half - base)) <= 1e-5


def test_unported_options_raise():
    with pytest.raises(NotImplementedError, match="moe_gating"):
        moe.MoE1D(moe_gating="switch", second_policy_train="all", second_policy_eval="all")
    with pytest.warns(UserWarning, match="random"):
        moe.MoE1D()

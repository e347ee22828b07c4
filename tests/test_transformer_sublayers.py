"""LayerStack sublayers other than the defaults: sublayer_true_layer_norm (Mesh TF's mtf.layers.layer_norm names)
and sublayer_dropout in training, in the ported LM of test_transformer_port."""

import functools

import torch

import meshtorch as mtf
from meshtorch.testing import rel_error
from meshtorch.transformer import transformer
from test_transformer_port import LAYOUTS, build, data, reference

LN = "true_layer_norm/layer_prepostprocess/layer_norm"


def _layer_norm(p, scope, x):
    """mtf.layers.layer_norm: (x - mean) * rsqrt(var + 1e-6) * scale + bias over d_model."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    scale, bias = p[f"{scope}/{LN}/layer_norm_scale"], p[f"{scope}/{LN}/layer_norm_bias"]
    return (x - mean) * torch.rsqrt(var + 1e-6) * scale + bias


def test_true_layer_norm_sublayers():
    stack = dict(sublayers_per_layer=[transformer.sublayer_true_layer_norm, transformer.sublayer_call_layer,
                                      transformer.sublayer_dropout, transformer.sublayer_residual],
                 sublayers_final=[transformer.sublayer_true_layer_norm, transformer.sublayer_dropout])
    graph, mesh, targets, logits, loss, variables, grads, _ = build(layer_stack_kwargs=stack)
    names = {v.name for v in variables}
    assert "transformer/block_000/layer_001/" + LN + "/layer_norm_bias" in names
    assert "transformer/" + LN + "/layer_norm_scale" in names and not any("rms_norm" in n for n in names)
    for mesh_shape, layout in (LAYOUTS[0], LAYOUTS[3]):
        graph, mesh, targets, logits, loss, variables, grads, _ = build(layer_stack_kwargs=stack)
        lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
        out = lw.run([logits, loss] + grads, feeds={targets: data()})
        params = {v.name: lw.variable_value(v.name).to(torch.float64).requires_grad_(True) for v in variables}
        ref_logits, ref_loss = reference(params, data(), norm=_layer_norm)
        assert rel_error(out[0], ref_logits) <= 1e-5 and rel_error(out[1], ref_loss) <= 1e-5
        for v, g, r in zip(variables, out[2:], torch.autograd.grad(ref_loss, list(params.values())), strict=True):
            assert rel_error(g, r) <= 1e-5, f"{layout}: {v.name}"


def test_dropout_sublayer_only_in_training_and_layout_independent():
    drop = functools.partial(transformer.sublayer_dropout, dropout_rate=0.5)
    stack = dict(sublayers_initial=[drop],
                 sublayers_per_layer=[transformer.sublayer_rms_norm, transformer.sublayer_call_layer, drop,
                                      transformer.sublayer_residual])
    losses = {}
    for mode in ("train", "eval"):
        for mesh_shape, layout in (LAYOUTS[0], LAYOUTS[3]):
            graph, mesh, targets, logits, loss, variables, grads, _ = build(layer_stack_kwargs=stack, mode=mode)
            lw = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)})
            losses[mode, layout] = lw.run([loss], feeds={targets: data()})[0]
            params = {v.name: lw.variable_value(v.name).to(torch.float64) for v in variables}
    train, evaluate = losses["train", ""], losses["eval", ""]
    assert rel_error(losses["train", LAYOUTS[3][1]], train) <= 1e-5  # the same dropout masks under every layout
    assert rel_error(evaluate, reference(params, data(), train=False)[1]) <= 1e-5  # no dropout (and no z-loss)
    assert abs(train.item() - reference(params, data())[1].item()) > 1e-3  # dropout changed the training loss

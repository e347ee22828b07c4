"""T5 under a pipeline layout (``stage:pipe``, issue 30): the encoder's blocks then the decoder's run as 2-stage
pipelines over the same ``stage`` dim, each decoder block reading its microbatch's encoder output and masks
(Megatron-LM's T5 pipeline). Against the unpipelined T5 on the same batch (loss and every gradient, 1e-6) and,
from the command line, against ``transformers`` + AdamW (the losses of ``test_hf_t5_train``'s reference)."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.autodiff import gradients  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.core.mesh_spec import MeshSpec  # noqa: E402
from meshtorch.core.pipeline import T5_STACKED_NAMES  # noqa: E402
from test_hf_t5_train import STEPS, _generate, _reference, _sample, _setup, _train_argv  # noqa: E402


def _loss_and_grads(path, c, mesh="", layout="", storage=""):
    """The loss and the gradient of every trainable variable (by name) of ``c``'s T5 read from ``path``, on a batch
    whose rows have different padding (so a row's encoder output or mask given to another row's decoder shows)."""
    lm = hf.build(c)
    ws = lm.graph.trainable_variables
    grads = gradients([lm.loss], [w.outputs[0] for w in ws])
    lw = hf.lower_loaded(lm, MeshSpec(mesh, layout, storage=storage or None), path)
    inputs, targets = F.t5_batch(4, 8, seed=1), F.t5_batch(4, 8, seed=2)
    for r, (a, b) in enumerate([(8, 5), (3, 8), (6, 2), (8, 8)]):  # padding (0) after a, b tokens
        inputs[r, a:], targets[r, b:] = 0, 0
    out = lw.run([lm.loss] + grads, feeds={lm.inputs: inputs, lm.targets: targets})
    return out[0].item(), {w.name: g for w, g in zip(ws, out[1:], strict=True)}


@pytest.fixture(scope="module")
def t5dir(tmp_path_factory):
    return F.save_t5(F.make_t5(), str(tmp_path_factory.mktemp("t5pipe") / "t5"))


@pytest.mark.parametrize("mesh,layout,storage", [("pipe:2", "stage:pipe", ""),
                                                 ("pipe:2,data:2", "stage:pipe;batch:data", "d_model:data")])
def test_pipelined_t5_loss_and_gradients_equal_unpipelined(t5dir, mesh, layout, storage):
    """2 stages x 2 microbatches: the loss and every gradient equal the unpipelined T5's (1e-6); a stacked
    variable's row ``s`` holds layer ``s``'s gradient."""
    c = hf.read_config(t5dir).with_shape(4, 8)
    loss0, g0 = _loss_and_grads(t5dir, c)
    loss1, g1 = _loss_and_grads(t5dir, c.replace(pipeline_stages=2, microbatches=2), mesh, layout, storage)
    assert abs(loss1 - loss0) <= 1e-6, (loss1, loss0)
    seen = set()
    for name, g in g1.items():
        split = next((p for p in (n.unstacked(name, 0) for n in T5_STACKED_NAMES) if p), None)
        rows = [(name, g)] if split is None else [
            (next(n.unstacked(name, s) for n in T5_STACKED_NAMES if n.unstacked(name, s)), g[s]) for s in range(2)]
        for layer, value in rows:
            torch.testing.assert_close(value, g0[layer], rtol=0, atol=1e-6, msg=lambda m, k=layer: f"{k}: {m}")
            seen.add(layer)
    assert seen == set(g0) and any(n.startswith("decoder/stack/") for n in g1), sorted(g1)


def test_t5_pipeline_layout_trains_from_the_cli(tmp_path):
    """``train --init-from T5DIR --layout stage:pipe`` (2 stages, ``pipe:2,data:2``): the losses of transformers +
    AdamW (1e-5), logged to metrics.jsonl; ``meshtorch sample`` of the run (its stacked checkpoint read by the
    unpipelined decoder) is ``generate`` of the torch-trained model."""
    path, data = _setup(tmp_path)
    ck, logs = str(tmp_path / "run"), str(tmp_path / "logs")
    rc = F.run(_train_argv(path, data, ck, "--mesh", "pipe:2,data:2", "--layout", "stage:pipe;batch:data",
                           "--log-dir", logs))
    ours = rc["history"]["loss"]
    rows = [json.loads(line) for line in open(os.path.join(logs, "metrics.jsonl"))]
    assert [r["loss"] for r in rows if "loss" in r] == pytest.approx(ours, rel=1e-6), rows
    ref, theirs = _reference(path)
    assert len(ours) == STEPS
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)
    assert _sample(ck) == [_generate(ref, path)]


def test_side_inputs_reach_each_microbatchs_layers_in_a_circular_pipeline():
    """``layers.pipeline(side_inputs=...)`` with S=2, M=4, R=2 on ``pipe:2``: every layer of microbatch m reads side
    slice m (output and the gradients of the input, the side input and the stacked kernel equal plain PyTorch's
    loop over the 4 layers); bubbles hold NaN before the mask and reach nothing."""
    import meshtorch as mtf
    from meshtorch import layers
    from meshtorch.core.pipeline import PipelineSchedule

    g = mtf.Graph(seed=1)
    mesh = mtf.Mesh(g, "mesh")
    b, mb, h = mtf.Dimension("batch", 2), mtf.Dimension("microbatches", 4), mtf.Dimension("hidden", 4)
    gen = torch.Generator().manual_seed(0)
    x_val, side_val = torch.randn(2, 4, 4, generator=gen), torch.randn(4, 2, 4, generator=gen)
    x = mtf.import_tensor(mesh, x_val, [b, mb, h])
    side = mtf.import_tensor(mesh, side_val, [mb, b, h])  # microbatch dim first: any position works

    def stage_fn(t, name, s):
        return mtf.tanh(layers.dense(t, h, reduced_dims=[h], use_bias=False, name=f"{name}/dense") * s)

    y = layers.pipeline(stage_fn, x, PipelineSchedule(2, 4, 2), side_inputs=[side], bubble_fill=float("nan"))
    kernel = g.trainable_variables[0].outputs[0]
    loss = mtf.reduce_sum(y * y)
    grads = gradients([loss], [x, side, kernel])
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("pipe:2", "stage:pipe")})
    got = lw.run([y] + grads)
    k = lw.variable_value(kernel.operation.name).clone().requires_grad_(True)
    xt, st = x_val.clone().requires_grad_(True), side_val.clone().requires_grad_(True)
    want = xt
    for i in range(4):
        want = torch.tanh((want @ k[i % 2, i // 2]) * st.permute(1, 0, 2))
    (want * want).sum().backward()
    for a, e in zip(got, [want.detach(), xt.grad, st.grad, k.grad], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_pipelined_t5_needs_stages_x_repeats_decoder_blocks(t5dir):
    """A pipeline of 2 stages x 1 repeat on a T5 with 4 decoder blocks is refused, naming the decoder."""
    c = hf.read_config(t5dir).with_shape(4, 8).replace(num_decoder_layers=4, pipeline_stages=2, microbatches=2)
    with pytest.raises(ValueError, match="decoder has 4 blocks.*num_decoder_layers"):
        hf.build(c)

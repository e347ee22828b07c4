"""float16 training with dynamic loss scaling (meshtorch.optim.loss_scale) against plain PyTorch's
``torch.amp.GradScaler`` on the same tiny LM: the same scales, skipped steps and step counts, close losses."""

import pytest
import torch

import meshtorch as mtf
from meshtorch.models.transformer import build_lm, preset
from meshtorch.optim.loss_scale import DynamicLossScale
from meshtorch.testing.torch_lm import TorchLM

CFG = preset("tiny", vocab_size=64, d_model=32, num_heads=4, d_kv=8, d_ff=64, num_layers=2, length=16, batch_size=8)
FP16 = mtf.PrecisionPolicy(torch.float16)
LR, CLIP, STEPS = 1e-2, 1.0, 8
# 2**40 and 2**20 overflow float16 in the backward pass (forced overflows), 2**10 does not; growth every 3 good steps
SCALE = dict(init_scale=2.0 ** 40, backoff_factor=2.0 ** -10, growth_interval=3)


def _torch_run(lw, batches):
    """Plain PyTorch on meshtorch's initial weights: ``torch.autocast(cpu, float16)``, GradScaler (scale, unscale_,
    clip_grad_norm_, step, update) and AdamW(fused=True): per step the loss, the scale after the step and the
    optimizer's step count."""
    model = TorchLM(CFG)
    model.load_state_dict({n.replace("/", "."): lw.variable_value(n) for n in lw.variable_names
                           if "/adam_" not in n and n != "global_step" and not n.startswith("loss_scale")})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8, fused=True)
    scaler = torch.amp.GradScaler("cpu", **SCALE)
    out = []
    for b in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = TorchLM.loss(model, b[:, :-1], b[:, 1:])
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        step = opt.state[next(iter(model.parameters()))].get("step", torch.zeros(()))
        out.append((loss.item(), scaler.get_scale(), int(step)))
    return out


@pytest.mark.parametrize("mesh,layout", [("", ""), ("data:2,model:2", "batch:data;heads:model;d_ff:model")],
                         ids=["one_processor", "2x2"])
def test_fp16_loss_scaling_follows_grad_scaler(mesh, layout):
    """Same scale after every step and same skipped steps as GradScaler (forced overflows at 2**40 and 2**20,
    growth after 3 good steps), weights untouched by a skipped step, losses within 2e-3 relative (float16
    casts of the weights vs autocast: measured 1.6e-4 on one processor)."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, CFG.vocab_size, (CFG.batch_size, CFG.length + 1), generator=g) for _ in range(STEPS)]
    lm = build_lm(CFG, optimizer=mtf.optim.AdamWOptimizer(LR), precision=FP16, clip_norm=CLIP,
                  loss_scale=DynamicLossScale(**SCALE))
    lw = lm.lowering(mesh, layout)
    ref = _torch_run(lw, batches)
    w0 = lw.variable_value("logits/kernel").clone()
    got = []
    for b in batches:
        loss = lw.run([lm.loss] + lm.updates, feeds={lm.inputs: b[:, :-1], lm.targets: b[:, 1:]})[0]
        got.append((loss.item(), lw.variable_value("loss_scale").item(), int(lw.variable_value("global_step"))))
        if got[-1][2] == 0:  # skipped so far: the float32 master is unchanged
            assert torch.equal(lw.variable_value("logits/kernel"), w0)
    assert [s for _, s, _ in got] == [s for _, s, _ in ref]
    assert [k for *_, k in got] == [k for *_, k in ref]
    skipped = STEPS - got[-1][2]
    assert skipped >= 2 and max(s for _, s, _ in got[skipped:]) > got[skipped - 1][1]  # skips, then a growth
    for (a, *_), (b, *_) in zip(got, ref, strict=True):
        assert abs(a - b) / b <= 2e-3
    assert lw.variable_value("layer_0/ffn/wi/kernel").dtype == torch.float32


def test_fp16_loss_scaling_errors():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScale(backoff_factor=1.5)
    with pytest.raises(ValueError, match="use AdamW, or bf16"):
        build_lm(CFG, optimizer=mtf.optim.SgdOptimizer(0.1), precision=FP16)
    with pytest.raises(ValueError, match="fused multi-tensor update"):
        build_lm(CFG, optimizer=mtf.optim.AdamWOptimizer(LR, fused=False), precision=FP16)


def test_train_cli_fp16_runs_with_loss_scaling_and_refuses_what_it_cannot(tmp_path, capsys):
    """``meshtorch train --precision fp16``: float32 masters, the loss scale variables in the checkpoint, run.json
    records float16; other optimizers, --accumulate and --init-from are refused with exit status 2."""
    import json
    import os

    from meshtorch.cli import main
    from meshtorch.runtime.train import main_train
    from meshtorch.runtime.train_config import TrainConfig

    flags = dict(preset="tiny", layers=1, d_model=32, heads=4, d_kv=8, d_ff=64, length=16, batch_size=8, steps=3,
                 eval_every=3, eval_batches=1, sample=0, plot="", lr=1e-2, warmup_steps=1, vocab_size=64)
    res = main_train(TrainConfig(**flags, precision="fp16", runs_dir=str(tmp_path), run_name="fp16"))
    lw = res["lowering"]
    assert lw.variable_value("loss_scale").item() == 2.0 ** 16  # three good steps: GradScaler's default scale
    assert int(lw.variable_value("global_step")) == 3
    assert lw.variable_value("layer_0/ffn/wi/kernel").dtype == torch.float32
    with open(os.path.join(str(tmp_path), "fp16", "ckpt", "run.json")) as f:
        assert json.load(f)["precision"]["compute_dtype"] == "float16"
    # resumed as fp32 (the loss scale is not needed), then as fp16 from that fp32 checkpoint (the scale starts afresh)
    for precision, steps in (("fp32", 4), ("fp16", 5)):
        lw = main_train(TrainConfig(**{**flags, "steps": steps}, precision=precision, runs_dir=str(tmp_path),
                                    run_name="fp16", resume=True))["lowering"]
        assert int(lw.variable_value("global_step")) == steps
    assert int(lw.variable_value("loss_scale/growth_tracker")) == 1
    for extra in (["--optimizer", "sgd"], ["--accumulate", "2"]):
        rc = main(["train", "--preset", "tiny", "--steps", "1", "--precision", "fp16", "--runs-dir", str(tmp_path),
                   *extra])
        err = capsys.readouterr().err
        assert rc == 2 and "--precision fp16 (dynamic loss scaling) runs with --optimizer adamw" in err
        assert "Traceback" not in err

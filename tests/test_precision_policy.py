"""The precision policy (FSDP2's MixedPrecisionPolicy on named dims): bf16 training of the LM under several
layouts against plain PyTorch on the same weights, dtypes of masters, slots, collectives and float32 islands,
checkpoints across precisions, and ``meshtorch plan --precision``."""

from dataclasses import replace

import pytest
import torch

import meshtorch as mtf
from meshtorch.checkpoint import restore, save
from meshtorch.mesh.recorder import flight_recorder
from meshtorch.models.transformer import build_lm, preset
from meshtorch.ops.xent import SparseSoftmaxCrossEntropyOperation
from meshtorch.testing.torch_lm import TorchLM

BF16 = mtf.PrecisionPolicy(torch.bfloat16)
# a tiny LM: bfloat16 matmuls are slow on CPUs without bf16 units
CFG = preset("tiny", vocab_size=64, d_model=32, num_heads=4, d_kv=8, d_ff=64, num_layers=2, length=16, batch_size=8)
STEPS, LR = 12, 1e-2
LAYOUTS = {
    "1 processor": ("", "", None),
    "data parallel": ("data:2", "batch:data", None),
    "2x2 Megatron, storage d_model:data": ("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model",
                                           "d_model:data"),
    "all:4 model parallel": ("all:4", "heads:all;d_ff:all;vocab:all", None),
}


def _batches(n=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (CFG.batch_size, CFG.length + 1), generator=g) for _ in range(n)]


def _lowering(mesh, layout, storage, precision=BF16, cfg=CFG):
    lm = build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(LR), precision=precision)
    return lm, mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh, layout, storage=storage)})


def _train(lm, lw, batches):
    return [lw.run([lm.loss] + lm.updates, feeds={lm.inputs: b[:, :-1], lm.targets: b[:, 1:]})[0] for b in batches]


class _Bf16TorchLM(TorchLM):
    """The plain-PyTorch twin run as FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16)`` runs a module: every
    parameter cast to bfloat16 once per step (autograd casts its gradient back to the float32 master), the
    residual stream in bfloat16, RMS statistics in float32 (Hugging Face's LlamaRMSNorm), loss on float32
    logits."""

    def _norm(self, x, m):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * m.scale

    def loss_bf16(self, ids, targets):
        params = {f"model.{n}": p.to(torch.bfloat16) for n, p in self.named_parameters()}
        return torch.func.functional_call(_Loss(self), params, (ids, targets))


class _Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, targets):
        return self.model.loss(ids, targets)


def _torch_losses(lw, batches, autocast=False):
    """Plain PyTorch on meshtorch's initial weights: AdamW (torch.optim, float32 masters and state), the
    forward either with bfloat16 parameter casts (FSDP2's way) or under ``torch.autocast("cpu", bfloat16)``."""
    model = _Bf16TorchLM(CFG)
    model.load_state_dict({n.replace("/", "."): lw.variable_value(n) for n in lw.variable_names
                           if "/adam_" not in n and n != "global_step"})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8)
    out = []
    for b in batches:
        opt.zero_grad()
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = TorchLM.loss(model, b[:, :-1], b[:, 1:])
        else:
            loss = model.loss_bf16(b[:, :-1], b[:, 1:])
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        out.append(loss.item())
    return out


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_policy_names_defaults_and_errors():
    assert mtf.PrecisionPolicy.named("bf16") == mtf.PrecisionPolicy(torch.bfloat16, torch.float32, False)
    assert mtf.PrecisionPolicy.named("tf32").tf32 and not mtf.PrecisionPolicy.named("tf32").mixed
    assert mtf.PrecisionPolicy.named("bf16", "bfloat16").reduce_dtype == torch.bfloat16
    assert mtf.PrecisionPolicy.of(None).name == "fp32" and mtf.PrecisionPolicy.of("bf16") == BF16
    with pytest.raises(ValueError, match="--precision"):
        mtf.PrecisionPolicy.named("fp8")
    with pytest.raises(ValueError, match="--reduce-dtype bfloat16 needs --precision bf16"):
        mtf.PrecisionPolicy.named("fp32", "bfloat16")
    with pytest.raises(ValueError, match="tf32"):
        mtf.PrecisionPolicy(torch.bfloat16, tf32=True)
    with pytest.raises(ValueError, match="compute_dtype"):
        mtf.PrecisionPolicy(torch.float64)
    with pytest.raises(TypeError, match="PrecisionPolicy"):
        build_lm(CFG, precision=torch.bfloat16)


def _torch_logits(lw, ids):
    """Plain-PyTorch logits on ``lw``'s weights: (bf16 parameter casts, float32)."""
    model = _Bf16TorchLM(CFG)
    model.load_state_dict({n.replace("/", "."): lw.variable_value(n) for n in lw.variable_names
                           if "/adam_" not in n and n != "global_step"})
    params = {f"model.{n}": p.to(torch.bfloat16) for n, p in model.named_parameters()}
    with torch.no_grad():
        return torch.func.functional_call(_Forward(model), params, (ids,)), model(ids)


class _Forward(_Loss):
    def forward(self, ids):
        return self.model(ids)


def _rel(a, ref):
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def test_bf16_lm_same_losses_across_layouts_and_close_to_plain_pytorch():
    """The LM in bf16 under four layouts (incl. storage-sharded weights) vs plain PyTorch on the same initial
    weights (bfloat16 parameter casts, FSDP2's way; and torch.autocast): first-step logits, then 12 AdamW steps.

    Logits: on 1 processor and data parallel every matmul is PyTorch's on the same bf16 operands, so they
    equal the reference bitwise (the float32 model differs by 6.4e-3 relative norm: a test that bf16 is in
    effect). Model-parallel layouts split sums: each processor's partial is rounded to bf16 before the
    partials are summed, one more rounding (2**-9 = 2e-3 relative) per split contraction: measured 6.3e-3 and
    6.7e-3, bound 2e-2. Losses (float32 means over 128 positions) over 12 steps: measured within 6.8e-4 of
    one another and of both PyTorch references (the loss falls to 0.89 of its start); bound 3e-3, 1.5 bf16
    roundings (the issue's 2% per step and 1% final are looser)."""
    batches = _batches()
    ids = batches[0][:, :-1]
    losses = {}
    for name, (mesh, layout, storage) in LAYOUTS.items():
        lm, lw = _lowering(mesh, layout, storage)
        ref16, ref32 = _torch_logits(lw, ids)
        got = lw.run(lm.logits, feeds={lm.inputs: ids})
        assert got.dtype == torch.bfloat16 and _rel(ref16, ref32) > 1e-3
        if name in ("1 processor", "data parallel"):
            assert _rel(got, ref16) <= 1e-6, name
        else:
            assert _rel(got, ref16) <= 2e-2, name
        if name == "1 processor":
            ref = _torch_losses(lw, batches)
            ref_autocast = _torch_losses(lw, batches, autocast=True)
        got = _train(lm, lw, batches)
        assert all(x.dtype == torch.float32 for x in got), name
        losses[name] = [x.item() for x in got]
    base = losses["1 processor"]
    assert base[-1] < 0.95 * base[0]  # it learns: a real training run, not a constant
    for name, got in losses.items():
        assert _max_rel(got, base) <= 3e-3, (name, got, base)
        assert _max_rel(got, ref) <= 3e-3, (name, got, ref)
        assert _max_rel(got, ref_autocast) <= 3e-3, (name, got, ref_autocast)


def test_bf16_under_pipeline_remat_and_executors():
    """bf16 under a 2-stage pipeline layout (stacked weights), remat block / selective and the interpreting
    executor: the same losses as the plain 1-processor bf16 run. Remat and executors recompute or run the same
    kernels on the same bf16 values (bitwise); the pipeline sums microbatch gradients in another order
    (measured 4e-4 over 12 steps; bound 3e-3 as across layouts)."""
    batches = _batches(6)
    base = [x.item() for x in _train(*_lowering("", "", None), batches)]
    for remat in ("block", "selective"):
        got = [x.item() for x in _train(*_lowering("", "", None, cfg=replace(CFG, remat=remat)), batches)]
        assert got == base, remat
    lm = build_lm(CFG, optimizer=mtf.optim.AdamWOptimizer(LR), precision=BF16)
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("data:2", "batch:data")}, mode="interpret")
    assert _max_rel([x.item() for x in _train(lm, lw, batches)], base) <= 3e-3
    piped = replace(CFG, pipeline_stages=2, microbatches=2)
    lm, lw = _lowering("pipe:2", "stage:pipe", None, cfg=piped)
    assert any(v.name.startswith("stack/") for v in lm.graph.trainable_variables)
    assert _max_rel([x.item() for x in _train(lm, lw, batches)], base) <= 3e-3


def test_masters_slots_float32_and_float32_islands():
    """Variables (masters) and AdamW slots float32; weight reads, einsums and logits bfloat16; the norms'
    statistics, the cross-entropy and the loss float32 (read from the graph's dtypes)."""
    lm, lw = _lowering("data:2", "batch:data", None)
    _train(lm, lw, _batches(1))
    for n in lw.variable_names:
        want = torch.int64 if n == "global_step" else torch.float32
        assert lw.variable_value(n).dtype == want, n
    ops = lm.graph.operations
    forward = [op for op in ops if not op.backward]
    reads = [op for op in ops if op.name.endswith("/read")]
    assert len(reads) == len(lm.graph.trainable_variables) and all(op.outputs[0].dtype == torch.bfloat16
                                                                    for op in reads)
    einsums = [op for op in forward if type(op).__name__ == "EinsumOperation"]
    assert einsums and all(op.outputs[0].dtype == torch.bfloat16 for op in einsums)
    assert lm.logits.dtype == torch.bfloat16 and lm.loss.dtype == torch.float32
    (xent,) = [op for op in ops if isinstance(op, SparseSoftmaxCrossEntropyOperation)]
    assert [t.dtype for t in xent.outputs] == [torch.float32, torch.float32]
    rsqrts = [op for op in forward if op.name.startswith("rsqrt")]
    assert len(rsqrts) == 2 * CFG.num_layers + 1  # each norm's statistic, in float32
    for op in rsqrts:
        assert op.outputs[0].dtype == torch.float32 and op.inputs[0].dtype == torch.float32
        mean = op.inputs[0].operation.inputs[0].operation  # rsqrt(mean(square(x)) + eps)
        assert mean.inputs[0].dtype == torch.float32


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_storage_sharded_weights_gather_bf16_and_gradients_reduce_in_reduce_dtype(reduce_dtype):
    """FSDP (storage d_model:data): each weight is cast on its shard, so its all-gather moves bfloat16 (2 bytes
    per element of a shard); its gradient is reduce-scattered in ``reduce_dtype`` (FSDP2's reduce_dtype)."""
    policy = mtf.PrecisionPolicy(torch.bfloat16, reduce_dtype)
    cfg = preset("tiny", vocab_size=64, d_model=32, num_heads=4, d_kv=8, d_ff=64, num_layers=1, length=16,
                 batch_size=8)
    lm = build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(LR), precision=policy)
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("data:4", "batch:data", storage="d_model:data")},
                      materialize=False)
    recs = lw.plan_counters([lm.loss] + lm.updates).records
    sizes = {v.name: v.outputs[0].shape.size for v in lm.graph.trainable_variables}
    gathers = {c.tensor.removesuffix("/read"): c.bytes_per_processor for c in recs if c.kind == "allgather"}
    assert gathers == {n: s // 4 * 2 for n, s in sizes.items()}  # every weight: a quarter shard, 2 bytes each
    scatters = sorted(c.bytes_per_processor for c in recs if c.kind == "reduce_scatter")
    item = torch.finfo(reduce_dtype).bits // 8
    assert scatters == sorted(s * item for s in sizes.values())  # each whole partial gradient, reduce_dtype
    assert not [c for c in recs if c.kind == "allreduce" and c.bytes_per_processor > 4]
    # one cast per weight per step, on the shard: the backward pass's second all-gather (reshard after
    # forward) gathers the same bfloat16 shard again, it does not cast again
    steps = lw.plan([lm.loss] + lm.updates).steps
    casts = [st.op for st in steps if st.kind == "slicewise" and st.op.endswith("/read")]  # op names
    assert sorted(casts) == sorted(f"{n}/read" for n in sizes)
    assert sum(st.kind == "allgather" for st in steps) > len(sizes)  # some weights are gathered twice


def test_executed_gather_records_bfloat16():
    """The flight recorder's records of a run: the weight all-gathers move bfloat16, the gradient
    reduce-scatters float32 (the default reduce_dtype)."""
    lm, lw = _lowering("data:2", "batch:data", "d_model:data")
    rec = flight_recorder()
    before = rec.records()[-1].seq if rec.records() else -1
    _train(lm, lw, _batches(1))
    recs = [r for r in rec.records() if r.seq > before]
    kinds = {(r.kind, r.dtype) for r in recs}
    assert ("allgather", "bfloat16") in kinds and ("reduce_scatter", "float32") in kinds
    assert ("allgather", "float32") not in kinds


@pytest.mark.parametrize("saved,restored", [(BF16, None), (None, BF16)])
def test_checkpoint_restores_across_precisions(tmp_path, saved, restored):
    """A checkpoint holds float32 masters and slots whatever the policy: saved under one precision it restores
    bitwise under the other, and training continues from it as a run that never stopped would."""
    batches = _batches(4)
    lm, lw = _lowering("data:2", "batch:data", None, precision=saved)
    _train(lm, lw, batches[:2])
    path = save(lw, str(tmp_path), step=2)
    lm2, lw2 = _lowering("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model", "d_model:data",
                         precision=restored)
    restore(lw2, path)
    for n in lw.variable_names:
        a, b = lw.variable_value(n), lw2.variable_value(n)
        assert a.dtype == b.dtype and torch.equal(a, b), n
    # the restored run continues as the same precision's uninterrupted run on its own layout would
    lm3, lw3 = _lowering("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model", "d_model:data",
                         precision=restored)
    for n in lw.variable_names:
        lw3.set_variable_value(n, lw.variable_value(n))
    a = [x.item() for x in _train(lm2, lw2, batches[2:])]
    b = [x.item() for x in _train(lm3, lw3, batches[2:])]
    assert a == b


def test_plan_prices_bf16_activations_and_gathers_by_dtype(capsys):
    """``meshtorch plan --precision bf16``: the largest activation (the logits, [batch, length, vocab], counted
    here from the config) costs 2 bytes per element instead of 4; weight gathers half; masters and optimizer
    state unchanged."""
    from meshtorch.cli import build_parser
    from meshtorch.runtime.plan_command import main_plan

    argv = ["plan", "--preset", "tiny", "--vocab", "2048", "--mesh", "data:2", "--layout", "batch:data",
            "--storage", "d_model:data", "--hardware", "cpu"]
    (_, fp32), = main_plan(build_parser().parse_args(argv))
    (_, bf16), = main_plan(build_parser().parse_args(argv + ["--precision", "bf16"]))
    out = capsys.readouterr().out
    assert "bf16 (float32 masters, bfloat16 compute, gradients reduced in float32)" in out
    tiny = preset("tiny")
    logits = tiny.batch_size // 2 * tiny.length * 2048  # per processor: batch split over data:2
    assert fp32.largest_slot_bytes == 4 * logits and bf16.largest_slot_bytes == 2 * logits
    assert 0.5 <= bf16.peak_activation_bytes / fp32.peak_activation_bytes <= 0.62
    assert bf16.trainable_bytes == fp32.trainable_bytes and bf16.non_trainable_bytes == fp32.non_trainable_bytes
    gather = {k: v for k, v in bf16.communication().items() if k[0] == "allgather"}
    gather32 = {k: v for k, v in fp32.communication().items() if k[0] == "allgather"}
    assert gather and all(v[1] * 2 == gather32[k][1] for k, v in gather.items())


def test_matmul_precision_set_per_policy():
    old = torch.get_float32_matmul_precision()
    try:
        assert mtf.PrecisionPolicy.named("tf32").set_matmul_precision() == "high"
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        assert mtf.PrecisionPolicy.named("tf32").record()["float32_matmul_precision"] == "high"
        assert mtf.PrecisionPolicy.named("fp32").set_matmul_precision() == "highest"
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(old)


def test_bf16_rms_norm_statistics_in_float32():
    """rms_norm of bfloat16 values large enough that a bfloat16 mean square would round visibly: our result
    equals the float32-statistics reference (rounded once to bf16) exactly, and differs from the bf16 one."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 256, generator=g) * 30 + 100).bfloat16()
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph)
    xv = mtf.import_tensor(mesh, x, "b:4,d:256")
    y = mtf.layers.rms_norm(xv, "d")
    got = mtf.Lowering(graph, {mesh: mtf.PlacementMeshImpl("", "")}).run(y)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    low = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # statistics rounded to bf16
    assert not torch.equal(got, low)


@pytest.mark.parametrize("extra", [dict(num_experts=4), dict(norm="layer", gated=True, activation="gelu"),
                                   dict(label_smoothing=0.1, z_loss=1e-4, vocab_multiple=3)],
                         ids=["moe", "layer-norm-gated", "label-smoothing-z-loss-padded-vocab"])
def test_bf16_model_options_keep_a_float32_loss(extra):
    """MoE (its auxiliary loss), layer norm with biases and a gated GELU feed-forward, label smoothing (the
    dense soft-target cross-entropy) with z-loss and a padded vocabulary: the bf16 loss is float32 and its
    first value is the float32 model's to bf16 rounding (bound 1e-2, five roundings of 2**-9)."""
    cfg = replace(CFG, **extra)
    b = _batches(1)[0]
    first = {}
    for precision in (None, BF16):
        lm, lw = _lowering("", "", None, precision=precision, cfg=cfg)
        assert lm.loss.dtype == torch.float32
        first[precision] = _train(lm, lw, [b])[0].item()
    assert abs(first[BF16] - first[None]) <= 1e-2 * first[None]

"""The cost model prices attention's contractions and the compute dtype (issue 36): the fused attention op's planned
FLOPs against ``torch.utils.flop_counter.FlopCounterMode`` on the same attention written as plain PyTorch
(``q k^T``, softmax, ``p v`` and their autograd backward), and a ``--precision bf16`` plan priced at the measured
bfloat16 GEMM rate instead of float32's."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import meshtorch as mtf
from meshtorch.lowering.stages import plan, schedule
from meshtorch.models.transformer import preset
from meshtorch.planning import memory_report
from meshtorch.planning.cost import CostModel, estimate_time
from meshtorch.runtime.plan_lm import plan_lm

B, H, L, DK = 2, 4, 16, 8


def _mem(causal: bool) -> int:
    return L if causal else 12  # causal masking needs equal lengths; cross attention otherwise


def _plain_flops(dv: int, causal: bool):
    """(forward, backward) FLOPs FlopCounterMode counts for softmax(q k^T / sqrt(dk)) v in plain PyTorch."""
    g, M = torch.Generator().manual_seed(0), _mem(causal)
    q, k, v = (torch.randn(B, H, n, d, generator=g, requires_grad=True) for n, d in ((L, DK), (M, DK), (M, dv)))
    with FlopCounterMode(display=False) as fwd:
        s = q @ k.transpose(-1, -2) / DK ** 0.5
        if causal:
            s = s + torch.full((L, M), float("-inf")).triu(1)
        out = torch.softmax(s, -1) @ v
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def _planned_flops(dv: int, causal: bool, mesh_shape: str = "", layout: str = "", bias: bool = False):
    """(global attention-step FLOPs of the forward, of the backward, FLOPs per processor) of a planned training
    step of the fused attention op."""
    graph, M = mtf.Graph(seed=0), _mem(causal)
    mesh = mtf.Mesh(graph, "m")
    q = mtf.get_variable(mesh, "q", f"b:{B},h:{H},l:{L},k:{DK}")
    k = mtf.get_variable(mesh, "k", f"b:{B},h:{H},mem:{M},k:{DK}")
    v = mtf.get_variable(mesh, "v", f"b:{B},h:{H},mem:{M},vd:{dv}")
    b = mtf.get_variable(mesh, "bias", f"l:{L},mem:{M}") if bias else None
    out = mtf.layers.scaled_dot_product_attention(q, k, v, "l", "k", value_dim="vd", memory_length_dim="mem",
                                                  causal=causal, bias=b)
    loss = mtf.reduce_sum(out)
    grads = mtf.gradients([loss], [q, k, v])
    program = plan(graph, [loss] + grads, {mesh: mtf.MeshSpec(mesh_shape, layout)})
    steps = schedule(program).steps
    fwd = sum(st.flops for st in steps if st.op == out.operation.name)
    bwd = sum(st.flops for st in steps if st.op == f"{out.operation.name}_grad")
    return fwd, bwd, memory_report(program).flops_per_processor


@pytest.mark.parametrize("dv,causal,bias", [(DK, True, False), (6, False, False), (DK, False, True)],
                         ids=["flash_causal", "dv_differs", "bias"])
def test_attention_flops_match_the_flop_counter_of_plain_pytorch(dv, causal, bias):
    """Forward: the two contractions FlopCounterMode counts on plain PyTorch (the causal mask's half counted, as
    torch's sdpa formula does). Backward: the plain autograd's 4 contractions plus the scores recomputed (the flash
    kernel, dk = dv) or plus the whole forward recomputed (the composite kernel, other cases)."""
    want_fwd, want_bwd = _plain_flops(dv, causal)
    fwd, bwd, _ = _planned_flops(dv, causal, bias=bias)
    assert fwd == want_fwd
    flash = dv == DK and not bias
    recompute = 2 * B * H * L * _mem(causal) * DK if flash else want_fwd
    assert bwd == want_bwd + recompute


def test_attention_flops_per_processor_split_by_the_layout():
    """Attention splits over its batch-like dims only: heads over 2 processors halve each processor's FLOPs, and
    the FLOPs per processor now include attention (2 contractions forward, 5 backward with dk = dv)."""
    fwd, bwd, one = _planned_flops(DK, True)
    assert one == fwd + bwd == 2 * B * H * L * L * DK * (2 + 5)
    _, _, split = _planned_flops(DK, True, "all:2", "h:all")
    assert split * 2 == one


def test_bf16_plan_is_priced_at_the_bfloat16_rate():
    """A cost model that measured bfloat16 GEMMs 30x slower than float32 (as on a CPU without bf16
    instructions) prices a --precision bf16 plan's FLOPs at the bfloat16 rate; a dtype it did not measure keeps
    float32's rate, and the plan's header says so."""
    cfg = preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                 vocab_size=256)
    cost = CostModel(flop_rate=1e10, bandwidth=1e30, latency=0.0, flop_rates=(("float32", 1e10),
                                                                               ("bfloat16", 1e10 / 30)))
    said = []
    (_, rep), = plan_lm(cfg, "data:2", "batch:data", cost=cost, precision="bf16", print_fn=said.append)
    assert rep.estimated_time["compute_s"] == pytest.approx(rep.flops_per_processor / (1e10 / 30))
    assert any("bfloat16 FLOP/s" in s for s in said), said
    (_, rep32), = plan_lm(cfg, "data:2", "batch:data", cost=cost, print_fn=lambda *a: None)
    assert rep32.estimated_time["compute_s"] == pytest.approx(rep32.flops_per_processor / 1e10)
    said.clear()
    plan_lm(cfg, "data:2", "batch:data", cost=CostModel(), precision="bf16", print_fn=said.append)
    assert any("bfloat16 (float32's rate, not measured) FLOP/s" in s for s in said), said
    assert estimate_time(rep, cost.for_dtype(torch.bfloat16))["compute_s"] == rep.estimated_time["compute_s"]


def _ranked(*ms):
    from types import SimpleNamespace
    return [(f"l{i}", SimpleNamespace(estimated_time={"total_s": m / 1e3})) for i, m in enumerate(ms)]


def test_trust_line_names_the_layouts_within_the_calibrations_spread():
    """Layouts predicted within the spread of the first (here 10%: 105 ms and 110 ms of 100 ms, not 111 ms) are
    named as not reliably ordered; a busy calibration says so; fixed constants are called a rough guide."""
    from meshtorch.planning.search import trust_line
    line = trust_line(_ranked(100, 105, 110, 111, 130), CostModel(spread=0.1))
    assert "spread 10%" in line and "2 other layout(s)" in line and "(l1, l2)" in line and "busy" not in line
    line = trust_line(_ranked(100, 130), CostModel(spread=0.1, busy=True))
    assert "no other layout" in line and "busy" in line
    assert "rough guide" in trust_line(_ranked(100, 101), CostModel())


def test_plan_search_prints_the_calibrations_spread(tmp_path, monkeypatch, capsys):
    """``meshtorch plan --search`` with a cached calibration measured on a busy host (spread 40%) prints the trust
    line under its table, naming every shown layout predicted within 40% of the first (checked against the
    table's own times)."""
    import json
    import os

    from meshtorch.cli import main
    from meshtorch.runtime import calibrate as cal_mod
    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    cal = cal_mod.Calibration(host=cal_mod._host_key(), backend="placement", threads=1, gemm_flop_rate=5e10,
                              kernel_overhead=5e-6, memory_bandwidth=1e10, spread={"gemm": 0.4, "kernel": 0.1},
                              busy=True, collectives={k: [1e-5, 1e-10] for k in cal_mod.KINDS},
                              version=cal_mod.CALIBRATION_VERSION)
    path = cal_mod.cache_path("placement", 1)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(cal.__dict__, f)
    assert main(["plan", "--preset", "tiny", "--layers", "1", "--search", "--mesh", "data:2,model:2",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit() and "MiB" in ln]
    times = [float(r[2]) for r in rows]
    close = [r[1] for r, t in zip(rows[1:], times[1:], strict=True) if t <= times[0] * 1.4]
    line = next(ln for ln in out.splitlines() if ln.startswith("trust:"))
    assert "spread 40%" in line and "busy" in line
    assert (f"{len(close)} other layout(s)" in line) if close else ("no other layout" in line), (line, close)


REPEATED = ["batch:data;heads:model", "batch:data;heads:model;d_ff:model;vocab:model",  # the batch split over data
            "d_model:data;heads:model", "heads:data;d_ff:model", "vocab:data", "d_ff:data"]  # repeated over data


def _placement_run(layout, mode):
    """(MemoryReport, mode) of one AdamW training step of a 1-layer tiny LM on the placement mesh data:2,model:2
    under ``layout`` with train's sliced feeds, run (after a warm-up step) inside the TorchDispatchMode ``mode``."""
    from meshtorch.data.sharding import local_batch_indices, local_feed
    from meshtorch.models.transformer import build_lm
    spec = mtf.MeshSpec("data:2,model:2", layout)
    cfg = preset("tiny", num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=16, batch_size=8,
                 vocab_size=256, vocab_multiple=spec.axis_size_for("vocab"))
    lm = build_lm(cfg, optimizer=mtf.optim.AdamWOptimizer(1e-3))
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("data:2,model:2", layout)})
    b = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.length + 1), generator=torch.Generator().manual_seed(0))
    feeds = {t: local_feed(lw, t, v[local_batch_indices(lw, t)]) for t, v in ((lm.inputs, b[:, :-1]),
                                                                            (lm.targets, b[:, 1:]))}
    fetches = [lm.loss] + lm.updates
    lw.run(fetches, feeds=feeds, feed_slices=True)
    with mode:
        lw.run(fetches, feeds=feeds, feed_slices=True)
    return memory_report(lw, fetches), mode


def test_flops_under_a_repeated_batch_match_the_flop_counter_of_the_run():
    """A layout that splits a non-batch dim over ``data`` repeats the batch on both data processors: every one of
    them does the whole batch's work of the ops that dim does not split. The planned FLOPs of the one-process run
    (``flops_serial``) against ``FlopCounterMode`` on the real placement run: each layout within 0-25% above
    (the planner counts a few contractions torch runs as elementwise kernels), and the repeated-batch layouts priced
    like the batch-split ones (the ratios within 15% of each other)."""
    ratios = {}
    for layout in REPEATED:
        rep, fc = _placement_run(layout, FlopCounterMode(display=False))
        ratios[layout] = rep.flops_serial / fc.get_total_flops()
    assert all(1.0 <= r <= 1.25 for r in ratios.values()), ratios
    assert max(ratios.values()) / min(ratios.values()) <= 1.15, ratios


class _Traffic(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes read (tensor arguments) and written (tensor results) by the aten ops a run dispatches, views and the
    contractions (priced as FLOPs) left out."""

    SKIP = {"mm", "bmm", "addmm", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward"}

    def __init__(self):
        super().__init__()
        self.moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        view = not func._schema.is_mutable and any(a.alias_info for a in func._schema.returns)
        if not view and func.overloadpacket.__name__ not in self.SKIP:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
            self.moved += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return out


def test_elementwise_bytes_under_a_repeated_batch_match_the_traffic_of_the_run():
    """The bytes the cost model prices at ``memory_bandwidth`` (what the slicewise steps read and write, every
    processor of the one-process run) against the bytes the run's aten ops read and write (a TorchDispatchMode;
    it also counts the placement collectives' own adds and copies, which the model prices as collectives): within
    -30% / +20% for the batch-split and the repeated-batch layouts alike (the writes alone are 2-3x short)."""
    for layout in REPEATED:
        rep, traffic = _placement_run(layout, _Traffic())
        moved = rep.kernel_read_bytes_serial + rep.kernel_bytes_serial
        assert 0.7 <= moved / traffic.moved <= 1.2, (layout, moved / traffic.moved)
        # and those are the bytes the placement model charges (FLOPs, calls and collectives made free here)
        free = CostModel(flop_rate=1e30, bandwidth=1e30, latency=0.0, memory_bandwidth=1e9, serial=True)
        assert estimate_time(rep, free)["compute_s"] == pytest.approx(moved / 1e9, rel=1e-6)

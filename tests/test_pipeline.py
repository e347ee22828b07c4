"""Pipeline parallelism as a layout (issue 24): the LM's blocks stacked on a ``stage`` dim split over a mesh axis.

The reference is the unpipelined LM (``pipeline_stages=0``) on one processor, with the same initial values (each
layer's variables copied into row ``[stage, repeat]`` of the stacked ones: layer ``r * S + s``): the pipelined
LM's loss and the gradients of every variable (stacked gradients cut back into layers) must equal it, under
``stage:pipe`` alone, with ``batch:data``, with Megatron rules and with storage (FSDP) rules. Executed
counters (the flight recorder's) are checked against the permutes the schedule needs, derived here from
S, M, R and the state slice shape.
"""

import os
from collections import Counter

import pytest
import torch

import meshtorch as mtf
from meshtorch.autodiff import gradients
from meshtorch.core.pipeline import PipelineSchedule
from meshtorch.models.transformer import LMConfig, build_lm, preset
from meshtorch.testing.spmd import run_spmd

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

#: the collective kind of a shift over a split dim (a neighbour exchange); main renames it ``collective_permute``
PERMUTE_KIND = "collective_permute"

CFG = dict(vocab_size=16, d_model=16, num_heads=2, d_kv=8, d_ff=32, length=8, batch_size=8)


def _config(S=0, M=1, R=1, **extra):
    layers = max(S, 1) * R if S else extra.pop("num_layers", 2)
    return preset("tiny", **{**CFG, **extra}, num_layers=layers, pipeline_stages=S, microbatches=M, pipeline_repeats=R)


def _data(step=0, batch=8):
    ids = torch.randint(0, CFG["vocab_size"], (batch, CFG["length"] + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def _build(config):
    """The LM (no optimizer) with ``lm._grads``: the loss's gradients w.r.t. every trainable variable."""
    lm = build_lm(config, train=False)
    lm._grads = gradients([lm.loss], lm.graph.trainable_variables)
    return lm


def _run(lm, lw, step=0):
    """Loss and the gradients of every trainable variable (by name) on batch ``step``."""
    vs = lm.graph.trainable_variables
    x, y = _data(step, lm.config.batch_size)
    out = lw.run([lm.loss] + lm._grads, feeds={lm.inputs: x, lm.targets: y})
    return out[0].item(), {v.name: g.clone() for v, g in zip(vs, out[1:], strict=True)}


def _stacked_from_layers(value_of, var, S, R):
    """The stacked variable ``stack/{kind}``'s value built from the per-layer values ``layer_{r*S+s}/{kind}``."""
    kind = var.name[len("stack/"):]
    rows = [[value_of(f"layer_{r * S + s}/{kind}") for r in range(R)] for s in range(S)]
    return torch.stack([torch.stack(row) if R > 1 else row[0] for row in rows])


def _reference(S, R, **extra):
    """The unpipelined LM with S * R layers and its lowering on one processor."""
    lm = _build(_config(num_layers=S * R, **extra))
    return lm, lm.lowering()


def _pipelined(S, M, R, mesh_shape, layout, ref_lw, storage="", **extra):
    lm = _build(_config(S, M, R, pipeline_remat=extra.pop("remat", False), **extra))
    lw = lm.lowering(mesh_impl=mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage) if storage else None,
                     mesh_shape=mesh_shape, layout=layout)
    for v in lm.graph.trainable_variables:
        if v.name.startswith("stack/"):
            lw.set_variable_value(v.name, _stacked_from_layers(ref_lw.variable_value, v, S, R))
        else:
            lw.set_variable_value(v.name, ref_lw.variable_value(v.name))
    return lm, lw


def _assert_same(S, R, ref, got):
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert loss == pytest.approx(ref_loss, abs=1e-6, rel=0)
    kinds = [n[len("stack/"):] for n in grads if n.startswith("stack/")]
    covered = {n for n in grads if not n.startswith("stack/")} | {f"layer_{i}/{k}" for k in kinds for i in range(S * R)}
    assert covered == set(ref_grads)
    for name, g in grads.items():
        if name.startswith("stack/"):
            kind = name[len("stack/"):]
            for s in range(S):
                for r in range(R):
                    want = ref_grads[f"layer_{r * S + s}/{kind}"]
                    torch.testing.assert_close(g[s, r] if R > 1 else g[s], want, rtol=0, atol=1e-6, msg=name)
        else:
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6, msg=name)


CASES = [  # S, M, R, mesh, layout, storage
    (2, 4, 1, "pipe:2", "stage:pipe", ""),
    (2, 8, 1, "pipe:2,data:2", "stage:pipe;batch:data", ""),
    (4, 4, 1, "pipe:4", "stage:pipe", ""),
    (2, 4, 2, "pipe:2,data:2", "stage:pipe;batch:data", ""),
    (4, 8, 2, "pipe:4", "stage:pipe", ""),
    (2, 2, 2, "pipe:2", "stage:pipe", ""),  # M == S: the wrap-around feeds the next repeat directly
    (4, 8, 1, "pipe:4", "stage:pipe", ""),
    (4, 4, 2, "pipe:4", "stage:pipe", ""),
    (2, 8, 2, "pipe:2,data:2", "stage:pipe;batch:data", "d_ff:data"),
    (2, 4, 2, "pipe:2,data:2", "stage:pipe;batch:data", "d_model:data"),
    (2, 4, 1, "pipe:2,model:2", "stage:pipe;heads:model;d_ff:model", ""),
    (2, 4, 1, "pipe:2,data:2,model:2", "stage:pipe;batch:data;heads:model;d_ff:model;vocab:pipe", ""),
    (4, 4, 1, "pipe:2", "stage:pipe", ""),  # two stages per processor: the shift moves one of them
]


@pytest.mark.parametrize("S,M,R,mesh_shape,layout,storage", CASES)
def test_pipelined_lm_equals_unpipelined(S, M, R, mesh_shape, layout, storage):
    batch = max(CFG["batch_size"], 2 * M if "data" in layout else M)
    ref_lm, ref_lw = _reference(S, R, batch_size=batch)
    ref = _run(ref_lm, ref_lw)
    lm, lw = _pipelined(S, M, R, mesh_shape, layout, ref_lw, storage, batch_size=batch)
    assert lm.pipeline == PipelineSchedule(S, M, R) == lm.graph.pipeline_schedule
    _assert_same(S, R, ref, _run(lm, lw))


def test_pipeline_remat_and_poisoned_bubbles_keep_losses_and_gradients():
    """Per-iteration recompute on; bubbles hold NaN before the mask: the loss and gradients stay finite and equal."""
    S, M, R = 2, 4, 2
    ref_lm, ref_lw = _reference(S, R)
    ref = _run(ref_lm, ref_lw)
    lm, lw = _pipelined(S, M, R, "pipe:2", "stage:pipe", ref_lw, remat=True, pipeline_poison_bubbles=True)
    got = _run(lm, lw)
    assert all(torch.isfinite(g).all() for g in got[1].values())
    _assert_same(S, R, ref, got)


def _by_kind(counters):
    count, nbytes = Counter(), Counter()
    for c, n in counters.records.items():
        count[c.kind, c.mesh_axes] += n
        nbytes[c.kind, c.mesh_axes] += n * c.bytes_per_processor
    return count, nbytes


@pytest.mark.parametrize("S,M,R,mesh_shape,layout,data", [(4, 4, 1, "pipe:4", "stage:pipe", 1),
                                                          (2, 4, 2, "pipe:2,data:2", "stage:pipe;batch:data", 2)])
def test_executed_collectives_per_step(S, M, R, mesh_shape, layout, data):
    """Each iteration but the first shifts the state buffer once forward and once in the backward pass: 2 (M R +
    S - 2) neighbour exchanges per step, each of one processor's state slice [1, B / M / data, length, d_model].
    Over ``pipe`` besides: one all-reduce of the last stage's outputs (B / data x length x d_model) and the
    gradients of the two embedding tables (partial sums over ``pipe``: only stage 0 reads them); cutting the batch
    into microbatches moves nothing."""
    ref_lm, ref_lw = _reference(S, R)
    lm, lw = _pipelined(S, M, R, mesh_shape, layout, ref_lw, remat=True)
    steps = 2
    for step in range(steps):
        _run(lm, lw, step)
    count, nbytes = _by_kind(lw.counters)
    B, L, D, V = CFG["batch_size"], CFG["length"], CFG["d_model"], CFG["vocab_size"]
    permutes = 2 * (M * R + S - 2) * steps
    assert count[PERMUTE_KIND, ("pipe",)] == permutes
    assert nbytes[PERMUTE_KIND, ("pipe",)] == permutes * (B // M // data) * L * D * 4
    over_pipe = ("pipe",) if data == 1 else ("pipe", "data")
    assert count["allreduce", ("pipe",)] + (count["allreduce", over_pipe] if data > 1 else 0) == 3 * steps
    assert nbytes["allreduce", ("pipe",)] == steps * ((B // data) * L * D + (0 if data > 1 else V * D + L * D)) * 4
    assert {k for k, _ in count} <= {PERMUTE_KIND, "allreduce"}
    assert not [c for c in lw.counters.records if c.op.startswith("pipeline/microbatch")]


def test_schedule_table():
    sched = PipelineSchedule(stages=2, microbatches=3, repeats=2)
    assert sched.iterations() == 7
    assert sched.bubble_fraction() == pytest.approx(1 / 7)
    assert sched.table() == [[0, None], [1, 0], [2, 1], [0, 2], [1, 0], [2, 1], [None, 2]]
    with pytest.raises(ValueError, match="microbatches >= stages"):
        PipelineSchedule(stages=4, microbatches=2, repeats=2)


@pytest.mark.parametrize("fields,match", [
    (dict(num_layers=3, pipeline_stages=2), "num_layers"),
    (dict(num_layers=2, pipeline_stages=2, microbatches=3), "batch_size"),
    (dict(num_layers=8, pipeline_stages=4, pipeline_repeats=2, microbatches=2), "microbatches"),
    (dict(num_layers=2, microbatches=2), "pipeline_stages"),
    (dict(num_layers=2, pipeline_stages=2, num_experts=4), "MoE"),
])
def test_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        LMConfig(**{**CFG, **fields})


def test_stacked_variables_start_from_the_unpipelined_layers_values():
    """Row [s, r] of each stacked variable is drawn as layer r * S + s's variable (same counter-based keys)."""
    S, R = 2, 2
    ref_lm, ref_lw = _reference(S, R)
    lm = build_lm(_config(S, 4, R), train=False)
    lw = lm.lowering("pipe:2", "stage:pipe")
    stacked = [v for v in lm.graph.trainable_variables if v.name.startswith("stack/")]
    assert len(stacked) == 8  # attention norm, q, k, v, o, ffn norm, wi, wo
    for v in stacked:
        torch.testing.assert_close(lw.variable_value(v.name), _stacked_from_layers(ref_lw.variable_value, v, S, R),
                                   rtol=0, atol=0)


def _train_cli(tmp_path, *extra):
    import argparse

    from meshtorch.cli.train import add_train_subcommand

    p = argparse.ArgumentParser()
    add_train_subcommand(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["train", "--preset", "tiny", "--layers", "2", "--d-model", "16", "--heads", "2", "--d-kv", "8",
                         "--d-ff", "32", "--length", "8", "--batch-size", "8", "--eval-batches", "1", "--sample", "0",
                         "--plot", "", "--steps", "3", "--eval-every", "3", "--runs-dir", str(tmp_path),
                         *(extra if "--checkpoint-dir" in extra else ("--checkpoint-dir", "", *extra))])
    return args.func(args)


def test_train_cli_pipeline_losses_equal_unpipelined(tmp_path):
    """``meshtorch train --mesh pipe:2,data:2 --layout stage:pipe;batch:data --microbatches 4``: the losses of the
    unpipelined run on the same data; its checkpoint decodes (greedy) to the same tokens on two layouts as the
    unpipelined run's."""
    from meshtorch.runtime.generate import sample
    from meshtorch.runtime.sample import load_lm

    ref = _train_cli(tmp_path, "--mesh", "pipe:2,data:2", "--layout", "batch:data", "--checkpoint-dir",
                     str(tmp_path / "ref"))
    out = _train_cli(tmp_path, "--mesh", "pipe:2,data:2", "--layout", "stage:pipe;batch:data", "--microbatches", "4",
                     "--checkpoint-dir", str(tmp_path / "pipe"))
    assert out["lm"].pipeline == PipelineSchedule(2, 4, 1)
    assert ref["lm"].pipeline is None
    torch.testing.assert_close(out["history"]["loss"], ref["history"]["loss"], rtol=0, atol=1e-5)
    prompt = torch.tensor([84, 104, 101, 32])
    tokens = [sample(lw, lm, prompt, 6, temperature=0)
              for lm, lw in (load_lm(str(tmp_path / "ref"), "", ""), load_lm(str(tmp_path / "pipe"), "", ""),
                             load_lm(str(tmp_path / "pipe"), "pipe:2", "stage:pipe"))]
    assert tokens[0] == tokens[1] == tokens[2]


@pytest.mark.parametrize("extra,match", [
    (["--layout", "stage:pipe", "--microbatches", "3"], "--microbatches 3 must divide --batch-size 8"),
    (["--layout", "stage:pipe", "--layers", "3"], "--layers 3 must equal --pipeline-stages 2"),
    (["--layout", "batch:pipe", "--microbatches", "2"], "--microbatches / --pipeline-repeats need a pipeline"),
    (["--layout", "stage:pipe", "--pipeline-stages", "3", "--layers", "3"], "multiple of the size 2"),
    (["--layout", "stage:pipe", "--layers", "4", "--pipeline-repeats", "2", "--microbatches", "1"], ">= --pipeline"),
    (["--mesh", "pipe:2,data:2", "--layout", "stage:pipe;batch:data", "--microbatches", "8"], "over mesh axis 'data'"),
])
def test_train_cli_pipeline_flag_errors(tmp_path, extra, match):
    from meshtorch.core.errors import UsageError

    with pytest.raises(UsageError, match=match):
        _train_cli(tmp_path, *([] if "--mesh" in extra else ["--mesh", "pipe:2"]), *extra)


#: the parameter-bytes cases of test_parameter_memory_per_rank_with_4_stages: (stages, mesh, layout)
PARAMETER_CASES = [(0, "pipe:4", ""), (4, "pipe:4", "stage:pipe"), (4, "pipe:4", "stage:pipe;vocab:pipe")]


@pytest.fixture(scope="module")
def gloo_ranks(once_per_run):
    """One start of 4 gloo ranks for the two tests below (once per test run: ``once_per_run``):
    ``(pipeline_worker results, parameter_bytes_worker results)``, each a list over the ranks."""
    results = once_per_run("test_pipeline_gloo", lambda: run_spmd(
        "_pipeline_jobs:pipeline_and_parameter_bytes_worker", args=(PARAMETER_CASES,), nprocs=4,
        timeout_s=400, extra_path=[TESTS_DIR]).check().results)
    return [r[0] for r in results], [r[1] for r in results]


def test_pipeline_on_4_gloo_ranks_equals_unpipelined(gloo_ranks):
    """Two configurations as 4 gloo processes (SpmdMeshImpl): loss and gradients equal the unpipelined LM's on one
    processor; executed neighbour exchanges as the schedule needs (one step: forward + backward)."""
    import _spmd_pipeline as W

    pipeline_results, _ = gloo_ranks
    for i, (S, M, R, _mesh, layout, _storage) in enumerate(W.SPMD_CASES):
        ref_lm, ref_lw = _reference(S, R)
        ref = _run(ref_lm, ref_lw)
        data = 2 if "batch:data" in layout else 1
        permutes = 2 * (M * R + S - 2)
        for rank, results in enumerate(pipeline_results):
            loss, grads, count, nbytes, _ = results[i]
            _assert_same(S, R, ref, (loss, grads))
            assert count[PERMUTE_KIND, ("pipe",)] == permutes, (rank, count)
            slice_bytes = (CFG["batch_size"] // M // data) * CFG["length"] * CFG["d_model"] * 4
            assert nbytes[PERMUTE_KIND, ("pipe",)] == permutes * slice_bytes, (rank, nbytes)


def memory_config(S):
    """A 4-layer LM whose blocks hold most of the parameters (as at scale), pipelined on S stages (0: not)."""
    return preset("tiny", vocab_size=256, d_model=64, num_heads=4, d_kv=16, d_ff=256, num_layers=4, length=32,
                  batch_size=8, pipeline_stages=S, microbatches=max(S, 1))


def test_parameter_memory_per_rank_with_4_stages(gloo_ranks):
    """Parameter bytes each of 4 gloo ranks holds: with ``stage:pipe;vocab:pipe`` at most 1.05 / 4 of the
    unpipelined model's (replicated on every rank); without ``vocab:pipe`` the embeddings stay replicated over
    ``pipe``. Expected bytes are also counted here from the config, independently of the lowering."""
    _, parameter_results = gloo_ranks
    c = memory_config(4)
    block = 4 * c.d_model * c.num_heads * c.d_kv + 2 * c.d_model * c.d_ff + 2 * c.d_model
    embeddings = 2 * c.vocab_size * c.d_model  # embedding and logits kernel
    other = c.length * c.d_model + c.d_model  # position embedding, final norm
    full = 4 * (c.num_layers * block + embeddings + other)
    assert len(parameter_results) == 4
    for base, stage, stage_vocab in parameter_results:
        assert base == full
        assert stage == 4 * (block + embeddings + other)
        assert stage_vocab == 4 * (block + embeddings // 4 + other)
        assert stage_vocab <= 1.05 / 4 * base, stage_vocab / base  # measured: 238336 / 928000 = 0.257


def test_activation_memory_does_not_grow_with_microbatches():
    """Planned peak activation bytes per processor (fixed batch): with per-iteration recompute, only each iteration's
    state slice is kept, so more microbatches never need more memory, and far less than without recompute."""
    from meshtorch.planning import memory_report

    def peak(M, remat):
        lm = build_lm(preset("tiny", **{**CFG, "length": 32, "batch_size": 16}, num_layers=2, pipeline_stages=2,
                             microbatches=M, pipeline_remat=remat), optimizer=mtf.optim.AdamWOptimizer(1e-2))
        return memory_report(lm.lowering("pipe:2", "stage:pipe"), [lm.loss] + lm.updates).peak_activation_bytes

    with_remat = {M: peak(M, True) for M in (2, 4, 8)}
    assert with_remat[8] <= with_remat[4] <= with_remat[2]
    assert with_remat[4] < 0.5 * peak(4, False)


def test_variable_scope_custom_getter_wraps_and_nests():
    """TF1's ``variable_scope(custom_getter=...)``: get_variable inside returns the getter's result; nested getters
    compose (the inner one sees the outer one's getter); the full scoped name reaches the getter."""
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "mesh")
    seen = []

    def outer(getter, mesh, name, shape, **kw):
        seen.append(("outer", name))
        return getter(mesh, name + "_o", shape, **kw)

    def inner(getter, mesh, name, shape, **kw):
        seen.append(("inner", name))
        return getter(mesh, name + "_i", shape, **kw)

    with mtf.variable_scope("a", custom_getter=outer):
        v1 = mtf.get_variable(mesh, "w", [mtf.Dimension("x", 2)])
        with mtf.variable_scope("b", custom_getter=inner):
            v2 = mtf.get_variable(mesh, "w", [mtf.Dimension("x", 2)])
    v3 = mtf.get_variable(mesh, "w", [mtf.Dimension("x", 2)])
    assert [v.operation.name for v in (v1, v2, v3)] == ["a/w_o", "a/b/w_i_o", "w"]
    assert seen == [("outer", "a/w"), ("inner", "a/b/w"), ("outer", "a/b/w_i")]


def test_pipeline_layer_names_variables_inside_the_enclosing_scope():
    """``layers.pipeline`` on a two-dense stage function inside ``variable_scope("net")``: variables
    ``net/stack/{kind}`` [stage, ...], rows starting as ``net/layer_{i}/{kind}`` would, output equal to the layers
    applied in turn on each microbatch (plain PyTorch)."""
    from meshtorch import layers

    g = mtf.Graph(seed=1)
    mesh = mtf.Mesh(g, "mesh")
    b, mb, h = mtf.Dimension("batch", 2), mtf.Dimension("microbatches", 4), mtf.Dimension("hidden", 4)
    x_val = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))
    x = mtf.import_tensor(mesh, x_val, [b, mb, h])

    def stage_fn(t, name):
        return t + mtf.tanh(layers.dense(t, h, reduced_dims=[h], name=f"{name}/dense"))

    with mtf.variable_scope("net"):
        y = layers.pipeline(stage_fn, x, PipelineSchedule(2, 4, 2), layer_names=lambda i: f"net/layer_{i}")
    lw = mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("pipe:2", "stage:pipe")})
    assert sorted(v.name for v in g.trainable_variables) == ["net/stack/dense/bias", "net/stack/dense/kernel"]
    kernel, bias = lw.variable_value("net/stack/dense/kernel"), lw.variable_value("net/stack/dense/bias")
    assert kernel.shape == (2, 2, 4, 4) and bias.shape == (2, 2, 4)
    want = x_val
    for i in range(4):
        s, r = i % 2, i // 2
        want = want + torch.tanh(want @ kernel[s, r] + bias[s, r])
    torch.testing.assert_close(lw.run(y), want, rtol=1e-5, atol=1e-6)
    g2 = mtf.Graph(seed=1)  # the unstacked layer 3 draws the same initial kernel as row [1, 1]
    w3 = layers.dense(mtf.import_tensor(mtf.Mesh(g2, "mesh"), x_val, [b, mb, h]), h, reduced_dims=[h],
                      name="net/layer_3/dense")
    ref = mtf.Lowering(g2, {w3.mesh: mtf.PlacementMeshImpl("", "")})
    torch.testing.assert_close(ref.variable_value("net/layer_3/dense/kernel"), kernel[1, 1], rtol=0, atol=0)


def test_pipelined_program_as_json_initialises_and_runs():
    """The lowered pipelined LM is data (``Lowering.to_json``): a program read back draws the stacked variables'
    initial values itself (StackedInitializer's kernel is plain data) and computes the same loss."""
    lm = build_lm(_config(2, 4, 2), train=False)
    lw = lm.lowering("pipe:2", "stage:pipe")
    program = mtf.Program.from_json(lw.to_json([lm.loss]))
    impls = {"mesh": mtf.PlacementMeshImpl("pipe:2", "stage:pipe")}
    store = mtf.VariableStore(program, impls)
    for v in lm.graph.trainable_variables:
        assert torch.equal(store.value(v.name), lw.variable_value(v.name)), v.name
    x, y = _data()
    got = mtf.Session(program, impls, store).run((("tensor", lm.loss.name),), {"inputs": x, "targets": y})[0]
    assert torch.equal(got, lw.run(lm.loss, feeds={lm.inputs: x, lm.targets: y}))


def test_pipeline_repeats_default_to_every_layer_stacked():
    """--pipeline-repeats defaults to --layers / stages (all layers in the stack); not dividing stays an error."""
    from meshtorch.core.errors import UsageError
    from meshtorch.runtime.checks import mesh_shape, pipeline_fields
    from meshtorch.runtime.plan_lm import pipeline_fields as plan_fields
    mesh = mesh_shape("--mesh", "pipe:2,data:2")
    got = pipeline_fields("stage:pipe;batch:data", mesh, None, None, None, num_layers=6, batch_size=8)
    assert got == {"pipeline_stages": 2, "microbatches": 2, "pipeline_repeats": 3}
    assert plan_fields("pipe:2,data:2", "stage:pipe;batch:data", num_layers=6)["pipeline_repeats"] == 3
    with pytest.raises(UsageError, match="--layers 5 must equal"):
        pipeline_fields("stage:pipe", mesh, None, None, None, num_layers=5, batch_size=8)

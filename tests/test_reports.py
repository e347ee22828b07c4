"""Reports a person can read (issue 25): the communication summary grouped by layer (or op family) and
collective with totals, per-op detail on request, columns aligned for every collective kind; the storage
rules in train's headers; ``meshtorch plan`` says what hardware its times model."""

import re
from collections import Counter

import meshtorch as mtf
from meshtorch.cli import main
from meshtorch.lowering.counters import op_group
from meshtorch.models.transformer import build_lm, preset
from test_train_cli import SMALL, _args


def _fsdp_tp_counters():
    lm = build_lm(preset("tiny", num_layers=2, d_model=32, num_heads=4, d_kv=8, d_ff=64, length=8, batch_size=4,
                         vocab_size=32), optimizer=mtf.optim.AdamWOptimizer(1e-3))
    impl = mtf.PlacementMeshImpl("data:2,model:2", "batch:data;heads:model;d_ff:model", storage="d_model:data")
    lw = mtf.Lowering(lm.graph, {lm.mesh: impl}, materialize=False)
    return lw.plan_counters([lm.loss] + lm.updates)


def _tables(text):
    """The lines of each table (a header line and its rows) in a summary."""
    tables, cur = [], None
    for ln in text.splitlines()[1:]:
        if ln.startswith("  collective") or ln.startswith("  layer / op family"):
            cur = [ln]
            tables.append(cur)
        elif cur is not None and ln.startswith("  ") and not ln.startswith("  by ") and not ln.startswith("  total"):
            cur.append(ln)
        else:
            cur = None
    return tables


def test_summary_groups_by_layer_and_kind_with_totals_and_aligned_columns():
    c = _fsdp_tp_counters()
    text = c.summary()
    kinds = {r.kind for r in c.records}
    assert {"allgather", "reduce_scatter", "allreduce"} <= kinds  # every kind of the complaint
    tables = _tables(text)
    assert len(tables) == 2 and "by op:" not in text
    for t in tables:
        assert len({len(ln) for ln in t}) == 1, "\n".join(t)  # right-aligned last column: equal widths
        starts = [m.start(1) for m in re.finditer(r"(?:^ *|  )(\S)", t[0])]  # columns: 2+ spaces apart
        for ln in t[1:]:
            for s in starts[:-2]:  # left-aligned columns start where their header does
                assert ln[s - 1] == " " and ln[s] != " ", (s, ln)
    # the grouped counts add up to the records (independent sum over Counters.records)
    want = Counter()
    for r, n in c.records.items():
        want[(op_group(r.op), r.kind, ",".join(r.mesh_axes))] += n
    got = Counter()
    for ln in tables[1][1:]:
        g, k, axes, n = ln.split()[:4]
        got[(g, k, axes)] += int(n)
    assert got == want
    assert len(tables[1]) - 1 < len(c.records)  # fewer rows than ops
    assert f"total: {c.count()} collective calls" in text
    detail = c.summary(detail=True)
    assert "by op:" in detail and all(r.op in detail for r in c.records)


def test_op_group_names_the_layer_or_the_op_family():
    assert op_group("layer_0/attention/q_proj_grad1") == "layer_0/attention"
    assert op_group("layer_3/ffn/wi/kernel") == "layer_3/ffn"
    assert op_group("logits/einsum_grad1") == "logits"
    assert op_group("reduce_sum_25") == "reduce_sum"
    assert op_group("gather_grad") == "gather"
    assert op_group("add_14") == "add"
    assert op_group("loss") == "loss"


def test_train_headers_show_storage_and_plan_states_its_hardware(tmp_path, capsys):
    a = _args("train", *SMALL, "--dropout", "0", "--steps", "2", "--eval-every", "2", "--storage", "d_model:data",
              "--comm-detail", "--plot", str(tmp_path / "loss.png"))
    a.func(a)
    out = capsys.readouterr().out
    assert "storage 'd_model:data'" in out.split("validation sequences")[0]  # the start-up header
    summary = out[out.index("communication over"):]
    assert "storage 'd_model:data'" in summary.splitlines()[1] and "by op:" in summary
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert main(["plan", "--preset", "tiny", "--layers", "1", "--length", "16", "--batch-size", "4", "--vocab", "64",
                 "--mesh", "data:2,model:2", "--hardware", "cpu"]) == 0
    planned = capsys.readouterr().out
    assert "4 real processor(s)" in planned and "one after another" in planned and "4x the compute" in planned

"""Checkpoints: crash safety, exact resume, restore onto other meshes/layouts, bad input, rotation,
and a simulated multi-process (SPMD-style) sharded save."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import safetensors
import safetensors.torch
import torch

import meshtorch as mtf
from _checkpoint_mlp import LAYOUT_A, LAYOUT_B, LAYOUT_C, LAYOUT_D, build, train, values

TESTS = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(TESTS), "src")


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _assert_close_losses(got, want, rtol=1e-5):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert _rel(g, w) <= rtol, (i, g.item(), w.item())


# ------------------------------------------------------------------ (a) crash during a save
_CHILD = """
import os, sys, time
sys.path[:0] = [{src!r}, {tests!r}]
import safetensors.torch as st
import meshtorch as mtf
from _checkpoint_mlp import build, train
m = build({mesh!r}, {layout!r})
train(m, 0, {n1})
mtf.save(m[0], {root!r}, step={n1})
train(m, {n1}, {n2})
orig = st.save_file
def slow(*a, **k):
    orig(*a, **k)
    time.sleep(120)   # the parent kills us here, with one file of the new checkpoint written
st.save_file = slow
mtf.save(m[0], {root!r}, step={n1} + {n2})
"""


def test_sigkill_during_save_then_resume_on_other_mesh(tmp_path):
    n1, n2, n3 = 3, 2, 4
    root = str(tmp_path / "ck")
    code = _CHILD.format(src=SRC, tests=TESTS, mesh=LAYOUT_A[0], layout=LAYOUT_A[1], n1=n1, n2=n2, root=root)
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    tmp = os.path.join(root, f".tmp-ckpt-{n1 + n2}")
    # the uninterrupted run, while the child works
    ref_losses = train(build(*LAYOUT_A), 0, n1 + n2 + n3)
    deadline = time.time() + 120
    while not (os.path.isdir(tmp) and any(f.endswith(".safetensors") for f in os.listdir(tmp))):
        assert child.poll() is None, child.stderr.read().decode()
        assert time.time() < deadline, "child never started its second save"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert not os.path.exists(os.path.join(tmp, "manifest.json"))  # killed half-way
    assert not os.path.exists(os.path.join(root, f"ckpt-{n1 + n2}"))
    assert mtf.latest_checkpoint(root) == os.path.join(root, f"ckpt-{n1}")
    for layout in (LAYOUT_B, LAYOUT_C):
        m = build(*layout, seed=0)
        meta = mtf.restore(m[0], root)  # the root: restore picks the latest complete checkpoint
        assert meta["step"] == n1
        assert m[0].variable_value("global_step").item() == n1
        _assert_close_losses(train(m, n1, n2 + n3), ref_losses[n1:])


# ------------------------------------------------------------------ (b) exact resume
def test_same_layout_resume_is_bitwise(tmp_path):
    m = build(*LAYOUT_A)
    train(m, 0, 4)
    mtf.save(m[0], str(tmp_path), step=4, extra={"data_position": 4})
    ref = train(m, 4, 5)
    m2 = build(*LAYOUT_A, seed=0)
    meta = mtf.restore(m2[0], str(tmp_path / "ckpt-4"))
    assert meta["extra"] == {"data_position": 4}
    got = train(m2, meta["extra"]["data_position"], 5)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    for name, v in values(m[0]).items():
        assert torch.equal(v, m2[0].variable_value(name)), name


def test_resume_on_other_layouts_matches(tmp_path):
    m = build(*LAYOUT_D)
    train(m, 0, 3)
    mtf.save(m[0], str(tmp_path), step=3)
    ref = train(m, 3, 4)
    for layout in (LAYOUT_A, LAYOUT_B):
        m2 = build(*layout)
        mtf.restore(m2[0], str(tmp_path))
        _assert_close_losses(train(m2, 3, 4), ref)


# ------------------------------------------------------------------ (c) values on any mesh/layout
@pytest.mark.parametrize("full", [False, True])
def test_restore_values_equal_on_every_layout(tmp_path, full):
    m = build(*LAYOUT_A)
    train(m, 0, 2)
    want = values(m[0])
    path = mtf.save(m[0], str(tmp_path), step=2, full=full)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    # sharded: only owner slices are written (w1 [io, hidden] split over cols: 2 distinct slices)
    assert files == (["full.safetensors"] if full else ["mesh.p00000.safetensors", "mesh.p00001.safetensors"])
    for layout in (LAYOUT_A, LAYOUT_B, LAYOUT_C, LAYOUT_D, ("all:4", "")):
        m2 = build(*layout, seed=3)
        with pytest.warns(UserWarning, match="seed"):
            mtf.restore(m2[0], path)
        for name, v in want.items():
            got = m2[0].variable_value(name)
            assert got.dtype == v.dtype and torch.equal(got, v), (layout, name)
        # every processor's slice, not only the gathered value
        impl = m2[0].mesh_impl(m2[0]._variable("mlp/w1").outputs[0])
        var = m2[0]._variable("mlp/w1")
        for p, s in enumerate(m2[0].variables[var]):
            assert torch.equal(s, want["mlp/w1"][impl.slice_bounds(var.shape, p)])


def test_restore_permutes_dims_declared_in_another_order(tmp_path):
    m = build(*LAYOUT_A)
    train(m, 0, 2)
    path = mtf.save(m[0], str(tmp_path), step=2)
    w1 = m[0].variable_value("mlp/w1")
    ref = train(m, 2, 3)
    m2 = build(*LAYOUT_B, w1_hidden_first=True)  # mlp/w1 [hidden, io] instead of [io, hidden]
    mtf.restore(m2[0], path)
    assert torch.equal(m2[0].variable_value("mlp/w1"), w1.T)
    _assert_close_losses(train(m2, 2, 3), ref)


def test_set_variable_slices_checks_shape():
    lw = build(*LAYOUT_A)[0]
    with pytest.raises(mtf.FeedError, match=r"mlp/w1.*\[6, 4\].*processor 0"):
        lw.set_variable_slices("mlp/w1", lambda p: torch.zeros(6, 8))
    lw.set_variable_slices("mlp/w1", lambda p: torch.full((6, 4), float(p)))
    assert torch.equal(lw.variable_value("mlp/w1"), torch.cat([torch.zeros(6, 4), torch.ones(6, 4)], 1))


def test_manifest_describes_variables_and_rng(tmp_path):
    m = build(*LAYOUT_A)
    m[0].run_count = 7  # a Lowering that counts its runs gets the count saved and restored
    path = mtf.save(m[0], str(tmp_path), step=0)
    man = json.load(open(os.path.join(path, "manifest.json")))
    assert man["meshes"]["mesh"] == {"shape": "rows:2;cols:2", "layout": "batch:rows;hidden:cols", "storage": "",
                                     "impl": "PlacementMeshImpl"}
    assert man["step"] == 0 and man["format_version"] == 1 and man["meshtorch_version"] == mtf.__version__
    assert man["rng"] == {"graph_seed": 0, "run_count": 7}
    w1 = man["variables"]["mlp/w1"]
    assert w1["shape"] == [["io", 6], ["hidden", 8]] and w1["dtype"] == "float32"
    assert w1["layout"] == [None, "cols"]
    assert sorted((r["file"], tuple(r["begin"])) for r in w1["regions"]) == [
        ("mesh.p00000.safetensors", (0, 0)), ("mesh.p00001.safetensors", (0, 4))]
    assert man["variables"]["mlp/w1/momentum"]["trainable"] is False
    assert man["variables"]["global_step"]["dtype"] == "int64"
    m2 = build(*LAYOUT_B)
    m2[0].run_count = 0
    mtf.restore(m2[0], path)
    assert m2[0].run_count == 7


# ------------------------------------------------------------------ simulated SPMD: one process per pnum
class _RankView(mtf.PlacementMeshImpl):
    """A placement mesh that pretends to be rank ``rank`` of an SPMD run: it reports (and, when
    ``only_local``, fills) only its own processor's slice, synchronises through ``barrier`` and leads
    on rank 0 (the ``MeshImpl`` interface checkpoints use)."""

    def __init__(self, shape, layout, rank, barrier):
        super().__init__(shape, layout)
        self.local_pnums = [rank]
        self._bar = barrier
        self.only_local = False

    def barrier(self):
        self._bar.wait(timeout=60)

    def is_leader(self):
        return self.local_pnums[0] == 0

    def local_slices(self, x):
        return [x[self.local_pnums[0]]]

    def laid_out_constant(self, fn):
        if not self.only_local:
            return super().laid_out_constant(fn)
        return [fn(p) if p == self.local_pnums[0] else None for p in range(self.size)]


def _rank_lowerings(mesh_shape, layout, nranks, src=None):
    bar = threading.Barrier(nranks)
    out = []
    for r in range(nranks):
        m = build(mesh_shape, layout)
        m[0].mesh_to_impl = {mesh: _RankView(mesh_shape, layout, r, bar) for mesh in m[0].mesh_to_impl}
        if src is not None:
            for name, v in values(src).items():
                m[0].set_variable_value(name, v)
        out.append(m[0])
    return out


def _in_threads(fn, args):
    errors = []

    def run(a):
        try:
            fn(*a)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def test_multi_rank_sharded_save_and_partial_restore(tmp_path, monkeypatch):
    m = build(*LAYOUT_B)  # w1 [io, hidden] split 4 ways over "all"
    train(m, 0, 2)
    want = values(m[0])
    ranks = _rank_lowerings(*LAYOUT_B, 4, src=m[0])
    _in_threads(lambda lw: mtf.save(lw, str(tmp_path), step=2), [(lw,) for lw in ranks])
    path = os.path.join(str(tmp_path), "ckpt-2")
    assert sorted(f for f in os.listdir(path) if f.startswith("index-")) == [f"index-p{r:05d}.json" for r in range(4)]
    with pytest.raises(mtf.CheckpointError, match="full=True"):
        mtf.save(ranks[1], str(tmp_path), step=3, full=True)  # a rank cannot write full tensors alone
    # a placement run (all processors in one process) restores it on another mesh
    m2 = build(*LAYOUT_A)
    mtf.restore(m2[0], path)
    assert all(torch.equal(m2[0].variable_value(n), v) for n, v in want.items())
    # a "2-rank" run: each rank reads only the files that overlap its slices
    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda p, **k: opened.append(os.path.basename(p))
                        or real_open(p, **k))
    two = _rank_lowerings("all:2", "hidden:all", 2)
    for r, lw in enumerate(two):
        for impl in lw.mesh_to_impl.values():
            impl.only_local = True
        opened.clear()
        mtf.restore(lw, path)
        var = lw._variable("mlp/w1")
        got = lw.variables[var]
        assert got[1 - r] is None  # the other rank's slice was never built
        assert torch.equal(got[r], want["mlp/w1"][:, 4 * r:4 * r + 4])
        # w1's hidden half r lies in the saved 4-way slices 2r, 2r+1; replicated variables sit in p0
        assert set(opened) <= {"mesh.p00000.safetensors", f"mesh.p{2 * r:05d}.safetensors",
                               f"mesh.p{2 * r + 1:05d}.safetensors"}, opened
        assert f"mesh.p{2 * r + 1:05d}.safetensors" in opened


# ------------------------------------------------------------------ (d) bad input
@pytest.fixture
def saved(tmp_path):
    m = build(*LAYOUT_A)
    train(m, 0, 1)
    return m, mtf.save(m[0], str(tmp_path / "ck"), step=1)


def test_truncated_file(saved):
    _, path = saved
    f = os.path.join(path, "mesh.p00001.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    for verify in (True, False):
        with pytest.raises(mtf.CheckpointError, match=r"mesh\.p00001\.safetensors.*mlp/w1.*truncated"):
            mtf.restore(build(*LAYOUT_B)[0], path, verify=verify)


def test_corrupt_file(saved):
    _, path = saved
    f = os.path.join(path, "mesh.p00001.safetensors")
    data = bytearray(open(f, "rb").read())
    data[-3] ^= 0xFF  # a flipped bit in the tensor data: only the checksum sees it
    open(f, "wb").write(bytes(data))
    with pytest.raises(mtf.CheckpointError, match=r"mesh\.p00001\.safetensors.*mlp/w1.*sha256"):
        mtf.restore(build(*LAYOUT_B)[0], path)
    data[8:40] = b"\x00" * 32  # a corrupt header, same size: safetensors cannot parse it
    open(f, "wb").write(bytes(data))
    with pytest.raises(mtf.CheckpointError, match=r"variable 'mlp/w1' from .*mesh\.p00001\.safetensors"):
        mtf.restore(build(*LAYOUT_B)[0], path, verify=False)


def test_missing_file_and_corrupt_manifest(saved):
    _, path = saved
    os.remove(os.path.join(path, "mesh.p00001.safetensors"))
    with pytest.raises(mtf.CheckpointError, match=r"mesh\.p00001\.safetensors.*mlp/w1.*missing"):
        mtf.restore(build(*LAYOUT_C)[0], path)
    open(os.path.join(path, "manifest.json"), "w").write('{"format": "meshtorch-checkpoint", "vari')
    with pytest.raises(mtf.CheckpointError, match=r"manifest.json.*corrupt"):
        mtf.restore(build(*LAYOUT_C)[0], path)
    os.remove(os.path.join(path, "manifest.json"))  # e.g. the temporary directory of a killed save
    with pytest.raises(mtf.CheckpointError, match="not a complete checkpoint"):
        mtf.restore(build(*LAYOUT_C)[0], path)


def test_missing_variable_and_shape_and_dtype_mismatch(saved):
    m, path = saved
    with pytest.raises(mtf.CheckpointError, match=r"mlp/extra.*not in checkpoint"):
        mtf.restore(build(*LAYOUT_C, extra_var=True)[0], path)
    m2 = build(*LAYOUT_C, extra_var=True)
    before = m2[0].variable_value("mlp/extra")
    meta = mtf.restore(m2[0], path, strict=False)
    assert meta["missing"] == ["mlp/extra"] and torch.equal(m2[0].variable_value("mlp/extra"), before)
    assert torch.equal(m2[0].variable_value("mlp/w1"), m[0].variable_value("mlp/w1"))
    m3 = build(*LAYOUT_C, hidden=12)
    before = values(m3[0])
    with pytest.raises(mtf.CheckpointError, match=r"mlp/w1.*\[io:6, hidden:8\].*\[io:6, hidden:12\]"):
        mtf.restore(m3[0], path)
    assert all(torch.equal(v, m3[0].variable_value(n)) for n, v in before.items())  # nothing half-restored
    with pytest.raises(mtf.CheckpointError, match=r"global_step.*int64.*int32"):
        mtf.restore(build(*LAYOUT_C, step_dtype=torch.int32)[0], path)
    with pytest.raises(mtf.CheckpointError, match="no complete checkpoint"):
        mtf.restore(build(*LAYOUT_C)[0], os.path.dirname(os.path.dirname(path)))


def test_failed_save_leaves_previous_checkpoint(saved, monkeypatch):
    m, path = saved
    root = os.path.dirname(path)
    want = values(m[0])
    train(m, 1, 2)
    calls = []
    real = safetensors.torch.save_file

    def failing(tensors, filename, *a, **k):
        calls.append(filename)
        real(tensors, filename, *a, **k)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    for step in (3, 1):  # a new step, and the same step as the good checkpoint
        calls.clear()
        with pytest.raises(mtf.CheckpointError, match="disk full"):
            mtf.save(m[0], root, step=step, keep=1)
        assert len(calls) == 2
        assert sorted(os.listdir(root)) == ["ckpt-1"]  # no temp dir, nothing rotated away
        m2 = build(*LAYOUT_B)
        assert mtf.restore(m2[0], root)["step"] == 1
        assert all(torch.equal(m2[0].variable_value(n), v) for n, v in want.items())


def test_bad_arguments(tmp_path):
    lw = build(*LAYOUT_C)[0]
    for kw in ({"step": -1}, {"step": 1.5}, {"step": 1, "keep": 0}, {"step": 1, "extra": {"x": object()}}):
        with pytest.raises(mtf.CheckpointError):
            mtf.save(lw, str(tmp_path), **kw)
    assert mtf.latest_checkpoint(str(tmp_path)) is None


# ------------------------------------------------------------------ (e) rotation
def test_keep_last_n_and_latest_ignores_incomplete(tmp_path):
    root = str(tmp_path)
    m = build(*LAYOUT_C)
    for step in (1, 2, 3, 4):
        train(m, step, 1)
        mtf.save(m[0], root, step=step, keep=2)
    assert sorted(os.listdir(root)) == ["ckpt-3", "ckpt-4"]
    os.makedirs(os.path.join(root, ".tmp-ckpt-9"))  # an unfinished save
    os.makedirs(os.path.join(root, "ckpt-8"))  # no manifest: incomplete
    assert mtf.latest_checkpoint(root) == os.path.join(root, "ckpt-4")
    want = values(m[0])
    mtf.save(m[0], root, step=4, keep=3)  # re-saving a step replaces it
    assert mtf.latest_checkpoint(root) == os.path.join(root, "ckpt-4")
    assert not os.path.exists(os.path.join(root, ".tmp-ckpt-9"))  # stale temp dirs are cleaned
    m2 = build(*LAYOUT_A)
    assert mtf.restore(m2[0], root)["step"] == 4
    assert all(torch.equal(m2[0].variable_value(n), v) for n, v in want.items())
    # a crash while re-saving step 4, between moving ckpt-4 aside and renaming the new one in
    os.replace(os.path.join(root, "ckpt-4"), os.path.join(root, ".old-ckpt-4"))
    assert mtf.latest_checkpoint(root) == os.path.join(root, ".old-ckpt-4")
    mtf.save(m[0], root, step=5)  # the next save puts ckpt-4 back
    assert sorted(f for f in os.listdir(root) if "ckpt-" in f) == ["ckpt-3", "ckpt-4", "ckpt-5", "ckpt-8"]


# ------------------------------------------------------------------ (f) torch state-dict interchange
R, C, H, K = 4, 4, 8, 4  # image rows, cols, hidden, classes
NAME_MAP = {"mnist/w1": ("fc1.weight", "hidden (rows cols)"), "mnist/b1": "fc1.bias",
            "mnist/w2": ("fc2.weight", "classes hidden"), "mnist/b2": "fc2.bias"}


def _mnist(mesh_shape, layout, seed=0):
    g = mtf.Graph(seed=seed)
    mesh = mtf.Mesh(g, "mesh")
    batch, rows, cols = mtf.Dimension("batch", 8), mtf.Dimension("rows", R), mtf.Dimension("cols", C)
    hidden, classes = mtf.Dimension("hidden", H), mtf.Dimension("classes", K)
    x = mtf.placeholder(mesh, "images", [batch, rows, cols])
    w1 = mtf.get_variable(mesh, "mnist/w1", [rows, cols, hidden])
    b1 = mtf.get_variable(mesh, "mnist/b1", [hidden], initializer=mtf.random_normal_initializer())
    w2 = mtf.get_variable(mesh, "mnist/w2", [hidden, classes])
    b2 = mtf.get_variable(mesh, "mnist/b2", [classes], initializer=mtf.random_normal_initializer())
    h = mtf.relu(mtf.einsum([x, w1], output_shape=[batch, hidden]) + b1)
    logits = mtf.einsum([h, w2], output_shape=[batch, classes]) + b2
    return mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl(mesh_shape, layout)}), x, logits


class _TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(R * C, H)
        self.fc2 = torch.nn.Linear(H, K)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@pytest.mark.parametrize("layout", [LAYOUT_C, ("all:4", "hidden:all"), ("rows:2;cols:2", "batch:rows;hidden:cols"),
                                    ("rows:2;cols:2", "hidden:rows;classes:cols")])
def test_state_dict_interchange_with_nn_module(layout):
    lw, x, logits = _mnist(*layout)
    images = torch.randn(8, R, C, generator=torch.Generator().manual_seed(5))
    mine = lw.run(logits, feeds={x: images})
    net = _TorchMLP()
    net.load_state_dict(mtf.to_torch_state_dict(lw, NAME_MAP), strict=True)
    with torch.no_grad():
        assert _rel(net(images), mine) <= 1e-5
        # and back: a torch model with other weights, loaded into meshtorch
        torch.manual_seed(11)
        net2 = _TorchMLP()
        assert _rel(net2(images), mine) > 1e-2  # really different weights
        res = mtf.from_torch_state_dict(lw, net2.state_dict(), NAME_MAP)
        assert sorted(res["loaded"]) == sorted(NAME_MAP)
        assert _rel(lw.run(logits, feeds={x: images}), net2(images)) <= 1e-5
        w1 = lw.variable_value("mnist/w1")
        assert torch.equal(w1, net2.fc1.weight.reshape(H, R, C).permute(1, 2, 0))


def test_state_dict_default_names_round_trip():
    src = build(*LAYOUT_A)
    train(src, 0, 2)
    sd = mtf.to_torch_state_dict(src[0])
    assert set(sd) == {"mlp.w1", "mlp.b1", "mlp.w2", "mlp.w1.momentum", "mlp.b1.momentum", "mlp.w2.momentum",
                       "global_step"}
    assert sd["mlp.w1"].shape == (6, 8)  # the variable's dim order [io, hidden]
    dst = build(*LAYOUT_B, seed=4)
    mtf.from_torch_state_dict(dst[0], sd)
    for n, v in values(src[0]).items():
        assert torch.equal(dst[0].variable_value(n), v)


def test_state_dict_errors():
    lw = _mnist(*LAYOUT_C)[0]
    sd = mtf.to_torch_state_dict(lw, NAME_MAP)
    bad = dict(sd, **{"fc1.weight": torch.zeros(H, R * C + 1)})
    with pytest.raises(mtf.CheckpointError, match=r"fc1\.weight.*mnist/w1"):
        mtf.from_torch_state_dict(lw, bad, NAME_MAP)
    with pytest.raises(mtf.CheckpointError, match=r"mnist/b2.*fc2\.bias"):
        mtf.from_torch_state_dict(lw, {k: v for k, v in sd.items() if k != "fc2.bias"}, NAME_MAP)
    with pytest.raises(mtf.CheckpointError, match="unexpected keys \\['extra'\\]"):
        mtf.from_torch_state_dict(lw, dict(sd, extra=torch.zeros(1)), NAME_MAP)
    res = mtf.from_torch_state_dict(lw, dict(sd, extra=torch.zeros(1)), NAME_MAP, strict=False)
    assert res["unexpected"] == ["extra"]
    with pytest.raises(mtf.CheckpointError, match="each of the variable's dims"):
        mtf.to_torch_state_dict(lw, {"mnist/w1": ("w", "hidden (rows)")})
    with pytest.raises(mtf.CheckpointError, match="nope"):
        mtf.to_torch_state_dict(lw, {"nope": "w"})


# ------------------------------------------------------------------ real processes: 4 gloo ranks save
_RANK = """
import sys
sys.path[:0] = [{src!r}, {tests!r}]
import torch.distributed as dist
import meshtorch as mtf
from _checkpoint_mlp import build, train
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=4)


class RankView(mtf.PlacementMeshImpl):  # holds (reports) only this rank's slice, like an SPMD mesh
    local_pnums = [rank]

    def local_slices(self, x):
        return [x[rank]]

    def barrier(self):  # the MeshImpl interface, as SpmdMeshImpl implements it
        dist.barrier()

    def is_leader(self):
        return rank == 0


m = build({mesh!r}, {layout!r})
train(m, 0, 2)
m[0].mesh_to_impl = {{k: RankView({mesh!r}, {layout!r}) for k in m[0].mesh_to_impl}}
mtf.save(m[0], {root!r}, step=2)
dist.destroy_process_group()
"""


def test_four_gloo_processes_save_placement_restores(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(tmp_path / "ck")
    code = _RANK.format(src=SRC, tests=TESTS, port=port, mesh=LAYOUT_B[0], layout=LAYOUT_B[1], root=root)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=subprocess.PIPE) for r in range(4)]
    ref = build(*LAYOUT_B)
    train(ref, 0, 2)
    for p in procs:
        assert p.wait(timeout=180) == 0, p.stderr.read().decode()
    path = os.path.join(root, "ckpt-2")
    assert sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) == [
        f"mesh.p{r:05d}.safetensors" for r in range(4)]
    for layout in (LAYOUT_A, LAYOUT_C):
        m = build(*layout)
        mtf.restore(m[0], path)
        for n, v in values(ref[0]).items():
            assert torch.equal(m[0].variable_value(n), v), (layout, n)

"""Checkpoints and interchange across storage layouts (issue 12): saved under FSDP on 4 gloo ranks (each
rank writes only its shards), restored replicated in one process and on a 2x2 mesh with other compute and
storage rules; training continues with the losses of an uninterrupted run; the plain-PyTorch state dict
is the same whatever the storage layout."""

from __future__ import annotations

import json
import os

import pytest
import torch

import meshtorch as mtf
from _fsdp import CFG, CKPT_STEPS, LAYOUTS, TP, build, data, train
from meshtorch.testing import rel_error
from meshtorch.testing.spmd import run_spmd
from meshtorch.testing.torch_lm import TorchLM

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
RESTORE_ONTO = [("", "", ""), ("data:2,model:2", TP, "d_ff:data;vocab:data")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, once_per_run):
    """(checkpoint directory, per-rank results); once per test run: the tests only read the checkpoint."""
    def save():
        root = str(tmp_path_factory.mktemp("fsdp") / "ckpt")
        return root, run_spmd("_fsdp:ckpt_save_worker", args=(root,), nprocs=4, timeout_s=300,
                              extra_path=[TESTS_DIR]).check().results

    return once_per_run("test_fsdp_checkpoint_saved", save)


def _uninterrupted():
    """The independent reference: CKPT_STEPS + 1 steps replicated in one process, no checkpoint."""
    return train(mtf.PlacementMeshImpl("", ""), "adamw_clip", steps=CKPT_STEPS + 1)


def test_fsdp_checkpoint_holds_shards_and_names_the_storage_rules(saved):
    root, results = saved
    losses, values, _, final, local = results[0]
    assert local[0] == [CFG.padded_vocab, CFG.d_model // 4]  # embedding [vocab, d_model]: a quarter of d_model
    for r in results[1:]:
        assert r[0] == losses and all(torch.equal(r[1][n], values[n]) for n in values)
    manifest = json.load(open(os.path.join(final, "manifest.json")))
    assert manifest["meshes"]["mesh"]["storage"] == "d_model:data"
    # every variable with d_model (weights and their AdamW moments) was held and written as quarters
    sharded = 0
    for name, v in manifest["variables"].items():
        dims = [d for d, _ in v["shape"]]
        if "d_model" in dims:
            sharded += 1
            assert v["layout"] == ["data" if d == "d_model" else None for d in dims], name
            assert len(v["regions"]) == 4, name
            for reg in v["regions"]:
                assert reg["size"] == [s // 4 if d == "d_model" else s for d, s in v["shape"]], name
    assert sharded == 3 * len(build("adamw_clip")[1])
    for rank_local in (r[4] for r in results):  # what each rank held: a quarter of d_model
        assert rank_local == local
    ref_losses, _, _ = _uninterrupted()
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=False)) <= 1e-6


@pytest.mark.parametrize("mesh_shape,layout,storage", RESTORE_ONTO, ids=["replicated", "2x2_other_storage"])
def test_restore_onto_other_layouts_and_keep_training(saved, mesh_shape, layout, storage):
    root, results = saved
    _, values, _, _, _ = results[0]
    lm, _, _, updates = build("adamw_clip")
    lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)})
    meta = mtf.restore(lw, root)
    assert meta["step"] == CKPT_STEPS and not meta["missing"] and not meta["unused"]
    assert set(lw.variable_names) == set(values)  # parameters, both AdamW moments, global_step
    for n in values:
        assert torch.equal(lw.variable_value(n), values[n]), n
    x, y = data(CKPT_STEPS)
    next_loss = lw.run([lm.loss] + updates, feeds={lm.inputs: x, lm.targets: y})[0].item()
    ref_losses, _, _ = _uninterrupted()
    assert abs(next_loss - ref_losses[CKPT_STEPS]) <= 1e-6 * abs(ref_losses[CKPT_STEPS])


def test_torch_state_dict_is_the_same_under_every_storage_layout(saved):
    root, results = saved
    _, values, fsdp_sd, _, _ = results[0]
    # the state dict a 4-rank FSDP run exports loads into plain PyTorch and gives meshtorch's logits
    model = TorchLM(CFG)
    model.load_state_dict(fsdp_sd, strict=True)
    for mesh_shape, layout, storage in [*RESTORE_ONTO, LAYOUTS["fsdp"]]:
        lm, *_ = build("adamw_clip")
        lw = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl(mesh_shape, layout, storage=storage)})
        mtf.restore(lw, root)
        sd = mtf.to_torch_state_dict(lw, trainable_only=True)
        assert sd.keys() == fsdp_sd.keys()
        assert all(torch.equal(sd[k], fsdp_sd[k]) for k in sd), (mesh_shape, storage)
        x, _ = data(7)
        got = lw.run(lm.logits, feeds={lm.inputs: x, lm.targets: x})
        assert rel_error(got, model(x).detach()) <= 1e-5, (mesh_shape, storage)
        # and back in: a perturbed torch state dict loads into the sharded variables
        with torch.no_grad():
            perturbed = {k: v * 1.5 for k, v in fsdp_sd.items()}
        info = mtf.from_torch_state_dict(lw, perturbed, trainable_only=True)
        assert not info["missing"]
        for k, v in mtf.to_torch_state_dict(lw, trainable_only=True).items():
            assert torch.equal(v, perturbed[k]), k

"""Gradient buckets on by default on the SPMD mesh (issue 21): DDP's 25 MiB with its 1 MiB first bucket, same
losses as without."""

import argparse
import os

import torch

import meshtorch as mtf
from meshtorch.cli.train import add_train_subcommand
from meshtorch.testing.spmd import run_spmd

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_spmd_lowering_buckets_gradients_by_default_with_unchanged_losses():
    res = run_spmd("_bucket_defaults:worker", nprocs=2, timeout_s=300, extra_path=[TESTS]).check().results
    for r in res:
        bb, losses, buckets = r["default"]
        assert bb == 25 * 2 ** 20 and buckets == 1  # the two gradient all-reduces go in one bucket
        off_bb, off_losses, off_buckets = r["off"]
        assert off_bb == 0 and off_buckets == 0
        torch.testing.assert_close(losses, off_losses, rtol=1e-6, atol=0)


def test_placement_default_and_cli_default():
    g = mtf.Graph()
    mesh = mtf.Mesh(g, "m")
    mtf.get_variable(mesh, "w", "a:4")
    assert mtf.Lowering(g, {mesh: mtf.PlacementMeshImpl("all:2", "")}).session.bucket_bytes == 0
    p = argparse.ArgumentParser()
    add_train_subcommand(p.add_subparsers(dest="cmd"))
    assert p.parse_args(["train"]).bucket_mb is None  # the Lowering's default (DDP's)
    assert p.parse_args(["train", "--bucket-mb", "4"]).bucket_mb == 4.0


def _deep_mlp(layers=8, h=256):
    """A data-parallel MLP of ``layers`` [h, h] float32 weights (256 KiB of gradient each at h=256)."""
    g = mtf.Graph(seed=0)
    mesh = mtf.Mesh(g, "m")
    b, hid = mtf.Dimension("batch", 4), mtf.Dimension("hidden", h)
    x = mtf.placeholder(mesh, "x", [b, hid])
    ws = [mtf.get_variable(mesh, f"w{i}", [hid, mtf.Dimension(f"h{i}", h)]) for i in range(layers)]
    y = x
    for w in ws:
        y = mtf.rename_dimension(mtf.tanh(mtf.einsum([y, w], output_shape=[b, w.shape[1]])), w.shape[1].name, "hidden")
    loss = mtf.reduce_mean(mtf.square(y - x))
    updates = mtf.optim.SgdOptimizer(0.5).apply_grads(mtf.gradients([loss], ws), ws)
    return g, mesh, x, ws, loss, updates


def test_first_bucket_closes_at_1_mib_and_starts_mid_backward():
    """As DDP with its default bucket_cap_mb: the first gradient bucket closes once it holds 1 MiB (the last four
    layers' gradients here) and is issued before the earlier layers' gradients are computed; the rest share one
    25 MiB bucket. A given bucket_bytes has no smaller first bucket. Losses equal the unbucketed run's."""
    losses = {}
    for name, kw in (("default", {}), ("given", {"bucket_bytes": 25 * 2 ** 20}), ("off", {"bucket_bytes": 0})):
        g, mesh, x, ws, loss, updates = _deep_mlp()
        impl = mtf.PlacementMeshImpl("data:2", "batch:data")
        impl.default_bucket_bytes = 25 * 2 ** 20  # the SPMD mesh's default, on the placement mesh
        lw = mtf.Lowering(g, {mesh: impl}, **kw)
        plan = lw.session.plan(lw._fetch_keys([loss] + updates))
        buckets = [st for st in plan.steps if st.kind == "allreduce_bucket"]
        sizes = [sorted(m.bytes_per_processor for m in st.members) for st in buckets]
        grad = 256 * 256 * 4
        if name == "default":
            assert lw.session.first_bucket_bytes == 2 ** 20
            # the loss's scalar sum (ready in the forward pass) and four gradients reach 1 MiB; then the other four
            assert sizes == [[4] + [grad] * 4, [grad] * 4], sizes
            first = plan.steps.index(buckets[0])
            # the first bucket is issued before the gradient einsum of w3 (an input of the second bucket's members)
            w3_grad = min(i for i, st in enumerate(plan.steps) if st.outputs and st.outputs[0] in buckets[1].inputs)
            assert first < w3_grad, (first, w3_grad)
        elif name == "given":
            assert lw.session.first_bucket_bytes == 0 and sizes == [[4] + [grad] * 8], sizes
        else:
            assert sizes == []
        feeds = [torch.randn(4, 256, generator=torch.Generator().manual_seed(s)) for s in range(3)]
        losses[name] = [lw.run([loss] + updates, feeds={x: f})[0].item() for f in feeds]
    assert losses["default"] == losses["given"] == losses["off"], losses


class _BucketingPlacement(mtf.PlacementMeshImpl):
    """A placement mesh with the SPMD mesh's default buckets (DDP's 25 MiB), to plan the default on one process."""

    default_bucket_bytes = 25 * 2 ** 20


def test_default_buckets_are_off_when_a_16_bit_tensor_is_all_reduced():
    """The record's ``fp32_default_buckets`` rule: a data-parallel bf16 gradient all-reduce turns the Lowering's
    default buckets off; the same graph in float32 keeps them; an explicit size is kept either way."""
    def lowering(dtype, **kw):
        g = mtf.Graph()
        mesh = mtf.Mesh(g, "m")
        x = mtf.placeholder(mesh, "x", "b:4,h:8", dtype=dtype)
        w = mtf.get_variable(mesh, "w", "h:8,o:2", dtype=dtype)
        loss = mtf.reduce_sum(mtf.einsum([x, w], output_shape="o:2"))
        mtf.optim.SgdOptimizer(0.1).apply_grads(mtf.gradients([loss], [w]), [w])  # the update reduces the gradient
        return mtf.Lowering(g, {mesh: _BucketingPlacement("all:2", "b:all")}, materialize=False, **kw)
    assert lowering(torch.float32).session.bucket_bytes == 25 * 2 ** 20
    assert lowering(torch.bfloat16).session.bucket_bytes == 0
    assert lowering(torch.bfloat16, bucket_bytes=1 << 20).session.bucket_bytes == 1 << 20

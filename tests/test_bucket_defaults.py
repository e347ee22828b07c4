"""Gradient buckets on by default on the SPMD mesh (issue 21): DDP's 25 MiB, same losses as without."""

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
    assert p.parse_args(["train"]).bucket_mb == 25.0

"""Subprocess jobs of tests/test_faults.py: a save on a full file system (a small tmpfs mounted in a user
namespace, or, where that is not possible, a file-size limit, RLIMIT_FSIZE)."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _checkpoint_mlp as M  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint.format import verify_checkpoint  # noqa: E402


def _fill(root: str) -> str:
    """Write a file until the file system is full (ENOSPC); returns its path."""
    path = os.path.join(root, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return path


def disk_full(root: str, mode: str) -> dict:
    """Save ckpt-1 (keep=1), fill the disk (``mode="tmpfs"``) or limit file sizes (``"fsize"``), try to save
    step 2 and step 1 again; report the errors, the directory listing, whether ckpt-1 verifies and restores
    bitwise, then free the space and save step 2 (retention keeps one checkpoint)."""
    m = M.build(*M.LAYOUT_A)
    M.train(m, 0, 1)
    good = mtf.save(m[0], os.path.join(root, "ck"), step=1, keep=1)
    want = M.values(m[0])
    M.train(m, 1, 2)
    filler = None
    if mode == "tmpfs":
        filler = _fill(root)
    else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    errors, listings, restored = [], [], []
    for step in (2, 1):
        try:
            mtf.save(m[0], os.path.join(root, "ck"), step=step, keep=1)
            errors.append(None)
        except mtf.CheckpointError as e:
            errors.append(str(e))
        listings.append(sorted(os.listdir(os.path.join(root, "ck"))))
        verify_checkpoint(good)
        m2 = M.build(*M.LAYOUT_B)
        meta = mtf.restore(m2[0], os.path.join(root, "ck"))
        restored.append(meta["step"] == 1 and all(torch.equal(m2[0].variable_value(n), v) for n, v in want.items()))
    if filler:
        os.remove(filler)
    else:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    mtf.save(m[0], os.path.join(root, "ck"), step=2, keep=1)
    return {"good": good, "errors": errors, "listings": listings, "restored": restored,
            "after": sorted(os.listdir(os.path.join(root, "ck")))}


if __name__ == "__main__":
    print(json.dumps(disk_full(sys.argv[1], sys.argv[2])))


def failing_rank_save(path: str):
    """2 ranks on ``all:2`` / ``hidden:all``: save step 1, then save step 2 where rank 1's file write fails
    with ENOSPC. Returns (this rank's error line or None, the listing of ``path`` after it)."""
    import errno

    import safetensors.torch
    import torch.distributed as dist

    from meshtorch.mesh import make_mesh_impl

    model = M.build("all:2", "hidden:all", make_impl=make_mesh_impl)
    M.train(model, 0, 1)
    mtf.save(model[0], path, step=1, keep=1)
    real = safetensors.torch.save_file

    def full_disk(tensors, filename, *a, **k):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, *a, **k)

    safetensors.torch.save_file = full_disk
    try:
        mtf.save(model[0], path, step=2, keep=1)
        err = None
    except mtf.CheckpointError as e:
        err = str(e)
    finally:
        safetensors.torch.save_file = real
    dist.barrier()
    verify_checkpoint(os.path.join(path, "ckpt-1"))
    return err, sorted(os.listdir(path))

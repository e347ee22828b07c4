"""Checkpoint format: constants, manifest reading, the process topology of a mesh, and finding
complete checkpoints. Shared by :mod:`meshtorch.checkpoint.save` and
:mod:`meshtorch.checkpoint.restore`; the format is described in ``docs/checkpoints.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import torch

from meshtorch.core.errors import CheckpointError

FORMAT = "meshtorch-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


# ===================================================================== process topology
def _local_pnums(impl) -> list[int]:
    """Processors whose slices this process holds, in the order ``impl.local_slices`` returns them
    (``MeshImpl.local_pnums``; a list attribute of that name is accepted too)."""
    lp = impl.local_pnums
    return list(lp() if callable(lp) else lp)


def _impls(lowering) -> list:
    return list(dict.fromkeys(lowering.mesh_to_impl.values()))


def _multi_process(lowering) -> bool:
    return any(len(_local_pnums(i)) < i.size for i in _impls(lowering))


def _is_leader(lowering) -> bool:
    """True in the process that writes the manifest (``MeshImpl.is_leader`` of the first mesh)."""
    impls = _impls(lowering)
    return not impls or impls[0].is_leader()


def _barrier(lowering):
    """``MeshImpl.barrier`` of the first mesh, when its processors live in several processes."""
    if _multi_process(lowering):
        _impls(lowering)[0].barrier()


# ===================================================================== small helpers
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fsync_path(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def io_cause(exc: BaseException) -> str:
    """The operating system's words for why a write failed (``"no space left on device"``, ``"file too
    large"``, ``"input/output error"``), from an OSError's errno or the ``Os { code: N }`` that safetensors'
    Rust writer reports; otherwise the exception's first line."""
    code = getattr(exc, "errno", None)
    if not code:
        m = re.search(r"(?:\bcode: |\(os error )(\d+)", str(exc))
        code = int(m.group(1)) if m else None
    if code:
        return os.strerror(code).lower()
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]


def check_file(ckpt: str, fname: str, info: dict, sha: bool = True, what: str = "") -> None:
    """File ``fname`` of checkpoint ``ckpt`` exists with the manifest's size ``info["bytes"]`` (and, if
    ``sha``, its sha256 ``info["sha256"]``).

    Raises:
        CheckpointError: naming the file (and ``what``, e.g. the variable it holds): missing, truncated, corrupt.
    """
    path = os.path.join(ckpt, fname)
    if not os.path.isfile(path):
        raise CheckpointError(f"restore: file {path!r}{what} is missing.")
    size = os.path.getsize(path)
    if size != info["bytes"]:
        raise CheckpointError(f"restore: file {path!r}{what} has {size} bytes but the manifest says "
                              f"{info['bytes']}: it is truncated or corrupt.")
    if sha and _sha256(path) != info["sha256"]:
        raise CheckpointError(f"restore: file {path!r}{what} does not match its sha256 in the manifest: "
                              "it is corrupt.")


def verify_checkpoint(path: str) -> dict:
    """Check a checkpoint directory: its manifest parses and every file it lists has its size and sha256.
    Returns the manifest.

    Raises:
        CheckpointError: naming the manifest or the first bad file.
    """
    m = load_manifest(path)
    for fname, info in sorted((m.get("files") or {}).items()):
        check_file(path, fname, info)
    return m


def _write_json(path: str, obj):
    """Write ``obj`` as JSON and fsync it (an OSError names ``path``)."""
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        e.filename = e.filename or path
        raise


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _var_table(lowering) -> list:
    """``[(variable op, its output Tensor, MeshImpl, layout)]`` in graph order, without transient variables
    (an op with ``transient = True``: ``--accumulate``'s gradient accumulators, overwritten by each step's first
    microbatch, so a checkpoint has nothing to keep of them)."""
    rows = []
    for var in lowering.variables:
        if getattr(var, "transient", False):
            continue
        out = var.outputs[0]
        rows.append((var, out, lowering.mesh_impl(out), lowering.tensor_layout(out)))
    return rows


def _mesh_name(lowering, impl) -> str:
    for mesh, i in lowering.mesh_to_impl.items():
        if i is impl:
            return mesh.name
    return "mesh"


def _shard_file(mesh_name: str, pnum: int) -> str:
    return f"{_SAFE_NAME.sub('_', mesh_name)}.p{pnum:05d}.safetensors"


def _volume(sizes) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``[(step, dir)]`` sorted by step: ``ckpt-<step>`` with a manifest, or its ``.old-`` copy when a
    save that replaces the same step crashed between its two renames."""
    found = {}
    if not os.path.isdir(root):
        return []
    for fn in os.listdir(root):
        old = fn.startswith(".old-")
        m = _CKPT_RE.match(fn.removeprefix(".old-"))
        p = os.path.join(root, fn)
        if m and os.path.isfile(os.path.join(p, MANIFEST)) and (not old or int(m.group(1)) not in found):
            found[int(m.group(1))] = p
    return sorted(found.items())


def latest_checkpoint(path: str) -> str | None:
    """The newest complete checkpoint directory ``<path>/ckpt-<step>`` (highest step), or None.

    Temporary directories of unfinished saves (``.tmp-ckpt-*``) and directories without a manifest
    are ignored. If a save replacing an existing step crashed between moving the old directory aside
    and renaming the new one in, the old one (``.old-ckpt-<step>``) is returned.
    """
    cks = complete_checkpoints(os.path.abspath(path))
    return cks[-1][1] if cks else None


def load_manifest(path: str) -> dict:
    """The parsed ``manifest.json`` of a checkpoint directory.

    Raises:
        CheckpointError: naming the file, if it is missing, not JSON, or not a meshtorch checkpoint
            of a known format version.
    """
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"restore: {mpath!r} does not exist; {path!r} is not a complete checkpoint.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"restore: manifest {mpath!r} is corrupt ({e}).") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"restore: {mpath!r} is not a {FORMAT} manifest.")
    if m.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"restore: {mpath!r} has format version {m.get('format_version')}; this meshtorch "
                              f"reads versions <= {FORMAT_VERSION}.")
    return m

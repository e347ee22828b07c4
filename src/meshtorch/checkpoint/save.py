"""Checkpoints that survive crashes and restore onto any mesh and layout.

A checkpoint is a directory ``<root>/ckpt-<step>/`` holding

* ``<mesh>.p<pnum>.safetensors``: for each variable laid out on ``<mesh>``, the slice processor
  ``pnum`` holds, written only by one owner per distinct slice (``MeshImpl.owner_pnums``), keyed
  by the variable's name. (``full=True`` writes one ``full.safetensors`` of full tensors instead.)
* ``index-p<pnum>.json``: what one process wrote (files, sha256, regions); one per writing process.
* ``manifest.json``: written last by the leader from the index files: format version, meshtorch
  version, step, ``extra``, the random-generator state, each mesh's shape, layout and storage rules, and
  the variable table ``name -> {mesh, shape (named dims), dtype, trainable, layout, regions}``
  where a region is ``{file, key, begin, size}`` in the variable's dim order. A variable's ``layout`` is
  the one it is stored in (its storage layout under storage rules, FSDP): each processor writes its shard.

Saving is atomic: everything is written into ``<root>/.tmp-ckpt-<step>``, fsync'ed (files and the
directory), and renamed (``os.replace``) to ``ckpt-<step>``; old checkpoints beyond ``keep`` are
deleted only after that, once the new one verifies. Each phase ends with the processes agreeing on
whether any failed (one all-gather), so a failed write in one rank fails the save in all of them. A
crash at any moment leaves the previous checkpoint complete, and :func:`latest_checkpoint` never returns
a temporary directory.

Restoring reads, for each processor this process holds, only the saved regions that overlap that
processor's slice (``safe_open(...).get_slice``), whatever mesh and layout wrote them, so no process
materialises a full tensor it does not hold. Format and guarantees: ``docs/checkpoints.md``.
Mesh TF saved full variables through ``tf.train.Saver`` (one host gathers); we follow the sharded
approach of PyTorch Distributed Checkpoint (DCP), with safetensors files.

This module writes; :mod:`meshtorch.checkpoint.restore` reads; :mod:`meshtorch.checkpoint.format`
holds what both share (constants, manifest loading, process topology, :func:`latest_checkpoint`).
"""

from __future__ import annotations

import errno
import json
import operator
import os
import shutil
import struct
import time

import safetensors.torch
import torch.distributed as dist

from meshtorch._version import __version__
from meshtorch.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    _barrier,
    _dtype_name,
    _fsync_path,
    _impls,
    _is_leader,
    _local_pnums,
    _mesh_name,
    _multi_process,
    _sha256,
    _shard_file,
    _var_table,
    _volume,
    _write_json,
    complete_checkpoints,
    io_cause,
    latest_checkpoint,
    verify_checkpoint,
)
from meshtorch.core.errors import CheckpointError

__all__ = ["save"]


# ===================================================================== save
def save(lowering, path: str, step: int, extra=None, keep: int | None = None, full: bool = False,
         run: str | None = None) -> str:
    """Save every variable of ``lowering`` (trainable or not) atomically to ``<path>/ckpt-<step>``.

    Args:
        lowering: the :class:`~meshtorch.lowering.Lowering` whose variables to save (parameters,
            optimizer slots, step counters: everything in ``lowering.variables``).
        path: the checkpoint root directory (created if needed).
        step: int >= 0, the training step; names the checkpoint directory.
        extra: optional JSON-serialisable object stored in the manifest (e.g. the data position).
        keep: if given, keep only the ``keep`` newest complete checkpoints under ``path`` (older
            ones are deleted only after the new one is committed and verifies: sizes and sha256 read back).
        run: a run id stored in the manifest (``"run"``); with ``keep``, only checkpoints of this
            run count and are deleted (another run's checkpoints in the same ``path`` are never touched).
        full: write full tensors to one file instead of per-processor slices (single-process
            meshes only; both kinds restore onto any mesh and layout).

    Each variable is stored with its full logical named shape and dtype; every distinct slice is
    written once, by its owner processor (``MeshImpl.owner_pnums``), into that processor's file, so
    under a multi-process (SPMD) mesh each process writes only what it holds. Also stored: the
    graph seed and ``lowering.run_count`` when the Lowering has one (random ops are functions of
    them), ``extra``, each mesh's shape and layout rules, and the meshtorch version.

    Returns:
        the final checkpoint directory, ``<path>/ckpt-<step>``.

    Raises:
        CheckpointError: if ``step``/``keep``/``extra`` are invalid, if ``full`` is asked on a
            multi-process mesh, or if writing fails in any process (ENOSPC, EIO, EFBIG, ...): one line
            naming the cause (the OS's words, e.g. "no space left on device"), the file and the last
            good checkpoint, raised in every process; the temporary directory is removed and earlier
            checkpoints are untouched.
    """
    try:
        ok = not isinstance(step, bool) and operator.index(step) >= 0
    except TypeError:
        ok = False
    if not ok:
        raise CheckpointError(f"save: step must be an int >= 0, got {step!r}.")
    step = operator.index(step)
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"save: keep must be None or an int >= 1, got {keep!r}.")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save: extra must be JSON-serialisable ({e}).") from None
    multi = _multi_process(lowering)
    if full and multi:
        raise CheckpointError("save: full=True needs every slice in one process; under a multi-process mesh "
                              "save sharded (full=False) and restore onto any mesh.")
    leader = _is_leader(lowering)
    root = os.path.abspath(path)
    name = f"ckpt-{step}"
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}")
    err = None
    if leader:
        err = _attempt(step, root, tmp, _start_temp, root, tmp)
    _agree(lowering, err)
    try:
        err = _attempt(step, root, tmp, _write_index, lowering, tmp, full)
    except BaseException:  # interrupted: other processes may still be writing into tmp
        if not multi:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _agree(lowering, err, tmp if leader else None)
    if leader:
        err = _attempt(step, root, tmp, _finish, lowering, root, tmp, final, step, extra, run)
        if err is None and keep is not None:
            err = _retire(root, final, keep, run)
    _agree(lowering, err, tmp if leader else None)
    return final


def _start_temp(root: str, tmp: str):
    os.makedirs(root, exist_ok=True)
    _remove_stale_temps(root)
    os.mkdir(tmp)


def _write_index(lowering, tmp: str, full: bool):
    """This process's files and its ``index-p<first pnum>.json``."""
    index = _write_full(lowering, tmp) if full else _write_shards(lowering, tmp)
    index["variables"] = _var_entries(lowering)  # the leader's manifest lists variables it may not hold
    first = min((min(_local_pnums(i)) for i in _impls(lowering)), default=0)
    _write_json(os.path.join(tmp, f"index-p{first:05d}.json"), index)


def _finish(lowering, root: str, tmp: str, final: str, step: int, extra, run):
    """The leader's part: the manifest, fsync, the atomic rename."""
    try:
        manifest = _manifest(lowering, tmp, step, extra)
        if run is not None:
            manifest["run"] = str(run)
        _write_json(os.path.join(tmp, MANIFEST), manifest)
        _fsync_path(tmp)
        _commit(root, tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _retire(root: str, final: str, keep: int, run) -> str | None:
    """Retention: delete this run's checkpoints older than the ``keep`` newest, only once the new one
    ``final`` verifies (sizes and sha256 read back from disk). Returns an error line, or None."""
    mine = [d for _, d in complete_checkpoints(root) if run is None or _run_of(d) == str(run)]
    if not mine[:-keep]:
        return None
    try:
        verify_checkpoint(final)
    except CheckpointError as e:
        return f"save: the new checkpoint does not verify after writing ({e}); older checkpoints were kept."
    for old in mine[:-keep]:
        _delete(old)
    return None


def _attempt(step: int, root: str, tmp: str, fn, *args) -> str | None:
    """Run one phase of a save; on failure return its one-line error (naming the cause and the file, and
    the last good checkpoint) instead of raising, so every process can agree on it first."""
    try:
        fn(*args)
        return None
    except (OSError, CheckpointError) as e:
        where = getattr(e, "path", None) or getattr(e, "filename", None) or tmp
        cause = getattr(e, "cause", None) or (io_cause(e) if isinstance(e, OSError) else str(e))
        good = latest_checkpoint(root) if os.path.isdir(root) else None
        tail = (f"the last good checkpoint {good} is untouched" if good
                else f"there is no earlier checkpoint under {root!r}")
        return (f"save: checkpoint step {step} was not saved: {cause} (writing {where!r}); the partial files "
                f"were removed and {tail}.")


def _agree(lowering, err: str | None, cleanup: str | None = None):
    """Every process learns whether any failed (one all-gather under a multi-process mesh, the barrier of
    each phase); on failure ``cleanup`` (the leader's temporary directory) is removed and every process
    raises the first failing process's error."""
    errs = [err]
    if _multi_process(lowering) and dist.is_available() and dist.is_initialized():
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
    elif _multi_process(lowering):
        _barrier(lowering)
    first = next((e for e in errs if e), None)
    if first is not None:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise CheckpointError(first)


def _save_file(tensors: dict, path: str):
    """Write one safetensors file and fsync it; tensors sharing storage are copied first."""
    seen, out = set(), {}
    for k, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(ptr)
        out[k] = t
    try:
        safetensors.torch.save_file(out, path, metadata={"format": "pt", "writer": FORMAT})
        _fsync_path(path)
        _check_length(path)
    except Exception as e:
        err = CheckpointError(f"save: writing {path!r} failed: {io_cause(e)}")
        err.path, err.cause = path, io_cause(e)
        raise err from e
    return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _check_length(path: str):
    """The file holds as many bytes as its safetensors header says (a writer that lost a failed write
    would otherwise leave a short file whose sha256 the manifest would record as good)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if os.path.getsize(path) != 8 + n + end:
        raise OSError(errno.EIO, f"{path} has {os.path.getsize(path)} bytes, its header describes {8 + n + end}",
                      path)


def _write_shards(lowering, tmp: str) -> dict:
    """Write the slices this process owns: one file per owner processor. Returns this process's index."""
    per_file: dict[str, dict] = {}
    regions: dict[str, list] = {}
    for var, out, impl, layout in _var_table(lowering):
        owners = set(impl.owner_pnums(layout))
        mesh_name = _mesh_name(lowering, impl)
        sizes = impl.slice_shape(out.shape, layout)
        for p, t in zip(_local_pnums(impl), impl.local_slices(lowering.variables[var]), strict=True):
            if p not in owners:
                continue
            fname = _shard_file(mesh_name, p)
            per_file.setdefault(fname, {})[var.name] = t
            regions.setdefault(fname, []).append(
                {"var": var.name, "key": var.name, "begin": impl.slice_begin(out.shape, p, layout), "size": sizes})
    files = {}
    for fname, tensors in per_file.items():
        files[fname] = _save_file(tensors, os.path.join(tmp, fname))
        files[fname]["regions"] = regions[fname]
    return {"files": files}


def _write_full(lowering, tmp: str) -> dict:
    tensors, regions = {}, []
    for var, out, _, _ in _var_table(lowering):
        tensors[var.name] = lowering.variable_value(var)
        full = out.shape.to_integer_list()
        regions.append({"var": var.name, "key": var.name, "begin": [0] * len(full), "size": full})
    info = _save_file(tensors, os.path.join(tmp, "full.safetensors"))
    info["regions"] = regions
    return {"files": {"full.safetensors": info}}


def _manifest(lowering, tmp: str, step: int, extra) -> dict:
    """Merge the per-process index files into the manifest; check every variable is fully covered."""
    files, variables = {}, {}
    for fn in sorted(os.listdir(tmp)):
        if fn.startswith("index-") and fn.endswith(".json"):
            with open(os.path.join(tmp, fn)) as f:
                index = json.load(f)
            files.update(index["files"])
            for name, entry in index.get("variables", {}).items():  # processes holding different variables
                variables.setdefault(name, {**entry, "regions": []})  # (pipeline stages) each list theirs
    for name, entry in _var_entries(lowering).items():
        variables.setdefault(name, {**entry, "regions": []})
    for fname, info in files.items():
        for r in info["regions"]:
            variables[r["var"]]["regions"].append({"file": fname, "key": r["key"], "begin": r["begin"],
                                                   "size": r["size"]})
    for vname, v in variables.items():
        total = 1
        for _, s in v["shape"]:
            total *= s
        covered = sum(_volume(r["size"]) for r in v["regions"])
        if covered != total:
            raise CheckpointError(f"save: variable {vname!r}: the written regions hold {covered} of {total} elements "
                                  "(a process did not write its slices?).")
    meshes = {}
    for mesh, impl in lowering.mesh_to_impl.items():
        meshes[mesh.name] = {"shape": ";".join(f"{d.name}:{d.size}" for d in impl.shape),
                             "layout": ";".join(f"{a}:{b}" for a, b in impl.layout_rules.pairs),
                             "storage": ";".join(f"{a}:{b}" for a, b in impl.storage_rules.pairs),
                             "impl": type(impl).__name__}
    run_count = getattr(lowering, "run_count", None)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "meshtorch_version": __version__,
        "step": step, "time": time.time(), "extra": extra,
        "rng": {"graph_seed": lowering.graph.seed, "run_count": run_count},
        "meshes": meshes, "variables": variables,
        "files": {k: {"bytes": v["bytes"], "sha256": v["sha256"]} for k, v in files.items()},
    }


def _var_entries(lowering) -> dict:
    """The manifest's entry of each variable of ``lowering``, without its regions."""
    return {var.name: {"mesh": _mesh_name(lowering, impl), "shape": [[d.name, d.size] for d in out.shape],
                       "dtype": _dtype_name(out.dtype), "trainable": bool(var.trainable),
                       "layout": [None if a is None else impl.shape[a].name for a in layout]}
            for var, out, impl, layout in _var_table(lowering)}


def _run_of(ckpt: str) -> str | None:
    """The ``run`` recorded in a checkpoint's manifest (None: none, or unreadable)."""
    try:
        with open(os.path.join(ckpt, MANIFEST)) as f:
            return json.load(f).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def _commit(root: str, tmp: str, final: str):
    """Rename the finished temporary directory to its final name (moving an existing one aside first)."""
    old = None
    if os.path.exists(final):
        old = os.path.join(root, f".old-{os.path.basename(final)}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_path(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _delete(ckpt: str):
    """Delete a checkpoint: rename it out of sight first, so a crash never leaves a half-deleted
    ``ckpt-<step>`` that still looks complete."""
    gone = os.path.join(os.path.dirname(ckpt), f".del-{os.path.basename(ckpt)}")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(ckpt, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _remove_stale_temps(root: str):
    """Clean up after saves that crashed (one saver per root at a time): remove unfinished temporary
    and half-deleted directories; put back a ``ckpt-<step>`` that was moved aside to be replaced."""
    for fn in os.listdir(root):
        p = os.path.join(root, fn)
        if fn.startswith(".old-ckpt-"):
            final = os.path.join(root, fn.removeprefix(".old-"))
            if not os.path.exists(final) and os.path.isfile(os.path.join(p, MANIFEST)):
                os.replace(p, final)
                continue
        if fn.startswith((".tmp-ckpt-", ".old-ckpt-", ".del-")):
            shutil.rmtree(p, ignore_errors=True)

"""Checkpoints that survive crashes and restore onto any mesh and layout.

A checkpoint is a directory ``<root>/ckpt-<step>/`` holding

* ``<mesh>.p<pnum>.safetensors``: for each variable laid out on ``<mesh>``, the slice processor
  ``pnum`` holds, written only by one owner per distinct slice (``MeshImpl.owner_pnums``), keyed
  by the variable's name. (``full=True`` writes one ``full.safetensors`` of full tensors instead.)
* ``index-p<pnum>.json``: what one process wrote (files, sha256, regions); one per writing process.
* ``manifest.json``: written last by the leader from the index files: format version, meshtorch
  version, step, ``extra``, the random-generator state, each mesh's shape and layout rules, and
  the variable table ``name -> {mesh, shape (named dims), dtype, trainable, layout, regions}``
  where a region is ``{file, key, begin, size}`` in the variable's dim order.

Saving is atomic: everything is written into ``<root>/.tmp-ckpt-<step>``, fsync'ed (files and the
directory), and renamed (``os.replace``) to ``ckpt-<step>``; old checkpoints beyond ``keep`` are
deleted only after that. A crash at any moment leaves the previous checkpoint complete, and
:func:`latest_checkpoint` never returns a temporary directory.

Restoring reads, for each processor this process holds, only the saved regions that overlap that
processor's slice (``safe_open(...).get_slice``), whatever mesh and layout wrote them, so no process
materialises a full tensor it does not hold. Format and guarantees: ``docs/checkpoints.md``.
Mesh TF saved full variables through ``tf.train.Saver`` (one host gathers); we follow the sharded
approach of PyTorch Distributed Checkpoint (DCP), with safetensors files.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import re
import shutil
import time
import warnings

import safetensors
import safetensors.torch
import torch

from meshtorch.core.errors import CheckpointError
from meshtorch.interchange import from_torch_state_dict, to_torch_state_dict
from meshtorch.mesh.placement import PlacementMeshImpl

__all__ = ["CheckpointError", "save", "restore", "latest_checkpoint", "to_torch_state_dict",
           "from_torch_state_dict", "load_manifest"]

FORMAT = "meshtorch-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


# ===================================================================== process topology
def _local_pnums(impl) -> list[int]:
    """Processors whose slices this process holds, in the order ``impl.local_slices`` returns them.

    A mesh implementation may say so itself (``impl.local_pnums``, a list or a method); the placement
    mesh holds all; otherwise one process per processor is assumed (rank = pnum, as torchrun).
    """
    lp = getattr(impl, "local_pnums", None)
    if lp is not None:
        return list(lp() if callable(lp) else lp)
    if isinstance(impl, PlacementMeshImpl):
        return list(range(impl.size))
    for attr in ("pnum", "rank"):
        if isinstance(getattr(impl, attr, None), int):
            return [getattr(impl, attr)]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return [torch.distributed.get_rank()]
    return list(range(impl.size))


def _impls(lowering) -> list:
    return list(dict.fromkeys(lowering.mesh_to_impl.values()))


def _multi_process(lowering) -> bool:
    return any(len(_local_pnums(i)) < i.size for i in _impls(lowering))


def _is_leader(lowering) -> bool:
    impls = _impls(lowering)
    return not impls or 0 in _local_pnums(impls[0])


def _barrier(lowering):
    if not _multi_process(lowering):
        return
    impl = _impls(lowering)[0]
    if callable(getattr(impl, "barrier", None)):
        impl.barrier()
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# ===================================================================== small helpers
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fsync_path(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _var_table(lowering) -> list:
    """``[(variable op, its output Tensor, MeshImpl, layout)]`` in graph order."""
    rows = []
    for var in lowering.variables:
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


# ===================================================================== save
def save(lowering, path: str, step: int, extra=None, keep: int | None = None, full: bool = False) -> str:
    """Save every variable of ``lowering`` (trainable or not) atomically to ``<path>/ckpt-<step>``.

    Args:
        lowering: the :class:`~meshtorch.lowering.Lowering` whose variables to save (parameters,
            optimizer slots, step counters: everything in ``lowering.variables``).
        path: the checkpoint root directory (created if needed).
        step: int >= 0, the training step; names the checkpoint directory.
        extra: optional JSON-serialisable object stored in the manifest (e.g. the data position).
        keep: if given, keep only the ``keep`` newest complete checkpoints under ``path`` (older
            ones are deleted after the new one is complete).
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
            multi-process mesh, or if writing fails (the message names the file; the temporary
            directory is removed and earlier checkpoints are untouched).
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
    if leader:
        os.makedirs(root, exist_ok=True)
        _remove_stale_temps(root)
        os.mkdir(tmp)
    _barrier(lowering)
    try:
        index = _write_full(lowering, tmp) if full else _write_shards(lowering, tmp)
        first = min((min(_local_pnums(i)) for i in _impls(lowering)), default=0)
        _write_json(os.path.join(tmp, f"index-p{first:05d}.json"), index)
    except BaseException as e:
        if not multi:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointError) or not isinstance(e, Exception):
            raise
        raise CheckpointError(f"save: writing checkpoint step {step} into {tmp!r} failed ({type(e).__name__}: "
                              f"{e}); earlier checkpoints under {root!r} are untouched.") from e
    _barrier(lowering)
    if leader:
        try:
            manifest = _manifest(lowering, tmp, step, extra)
            _write_json(os.path.join(tmp, MANIFEST), manifest)
            _fsync_path(tmp)
            _commit(root, tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if keep is not None:
            for _, old in _complete_checkpoints(root)[:-keep]:
                _delete(old)
    _barrier(lowering)
    return final


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
    except Exception as e:
        names = sorted(tensors)
        raise CheckpointError(f"save: writing {os.path.basename(path)!r} (variables {names[:5]}"
                              f"{'...' if len(names) > 5 else ''}) failed: {type(e).__name__}: {e}") from e
    return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


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
    from meshtorch import __version__

    files = {}
    for fn in sorted(os.listdir(tmp)):
        if fn.startswith("index-") and fn.endswith(".json"):
            with open(os.path.join(tmp, fn)) as f:
                files.update(json.load(f)["files"])
    variables = {}
    for var, out, impl, layout in _var_table(lowering):
        variables[var.name] = {
            "mesh": _mesh_name(lowering, impl),
            "shape": [[d.name, d.size] for d in out.shape],
            "dtype": _dtype_name(out.dtype),
            "trainable": bool(var.trainable),
            "layout": [None if a is None else impl.shape[a].name for a in layout],
            "regions": [],
        }
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
                             "impl": type(impl).__name__}
    run_count = getattr(lowering, "run_count", None)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "meshtorch_version": __version__,
        "step": step, "time": time.time(), "extra": extra,
        "rng": {"graph_seed": lowering.graph.seed, "run_count": run_count},
        "meshes": meshes, "variables": variables,
        "files": {k: {"bytes": v["bytes"], "sha256": v["sha256"]} for k, v in files.items()},
    }


def _volume(sizes) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


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


def _complete_checkpoints(root: str) -> list[tuple[int, str]]:
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
    cks = _complete_checkpoints(os.path.abspath(path))
    return cks[-1][1] if cks else None


# ===================================================================== restore
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



def _resolve(path: str) -> str:
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    if not os.path.isdir(path):
        raise CheckpointError(f"restore: {path!r} does not exist.")
    if os.listdir(path) and not any(_CKPT_RE.match(f) for f in os.listdir(path)) and \
            any(f.endswith(".safetensors") for f in os.listdir(path)):
        load_manifest(path)  # raises: a checkpoint directory without its manifest
    raise CheckpointError(f"restore: no complete checkpoint (ckpt-<step>/{MANIFEST}) under {path!r}.")


def restore(lowering, path: str, strict: bool = True, verify: bool = True) -> dict:
    """Load a checkpoint written by :func:`save` into ``lowering``'s variables, on any mesh and layout.

    Args:
        lowering: the Lowering to fill; its graph must declare the saved variables (by name) with
            the same named dims and dtypes. Its meshes and layout rules may differ from the saved ones.
        path: a checkpoint directory ``.../ckpt-<step>`` or a root directory (its
            :func:`latest_checkpoint` is used).
        strict: if True (default) every variable of the graph must be in the checkpoint; if False,
            missing ones keep their current values and are listed in ``metadata["missing"]``.
        verify: check each file's size and sha256 against the manifest before reading it.

    For each processor this process holds, the processor's slice is assembled from the saved
    regions that overlap it (partial reads via ``safe_open(...).get_slice``). Dims saved in another
    order are permuted. Every variable's entry and every needed file is checked before any variable
    is overwritten. ``lowering.run_count`` is restored when both the Lowering and the checkpoint
    have one; a different graph seed gives a warning (random ops would draw other numbers).

    Returns:
        metadata dict: ``path, step, extra, rng, meshes, meshtorch_version, missing, unused``
        (``unused``: saved variables the graph does not declare).

    Raises:
        CheckpointError: naming the variable and file: no checkpoint found, corrupt manifest, a
            variable missing (``strict``), a shape or dtype mismatch, a missing, truncated or
            corrupt file, or regions that do not cover a slice.
    """
    ckpt = _resolve(path)
    m = load_manifest(ckpt)
    saved = m.get("variables", {})
    files = m.get("files", {})
    plan, missing = [], []
    for var, out, impl, layout in _var_table(lowering):
        entry = saved.get(var.name)
        if entry is None:
            missing.append(var.name)
            continue
        plan.append((var, out, impl, layout, entry, _check_entry(var, out, entry, ckpt, files)))
    if missing and strict:
        raise CheckpointError(f"restore: variable(s) {missing} of the graph are not in checkpoint {ckpt!r} "
                              f"(it holds {sorted(saved)[:8]}{'...' if len(saved) > 8 else ''}); pass "
                              "strict=False to keep their current values.")
    reader = _Reader(ckpt, files, verify)
    try:
        for var, out, impl, layout, entry, order in plan:  # check every needed file first
            for p in _local_pnums(impl):
                box = _saved_box(impl, out, layout, p, order)
                for r in entry["regions"]:
                    if _overlap(box, r) is not None:
                        reader.check(r["file"], var.name)
        for var, out, impl, layout, entry, order in plan:
            cache: dict = {}
            lowering.set_variable_slices(var, lambda p, a=(var, out, impl, layout, entry, order, cache):
                                         _assemble(reader, p, *a))
    finally:
        reader.close()
    rng = m.get("rng", {})
    if rng.get("graph_seed") is not None and rng["graph_seed"] != lowering.graph.seed:
        warnings.warn(f"restore: checkpoint {ckpt!r} was written with graph seed {rng['graph_seed']}, this graph "
                      f"has seed {lowering.graph.seed}; random ops will draw different numbers.", stacklevel=2)
    if rng.get("run_count") is not None and hasattr(lowering, "run_count"):
        lowering.run_count = rng["run_count"]
    return {"path": ckpt, "step": m.get("step"), "extra": m.get("extra"), "rng": rng, "meshes": m.get("meshes"),
            "meshtorch_version": m.get("meshtorch_version"), "missing": missing,
            "unused": sorted(set(saved) - {v.name for v in lowering.variables})}


def _check_entry(var, out, entry, ckpt, files) -> list[int]:
    """Validate a manifest entry against the graph's variable; return, per saved dim, the graph dim index."""
    saved_shape = [(str(n), int(s)) for n, s in entry["shape"]]
    mine = [(d.name, d.size) for d in out.shape]
    if sorted(saved_shape) != sorted(mine):
        raise CheckpointError(f"restore: variable {var.name!r} has shape {_fmt(saved_shape)} in checkpoint {ckpt!r} "
                              f"but the graph declares {_fmt(mine)}.")
    if entry["dtype"] != _dtype_name(out.dtype):
        raise CheckpointError(f"restore: variable {var.name!r} has dtype {entry['dtype']} in checkpoint {ckpt!r} "
                              f"but the graph declares {_dtype_name(out.dtype)}; cast it after restoring into a "
                              "graph of the saved dtype.")
    names = [n for n, _ in mine]
    for r in entry["regions"]:
        if r["file"] not in files:
            raise CheckpointError(f"restore: variable {var.name!r}: manifest of {ckpt!r} names file {r['file']!r} "
                                  "that it does not list; the manifest is corrupt.")
    return [names.index(n) for n, _ in saved_shape]


def _fmt(shape) -> str:
    return "[" + ", ".join(f"{n}:{s}" for n, s in shape) + "]"


def _saved_box(impl, out, layout, p, order) -> list[tuple[int, int]]:
    """Processor ``p``'s slice of ``out`` as ``[(begin, end)]`` per *saved* dim."""
    b = impl.slice_bounds(out.shape, p, layout)
    return [(b[i].start, b[i].stop) for i in order]


def _overlap(box, region):
    lo = [max(a, int(rb)) for (a, _), rb in zip(box, region["begin"], strict=True)]
    hi = [min(e, int(rb) + int(rs)) for (_, e), rb, rs in zip(box, region["begin"], region["size"], strict=True)]
    if any(x >= y for x, y in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def _assemble(reader, p, var, out, impl, layout, entry, order, cache) -> torch.Tensor:
    """Processor ``p``'s slice of ``var``, from the saved regions that overlap it."""
    box = _saved_box(impl, out, layout, p, order)
    key = tuple(box)
    if key in cache:
        return cache[key]
    sizes = [e - b for b, e in box]
    res = torch.empty(sizes, dtype=out.dtype)
    covered = 0
    for r in entry["regions"]:
        ov = _overlap(box, r)
        if ov is None:
            continue
        lo, hi = ov
        src = tuple(slice(x - int(rb), y - int(rb)) for x, y, rb in zip(lo, hi, r["begin"], strict=True))
        dst = tuple(slice(x - b, y - b) for x, y, (b, _) in zip(lo, hi, box, strict=True))
        res[dst] = reader.read(r["file"], r["key"], var.name, src, r["size"], out.dtype)
        covered += _volume([y - x for x, y in zip(lo, hi, strict=True)])
    if covered != _volume(sizes):
        raise CheckpointError(f"restore: variable {var.name!r}: the checkpoint's regions cover {covered} of the "
                              f"{_volume(sizes)} elements of processor {p}'s slice {box}; the manifest is corrupt.")
    inv = [order.index(i) for i in range(len(order))]
    if inv != list(range(len(order))):
        res = res.permute(inv).contiguous()
    cache[key] = res
    return res


class _Reader:
    """Opens each safetensors file once, after checking its size (and sha256) against the manifest."""

    def __init__(self, ckpt: str, files: dict, verify: bool):
        self.ckpt, self.files, self.verify = ckpt, files, verify
        self.checked: set = set()
        self.handles: dict = {}

    def check(self, fname: str, var: str):
        if fname in self.checked:
            return
        path = os.path.join(self.ckpt, fname)
        info = self.files[fname]
        if not os.path.isfile(path):
            raise CheckpointError(f"restore: file {path!r}, which holds variable {var!r}, is missing.")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise CheckpointError(f"restore: file {path!r}, which holds variable {var!r}, has {size} bytes but the "
                                  f"manifest says {info['bytes']}: it is truncated or corrupt.")
        if self.verify and _sha256(path) != info["sha256"]:
            raise CheckpointError(f"restore: file {path!r}, which holds variable {var!r}, does not match its sha256 "
                                  "in the manifest: it is corrupt.")
        self.checked.add(fname)

    def read(self, fname, key, var, src, size, dtype) -> torch.Tensor:
        self.check(fname, var)
        path = os.path.join(self.ckpt, fname)
        try:
            h = self.handles.get(fname)
            if h is None:
                h = self.handles[fname] = safetensors.safe_open(path, framework="pt", device="cpu")
            sl = h.get_slice(key)
            if list(sl.get_shape()) != [int(s) for s in size]:
                raise CheckpointError(f"restore: variable {var!r} in {path!r} has sizes {sl.get_shape()}, the "
                                      f"manifest says {size}: the file or the manifest is corrupt.")
            t = sl[src] if src else h.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"restore: reading variable {var!r} from {path!r} failed ({type(e).__name__}: "
                                  f"{e}): the file is truncated or corrupt.") from e
        if t.dtype != dtype:
            raise CheckpointError(f"restore: variable {var!r} in {path!r} has dtype {t.dtype}, expected {dtype}.")
        return t

    def close(self):
        self.handles.clear()

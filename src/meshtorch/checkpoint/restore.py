"""Restore a checkpoint onto any mesh and layout: each process assembles the slices it holds from
the saved regions that overlap them (partial safetensors reads). See :func:`restore`."""

from __future__ import annotations

import os
import warnings

import safetensors
import torch

from meshtorch.checkpoint.format import (
    _CKPT_RE,
    MANIFEST,
    _dtype_name,
    _local_pnums,
    _var_table,
    _volume,
    check_file,
    latest_checkpoint,
    load_manifest,
)
from meshtorch.checkpoint.stacked import mapped_entry, read_region
from meshtorch.core.errors import CheckpointError

__all__ = ["restore"]


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
    have one; a different graph seed gives a warning (random ops would draw other numbers). A variable the
    checkpoint lacks is looked up under its older name when the graph has a ``legacy_names`` dict ``{name: name
    in older checkpoints}`` (:func:`meshtorch.models.hf_legacy.legacy_names`; slots by prefix). A graph with a
    ``stacked_names`` (:class:`~meshtorch.core.pipeline.StackedNames`, or a tuple of them: T5's two stacks) reads
    a pipeline layout's stacked variable ``stack/{kind}`` ``[stage, (repeat,) ...]`` from a checkpoint's per-layer
    ``layer_{i}/{kind}`` (row ``[s, r]`` from layer ``r S + s``) and a layer's variable from a saved stack, slots
    included (:func:`meshtorch.checkpoint.stacked.mapped_entry`), bitwise.

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
    legacy = getattr(lowering.graph, "legacy_names", None) or {}
    stacking = getattr(lowering.graph, "stacked_names", None)
    used = set()
    for var, out, impl, layout in _var_table(lowering):
        entry = saved.get(var.name)
        if entry is None and legacy:
            old = _legacy_name(var.name, legacy)
            entry = saved.get(old) if old is not None else None
            if entry is not None:
                used.add(old)
        for names in (stacking if isinstance(stacking, tuple) else (stacking,) if stacking is not None else ()):
            if entry is not None:
                break
            mapped = mapped_entry(var.name, out.shape, saved, names, ckpt)  # saved under the other (un)pipelined naming
            if mapped is not None:
                entry = mapped[0]
                used.update(mapped[1])
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
            "unused": sorted(set(saved) - {v.name for v in lowering.variables} - used)}


def _legacy_name(name: str, legacy: dict) -> str | None:
    """``name``'s name in an older checkpoint: the longest prefix of ``name`` that ``legacy`` maps, ending at the
    name's end or before a ``/`` or ``_`` (an optimizer slot such as ``{var}/adam_m`` or ``{var}_slot_v`` follows
    its variable), replaced by its old name; None if none."""
    for i in range(len(name), 0, -1):
        if (i == len(name) or name[i] in "/_") and name[:i] in legacy:
            return legacy[name[:i]] + name[i:]
    return None


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
        res[dst] = read_region(reader, r, var.name, src, out.dtype)
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
        check_file(self.ckpt, fname, self.files[fname], self.verify, f", which holds variable {var!r},")
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

"""Checkpoints across the pipeline layout's stacked variables and the unpipelined layers' (issues 30 and 32).

A pipelined LM (``stage:pipe``, :func:`meshtorch.layers.pipeline.pipeline`) holds its layers' weights and optimizer
slots stacked, ``stack/{kind}`` ``[stage, (repeat,) ...]``; an unpipelined LM, the stage executor's checkpoints
(:mod:`meshtorch.runtime.pipeline_state`) and Hugging Face imports name them per layer, ``layer_{i}/{kind}``. When
a graph declares a variable that a checkpoint holds only under the other naming (the graph's ``stacked_names``, a
:class:`~meshtorch.core.pipeline.StackedNames`), :func:`mapped_entry` builds the manifest entry the variable would
have had: its regions are the saved ones, placed at row ``[s, r]`` of the stack for layer ``r S + s`` (a stacked
variable read from per-layer ones) or cut out of that row (a layer read from a stacked variable). The restore then
reads each processor's slice from the regions that overlap it as for any entry, so only the slices a process holds
are read, bitwise. (PyTorch's distributed checkpoint leaves such renaming to the user's state-dict hooks; MaxText
converts stacked and unstacked checkpoints with offline scripts.)
"""

from __future__ import annotations

from meshtorch.core.errors import CheckpointError
from meshtorch.core.pipeline import StackedNames

__all__ = ["mapped_entry", "read_region"]


def mapped_entry(name: str, shape, saved: dict, names: StackedNames, ckpt: str) -> tuple[dict, list[str]] | None:
    """The manifest entry of graph variable ``name`` (named ``shape``, a Shape) assembled from ``saved`` (the
    manifest's variables) under the other naming of ``names``, and the saved names it reads; None when the
    checkpoint does not hold it that way either (a layer missing, or a layer index beyond the saved stack).

    Raises:
        CheckpointError: the layers of a stack saved with different shapes or dtypes (naming both).
    """
    dims = [(d.name, d.size) for d in shape]
    if names.unstacked(name, 0) is not None and any(n == names.stage_dim for n, _ in dims):
        return _from_layers(name, dict(dims), saved, names, ckpt)
    split = names.stacked(name)
    if split is not None and split[1] in saved:
        return _from_stack(split[0], split[1], saved[split[1]], names)
    return None


def _from_layers(name, sizes, saved, names, ckpt):
    """Stacked ``name`` ``[stage, (repeat,) ...]`` from the per-layer entries: layer ``r S + s``'s regions at row
    ``[s, r]`` (the leading dims of size 1 in the entry, absent in the files)."""
    S, R = sizes[names.stage_dim], sizes.get(names.repeat_dim)
    lead = [(names.stage_dim, S)] + ([(names.repeat_dim, R)] if R is not None else [])
    first, regions, used = None, [], []
    for s in range(S):
        for r in range(R or 1):
            layer = names.unstacked(name, StackedNames.index(s, r, S))
            entry = saved.get(layer)
            if entry is None:
                return None
            if first is None:
                first = (layer, entry)
            elif [list(x) for x in entry["shape"]] != [list(x) for x in first[1]["shape"]] or \
                    entry["dtype"] != first[1]["dtype"]:
                raise CheckpointError(f"restore: variable {name!r} stacks the layers' variables, but checkpoint "
                                      f"{ckpt!r} holds {layer!r} as {entry['dtype']} {entry['shape']} and "
                                      f"{first[0]!r} as {first[1]['dtype']} {first[1]['shape']}.")
            at = [s] + ([r] if R is not None else [])
            for reg in entry["regions"]:
                n = len(reg["size"])
                regions.append({**reg, "begin": at + list(reg["begin"]), "size": [1] * len(at) + list(reg["size"]),
                                "file_size": reg["size"], "file_dims": [len(at) + j for j in range(n)]})
            used.append(layer)
    return {"shape": lead + [list(x) for x in first[1]["shape"]], "dtype": first[1]["dtype"],
            "regions": regions}, used


def _from_stack(index, stacked, entry, names):
    """Layer ``index``'s variable from the saved stacked ``entry``: the regions that hold its row ``[s, r]``
    (``S``, ``R`` from the saved shape), without the ``stage``/``repeat`` dims."""
    dims = [str(n) for n, _ in entry["shape"]]
    if names.stage_dim not in dims:
        return None
    ps = dims.index(names.stage_dim)
    pr = dims.index(names.repeat_dim) if names.repeat_dim in dims else None
    S = int(entry["shape"][ps][1])
    R = int(entry["shape"][pr][1]) if pr is not None else 1
    s, r = StackedNames.position(index, S)
    if r >= R:
        return None
    fixed = {ps: s} | ({pr: r} if pr is not None else {})
    keep = [q for q in range(len(dims)) if q not in fixed]
    regions = []
    for reg in entry["regions"]:
        begin, size = [int(b) for b in reg["begin"]], [int(z) for z in reg["size"]]
        if not all(begin[q] <= i < begin[q] + size[q] for q, i in fixed.items()):
            continue
        file_dims = [("at", fixed[q] - begin[q]) if q in fixed else keep.index(q) for q in range(len(dims))]
        regions.append({**reg, "begin": [begin[q] for q in keep], "size": [size[q] for q in keep],
                        "file_size": size, "file_dims": file_dims})
    return {"shape": [list(entry["shape"][q]) for q in keep], "dtype": entry["dtype"], "regions": regions}, [stacked]


def read_region(reader, region: dict, var: str, src: tuple, dtype):
    """``src`` (slices per dim of the entry) of ``region``, read by ``reader``: for a mapped region
    (:func:`mapped_entry`) the file's slice, its fixed rows picked and its dims put in the entry's."""
    file_dims = region.get("file_dims")
    if file_dims is None:
        return reader.read(region["file"], region["key"], var, src, region["size"], dtype)
    fsrc = tuple(src[d] if isinstance(d, int) else slice(d[1], d[1] + 1) for d in file_dims)
    t = reader.read(region["file"], region["key"], var, fsrc, region["file_size"], dtype)
    return t.reshape([sl.stop - sl.start for sl in src])

"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (one file, or shards with
``model.safetensors.index.json``) for the families of :mod:`meshtorch.models.hf_families`
(GPT-2, Llama, Qwen2, Mistral, T5).

- :func:`load`: parse and check the config and every tensor header, build the graph
  (:func:`meshtorch.models.hf.build_hf_lm`), lower it on any mesh / layout / storage layout, then
  fill each processor's slice straight from the files with positioned reads (``os.preadv``,
  :mod:`meshtorch.checkpoint.hf_read`; each process reads only the slices it holds; no process
  materialises a whole split tensor).
- :func:`load_hf_weights`: the same fill for an existing Lowering (e.g. a training graph).
- :func:`export`: write ``config.json`` + safetensors from any mesh and layout, variable by
  variable (each gathered in turn; the leader holds at most one shard of tensors), loadable by
  ``transformers.AutoModelForCausalLM.from_pretrained``.

Name map and transposes: :func:`meshtorch.models.hf_families.hf_tensor_map` (GPT-2's ``Conv1D``
weights are ``[in, out]``, ``nn.Linear`` weights ``[out, in]``; GPT-2's fused ``c_attn`` holds q, k, v
side by side). Tied embeddings are one variable; a tied checkpoint's ``lm_head.weight`` is ignored.

A graph whose ``vocab`` is padded for partitioning (``HFModelConfig.vocab_multiple``, Megatron's
make-vocab-size-divisible-by) reads zeros into the padded rows of the embedding and head, and export
writes only the real ``vocab_size`` rows.
"""

from __future__ import annotations

import json
import os

import safetensors
import torch
from safetensors.torch import save_file

from meshtorch.checkpoint.hf_read import BoxReader, read_header
from meshtorch.core.dims import Shape
from meshtorch.core.errors import CheckpointError
from meshtorch.core.pipeline import HF_STACKED_NAMES, T5_STACKED_NAMES, StackedNames
from meshtorch.lowering import Lowering
from meshtorch.mesh.factory import placement_mesh_impl
from meshtorch.models.hf import HFGraph, build_hf_lm
from meshtorch.models.hf_config import HFModelConfig, HFTensor
from meshtorch.models.hf_families import (
    BUFFER_SUFFIXES,
    architecture,
    export_aliases,
    hf_tensor_map,
    parse_hf_config,
    tied_keys,
    zero_biases,
)
from meshtorch.models.hf_t5 import build_t5
from meshtorch.ops.precision import PrecisionPolicy

__all__ = ["read_config", "load", "load_hf_weights", "lower_loaded", "export", "check_files", "build"]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def build(config: HFModelConfig, seed: int = 0, optimizer=None, clip_norm: float | None = None,
          precision: PrecisionPolicy | str | None = None) -> HFGraph:
    """The training graph of an imported model: :func:`~meshtorch.models.hf.build_hf_lm` (the decoder-only families)
    or :func:`~meshtorch.models.hf_t5.build_t5` (T5); every family decodes with
    :func:`meshtorch.runtime.generate.sample` (a KV-cache decoder graph over the same variables).
    ``precision``: a :class:`~meshtorch.ops.precision.PrecisionPolicy` or its name (None: float32); the
    imported weights stay float32 masters under bf16 (decoder-only families).

    Raises:
        ValueError: a bf16 policy for T5.
    """
    policy = PrecisionPolicy.of(precision)
    if policy.mixed:
        if config.encoder_decoder:
            raise ValueError(f"hf.build: precision {policy.name} is for decoder-only models; T5 runs in float32.")
        with policy.scope():
            return build(config, seed, optimizer, clip_norm)
    if config.encoder_decoder:
        return build_t5(config, seed=seed, optimizer=optimizer, clip_norm=clip_norm)
    return build_hf_lm(config, seed=seed, optimizer=optimizer, clip_norm=clip_norm)


def read_config(path: str) -> HFModelConfig:
    """The :class:`HFModelConfig` of the Hugging Face directory ``path`` (its ``config.json``).

    Raises:
        CheckpointError: naming the path: no such directory, no ``config.json``, invalid JSON, or an
            unsupported ``model_type`` / field (see :func:`~meshtorch.models.hf_families.parse_hf_config`).
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"hf: {path!r} is not a directory.")
    cfile = os.path.join(path, CONFIG)
    if not os.path.isfile(cfile):
        raise CheckpointError(f"hf: {path!r} has no {CONFIG}; a Hugging Face model directory needs one.")
    try:
        with open(cfile) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"hf: {cfile!r} is not valid JSON ({e}).") from e
    return parse_hf_config(cfg, where=cfile)


def _weight_map(path: str) -> dict[str, str]:
    """``{tensor key: file name}`` from the index file, or from the single ``model.safetensors``."""
    ifile = os.path.join(path, INDEX)
    if os.path.isfile(ifile):
        try:
            with open(ifile) as f:
                wm = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"hf: {ifile!r} is not a safetensors index with a 'weight_map' ({e}).") from e
        return {str(k): str(v) for k, v in wm.items()}
    single = os.path.join(path, SINGLE)
    if not os.path.isfile(single):
        raise CheckpointError(f"hf: {path!r} has neither {SINGLE} nor {INDEX} (only safetensors weights are read; "
                              "convert pytorch_model.bin with transformers' save_pretrained(safe_serialization=True)).")
    header, _ = read_header(single)  # a truncated or corrupt file: CheckpointError naming it
    return {k: SINGLE for k in header if k != "__metadata__"}


class _Files:
    """The safetensors files of one directory, each opened once on first use."""

    def __init__(self, path: str):
        self.path = path
        self.map = _weight_map(path)
        self.handles: dict = {}
        self.readers: dict = {}

    def handle(self, key: str):
        fname = self.map[key]
        h = self.handles.get(fname)
        if h is None:
            fpath = os.path.join(self.path, fname)
            if not os.path.isfile(fpath):
                raise CheckpointError(f"hf: file {fpath!r}, which holds tensor {key!r}, is missing.")
            read_header(fpath)  # truncated or corrupt: CheckpointError naming the file
            try:
                h = self.handles[fname] = safetensors.safe_open(fpath, framework="pt", device="cpu")
            except Exception as e:
                raise CheckpointError(f"hf: {fpath!r} is not a readable safetensors file ({e}).") from e
        return h

    def reader(self, key: str) -> BoxReader:
        fname = self.map[key]
        r = self.readers.get(fname)
        if r is None:
            self.handle(key)  # the file exists and is a safetensors file
            r = self.readers[fname] = BoxReader(os.path.join(self.path, fname))
        return r

    def shape(self, key: str) -> list[int]:
        try:
            return list(self.handle(key).get_slice(key).get_shape())
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"hf: tensor {key!r} is listed for {self.map[key]!r} but cannot be read "
                                  f"there ({type(e).__name__}: {e}).") from e

    def close(self):
        self.handles.clear()
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def check_files(path: str, config: HFModelConfig, files: _Files | None = None) -> None:
    """Check every tensor the model needs against the headers of ``path``'s safetensors files (no data read).

    Raises:
        CheckpointError: naming the tensor and file: a tensor missing, a shape that differs from the
            config's, or a tensor the model does not use (not a known buffer nor a tied head).
    """
    own = files is None
    files = files or _Files(path)
    try:
        needed = {}
        for t in hf_tensor_map(config):
            needed.setdefault(t.key, t.full_shape)
        for key, shape in needed.items():
            if key not in files.map:
                where = INDEX if os.path.isfile(os.path.join(path, INDEX)) else SINGLE
                raise CheckpointError(f"hf: tensor {key!r} is missing from {os.path.join(path, where)!r}.")
            got = files.shape(key)
            if got != list(shape):
                raise CheckpointError(f"hf: tensor {key!r} in {os.path.join(path, files.map[key])!r} has shape "
                                      f"{got}, but {CONFIG} implies {list(shape)}.")
        zeros = zero_biases(config)
        for key in sorted(set(zeros) & set(files.map)):
            if files.shape(key) != list(zeros[key]):
                raise CheckpointError(f"hf: tensor {key!r} in {os.path.join(path, files.map[key])!r} has shape "
                                      f"{files.shape(key)}, but {CONFIG} implies {list(zeros[key])}.")
        ignore = set(tied_keys(config)) | set(zeros)
        unknown = sorted(k for k in files.map
                         if k not in needed and k not in ignore and not k.endswith(BUFFER_SUFFIXES))
        if unknown:
            more = "..." if len(unknown) > 6 else ""
            raise CheckpointError(f"hf: {path!r} holds tensor(s) {unknown[:6]}{more} that a {config.family} model of "
                                  "this config does not use; refusing to drop them.")
    finally:
        if own:
            files.close()


def _group_strides(t: HFTensor, sizes: dict) -> list[list[int]]:
    out = []
    for g in t.groups:
        strides, s = [], 1
        for n in reversed(g):
            strides.append(s)
            s *= sizes[n]
        out.append(list(reversed(strides)))
    return out


def _read_box(files: _Files, t: HFTensor, names: list[str], bounds, sizes: dict, dtype) -> torch.Tensor:
    """The variable's box ``bounds`` (per dim in ``names`` order) read from tensor ``t.key``."""
    box = dict(zip(names, bounds, strict=True))
    strides = _group_strides(t, sizes)
    index, picks = [], []
    for a, (g, st) in enumerate(zip(t.groups, strides, strict=True)):
        off = t.offset[1] if t.offset is not None and t.offset[0] == a else 0
        lo = off + sum(box[n].start * s for n, s in zip(g, st, strict=True))
        hi = off + sum((box[n].stop - 1) * s for n, s in zip(g, st, strict=True)) + 1
        index.append((lo, hi))
        flat = torch.zeros((), dtype=torch.int64)
        for n, s in zip(g, st, strict=True):
            flat = flat[..., None] + torch.arange(box[n].start, box[n].stop) * s
        flat = flat.reshape(-1) + off - lo
        picks.append(None if flat.numel() == hi - lo else flat)
    try:
        x = files.reader(t.key).read(t.key, index)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"hf: reading tensor {t.key!r} from {os.path.join(files.path, files.map[t.key])!r} "
                              f"failed ({type(e).__name__}: {e}).") from e
    for a, p in enumerate(picks):
        if p is not None:
            x = x.index_select(a, p)
    flat_names = [n for g in t.groups for n in g]
    x = x.reshape([box[n].stop - box[n].start for n in flat_names])
    x = x.permute([flat_names.index(n) for n in names])
    return x.to(dtype).contiguous()


def _read_padded(files: _Files, t: HFTensor, names: list[str], bounds, sizes: dict, dtype, vocab: int):
    """:func:`_read_box`, with the rows of a padded ``vocab`` dim (``>= vocab``) zero."""
    if "vocab" not in names or sizes["vocab"] == vocab:
        return _read_box(files, t, names, bounds, sizes, dtype)
    a = names.index("vocab")
    b = bounds[a]
    real = slice(b.start, min(b.stop, vocab))
    shape = [s.stop - s.start for s in bounds]
    out = torch.zeros(shape, dtype=dtype)
    if real.stop > real.start:
        got = _read_box(files, t, names, [*bounds[:a], real, *bounds[a + 1:]], {**sizes, "vocab": vocab}, dtype)
        out.narrow(a, 0, real.stop - real.start).copy_(got)
    return out


def load_hf_weights(lowering, model, path: str, check: bool = True, partial: bool = False) -> list[str]:
    """Fill ``lowering``'s model variables from the Hugging Face directory ``path``, slice by slice.

    Each processor this process holds gets its slice (storage layout) read from the files with positioned
    reads (:class:`~meshtorch.checkpoint.hf_read.BoxReader`); a fused or merged axis is read over the smallest
    covering range. Rows of a padded ``vocab`` (past ``config.vocab_size``) are zero. Variables the
    map does not name (optimizer slots, step counters) keep their values. A pipelined model's stacked variable
    ``stack/{kind}`` ``[stage, (repeat,) ...]`` gets at row ``[s, r]`` the tensor of layer ``r S + s``
    (:data:`~meshtorch.core.pipeline.HF_STACKED_NAMES`; T5: ``{encoder,decoder}/stack/{kind}``), each processor
    reading only its rows.

    Args:
        model: the :class:`~meshtorch.models.hf.HFGraph` (or its :class:`HFModelConfig`).
        partial: skip the map's variables ``lowering`` lacks (one pipeline stage's graph); else they are an error.

    Returns:
        the names of the variables set.

    Raises:
        CheckpointError: as :func:`check_files` (run first when ``check``), or a read that fails.
    """
    c = model if isinstance(model, HFModelConfig) else model.config
    files = _Files(path)
    by_name = {v.name: v for v in lowering.variables}
    try:
        if check:
            check_files(path, c, files)
        _check_zero_biases(files, c)
        done = []
        for name, t in _graph_entries(c).items():
            var = by_name.get(name)
            if var is None:
                if partial:
                    continue
                key = t.key if isinstance(t, HFTensor) else next(iter(t.values())).key
                raise CheckpointError(f"hf: the graph has no variable {name!r} (tensor {key!r}); build it with "
                                      "meshtorch.models.hf.build_hf_lm.")
            out = var.outputs[0]
            impl, layout = lowering.mesh_impl(out), lowering.tensor_layout(out)
            names = [d.name for d in out.shape]
            sizes = {d.name: d.size for d in out.shape}
            cache: dict = {}

            def fn(p, t=t, out=out, impl=impl, layout=layout, names=names, sizes=sizes, cache=cache):
                b = impl.slice_bounds(out.shape, p, layout)
                key = tuple((s.start, s.stop) for s in b)
                if key not in cache:
                    cache[key] = _read_rows(files, t, names, b, sizes, out.dtype, c.vocab_size)
                return cache[key]

            lowering.store.set_slices(var.name, fn, owned=True)  # each slice is a buffer read for it: no copy
            done.append(name)
        return done
    finally:
        files.close()


def _stacked(c: HFModelConfig, name: str) -> tuple[int, str] | None:
    """``(layer, stacked name)`` of a pipelined ``c``'s per-layer variable ``name`` (T5: either stack's naming,
    :data:`~meshtorch.core.pipeline.T5_STACKED_NAMES`), or None."""
    for names in (T5_STACKED_NAMES if c.encoder_decoder else (HF_STACKED_NAMES,)) if c.pipelined else ():
        split = names.stacked(name)
        if split is not None:
            return split
    return None


def _graph_entries(c: HFModelConfig) -> dict:
    """``{graph variable: its HFTensor}``; a pipelined ``c``'s stacked variables ``{stack/kind: {layer: HFTensor}}``
    (a variable of one layer only, T5's relative bias table in ``block_000``, stays unstacked)."""
    out: dict = {}
    for t in hf_tensor_map(c):
        split = _stacked(c, t.var)
        if split is None:
            out[t.var] = t
        else:
            out.setdefault(split[1], {})[split[0]] = t
    layers = max((len(v) for v in out.values() if isinstance(v, dict)), default=0)
    for name, v in list(out.items()):
        if isinstance(v, dict) and len(v) == 1 < layers:
            del out[name]
            out[next(iter(v.values())).var] = next(iter(v.values()))
    return out


def _lead(names: list[str]) -> int:
    """How many leading dims of a stacked variable are ``stage`` (and ``repeat``)."""
    return 2 if len(names) > 1 and names[1] == HF_STACKED_NAMES.repeat_dim else 1


def _read_rows(files: _Files, t, names: list[str], bounds, sizes: dict, dtype, vocab: int) -> torch.Tensor:
    """:func:`_read_padded` of a variable, or of a stacked variable's rows (``t``: ``{layer: HFTensor}``) within
    ``bounds``, each row read from its layer's tensor."""
    if isinstance(t, HFTensor):
        return _read_padded(files, t, names, bounds, sizes, dtype, vocab)
    n, S = _lead(names), sizes[HF_STACKED_NAMES.stage_dim]
    reps = range(bounds[1].start, bounds[1].stop) if n == 2 else [0]
    rows = [_read_padded(files, t[StackedNames.index(s, r, S)], names[n:], bounds[n:], sizes, dtype, vocab)
            for s in range(bounds[0].start, bounds[0].stop) for r in reps]
    return torch.stack(rows).reshape([b.stop - b.start for b in bounds])


def _layer_value(lowering, name: str, by_name: dict, c: HFModelConfig):
    """``(full value, named shape)`` of map variable ``name``: the graph's variable, or a pipelined graph's row
    ``[s, r]`` of its stacked variable."""
    if name in by_name or not c.pipelined:
        return lowering.variable_value(name).detach().to("cpu"), by_name[name].outputs[0].shape
    i, stacked = _stacked(c, name)
    shape = by_name[stacked].outputs[0].shape
    n = _lead(shape.dimension_names)
    s, r = StackedNames.position(i, c.pipeline_stages)
    full = lowering.variable_value(stacked).detach().to("cpu")
    return (full[s, r] if n == 2 else full[s]), Shape(shape.dims[n:])


def _check_zero_biases(files: _Files, c: HFModelConfig) -> None:
    """The biases ``c``'s config says the model lacks (:func:`~meshtorch.models.hf_families.zero_biases`) must
    be zero where the files hold them: else they were trained (by another tool) and would be dropped."""
    for key in zero_biases(c):
        if key in files.map and bool(files.handle(key).get_tensor(key).any()):
            raise CheckpointError(f"hf: tensor {key!r} in {os.path.join(files.path, files.map[key])!r} is not zero, "
                                  f"but {CONFIG}'s attention_bias / mlp_bias false say the model has no such bias "
                                  f"(a meshtorch export of a native LM, trained since with biases?); delete those "
                                  f"keys from {CONFIG} to train with the biases.")


def load(path: str, mesh_impl=None, *, batch_size: int = 1, length: int | None = None, mesh_shape: str = "",
         layout: str = "", optimizer=None, clip_norm: float | None = None, seed: int = 0):
    """Import a Hugging Face GPT-2 / Llama / Qwen2 / Mistral / T5 v1.1 directory onto a mesh: ``(HFGraph, Lowering)``.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or shards + index).
        mesh_impl: any MeshImpl (placement, SPMD; its storage rules lay out the variables); default
            ``PlacementMeshImpl(mesh_shape, layout)``.
        batch_size, length: the graph's ``batch`` and ``length`` (default length: the model's positions,
            capped at 1024).
        optimizer, clip_norm: for fine-tuning (see :func:`~meshtorch.models.hf.build_hf_lm`).

    The config and every tensor header are checked before the graph is built or anything allocated. The
    imported variables get no initial values: each processor's slice is read straight into place (the
    others, e.g. optimizer slots, are initialised as usual).

    Raises:
        CheckpointError: naming the file, field or tensor (see :func:`read_config`, :func:`check_files`).
        LayoutError: if the layout cannot split a dim of this model.
    """
    cfg = read_config(path)
    check_files(path, cfg)
    cfg = cfg.with_shape(batch_size, length or min(cfg.max_positions, 1024))
    model = build(cfg, seed=seed, optimizer=optimizer, clip_norm=clip_norm)
    impl = mesh_impl if mesh_impl is not None else placement_mesh_impl(mesh_shape, layout)
    return model, lower_loaded(model, impl, path)


def lower_loaded(model: HFGraph, mesh_impl, path: str, **lowering_kwargs) -> Lowering:
    """``model``'s Lowering on ``mesh_impl`` (``lowering_kwargs``: the Lowering's ``mode``, ``bucket_bytes``, ...)
    with its imported variables read from the Hugging Face directory ``path`` (checked first by the caller:
    :func:`check_files`) and no initial values drawn for them; the other variables (optimizer slots) are
    initialised as usual.

    Raises:
        CheckpointError: a read that fails. LayoutError: a layout that cannot split a dim of the model.
    """
    lw = Lowering(model.graph, {model.mesh: mesh_impl}, materialize=False, **lowering_kwargs)
    done = set(load_hf_weights(lowering=lw, model=model, path=path, check=False))
    lw.store.initialize([v.name for v in lw.variables if v.name not in done])
    lw.materialize = True
    return lw


def _region(t: HFTensor, full: torch.Tensor, names: list[str], sizes: dict) -> tuple:
    """The variable's full value as laid out in tensor ``t.key``: (index into that tensor, values)."""
    flat_names = [n for g in t.groups for n in g]
    x = full.permute([names.index(n) for n in flat_names])
    x = x.reshape([_size(g, sizes) for g in t.groups])
    index = [slice(None)] * len(t.groups)
    if t.offset is not None:
        a, o = t.offset
        index[a] = slice(o, o + x.shape[a])
    return tuple(index), x


def _size(g, sizes) -> int:
    n = 1
    for d in g:
        n *= sizes[d]
    return n


def export(lowering, model: HFGraph, out_dir: str, max_shard_size: int = 5 * 2**30) -> list[str]:
    """Write ``model``'s variables as a Hugging Face directory ``out_dir`` (config.json + safetensors).

    Works from any mesh, layout and storage layout: each variable is gathered in turn (every process
    takes part, the leader writes); tensors are written in shards of at most ``max_shard_size``
    bytes (a single tensor larger than that gets a shard of its own), named
    ``model-0000k-of-0000N.safetensors`` with ``model.safetensors.index.json`` when there is more
    than one, else ``model.safetensors``. ``config.json`` is the imported one with ``architectures``
    and ``dtype`` set. Tied models write the embedding only (``transformers`` ties it back). Biases the
    family always has but the model lacks (:func:`~meshtorch.models.hf_families.zero_biases`) are written as
    zeros.

    Returns:
        the file names written (on the leader; [] elsewhere).

    Raises:
        CheckpointError: if ``out_dir`` exists and is not an empty directory, or writing fails.
    """
    impls = list(dict.fromkeys(lowering.mesh_to_impl.values()))
    leader = all(i.is_leader() for i in impls)
    if leader:
        if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
            raise CheckpointError(f"hf export: {out_dir!r} exists and is not an empty directory.")
        os.makedirs(out_dir, exist_ok=True)
    c = model.config
    by_name = {v.name: v for v in lowering.variables}
    aliases = export_aliases(c)
    entries: dict[str, list[HFTensor]] = {}
    for t in hf_tensor_map(c):
        entries.setdefault(t.key, []).append(t)
    shards, cur, cur_bytes, written = [], {}, 0, []

    def add(key: str, tensor: torch.Tensor) -> None:
        nonlocal cur, cur_bytes
        nbytes = tensor.numel() * tensor.element_size()
        if cur and cur_bytes + nbytes > max_shard_size:
            shards.append(_write_shard(out_dir, len(shards), cur))
            cur, cur_bytes = {}, 0
        cur[key] = tensor.contiguous()
        cur_bytes += nbytes

    for key, ts in entries.items():
        tensor = None
        for t in ts:
            full, shape = _layer_value(lowering, t.var, by_name, c)
            if not leader:
                continue
            if "vocab" in shape.dimension_names and c.padded_vocab != c.vocab_size:  # padding stripped
                full = full.narrow(shape.dimension_names.index("vocab"), 0, c.vocab_size)
                shape = shape.resize_dimension("vocab", c.vocab_size)
            idx, x = _region(t, full, [d.name for d in shape], {d.name: d.size for d in shape})
            if tensor is None:
                tensor = torch.empty(t.full_shape, dtype=x.dtype)
            tensor[idx] = x
        if not leader:
            continue
        add(key, tensor)
        for alias in aliases.get(key, ()):  # written as copies: safetensors refuses shared storage
            cur[alias] = tensor.clone()
            cur_bytes += tensor.numel() * tensor.element_size()
    for key, shape in zero_biases(c).items() if leader else ():  # transformers' GPT-2 always has its biases
        add(key, torch.zeros(shape))
    if leader:
        if cur or not shards:
            shards.append(_write_shard(out_dir, len(shards), cur))
        written = _finish(out_dir, shards, c)
    for i in impls:
        i.barrier()
    return written


def _write_shard(out_dir: str, k: int, tensors: dict) -> tuple[str, list[str], int]:
    tmp = f"shard-{k:05d}.tmp"
    try:
        save_file(tensors, os.path.join(out_dir, tmp), metadata={"format": "pt"})
    except OSError as e:
        raise CheckpointError(f"hf export: writing {os.path.join(out_dir, tmp)!r} failed ({e}).") from e
    return tmp, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _finish(out_dir: str, shards: list, c: HFModelConfig) -> list[str]:
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map, total = {}, 0
    for (tmp, keys, nbytes), name in zip(shards, names, strict=True):
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, name))
        weight_map.update({k: name for k in keys})
        total += nbytes
    written = list(names)
    if n > 1:
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        written.append(INDEX)
    cfg = dict(c.hf_config)
    cfg["architectures"] = [architecture(c)]
    cfg["model_type"] = c.family
    cfg["tie_word_embeddings"] = c.tied
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    written.append(CONFIG)
    return written

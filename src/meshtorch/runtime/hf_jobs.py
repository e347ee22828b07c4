"""The command line's Hugging Face jobs: ``meshtorch train --init-from DIR`` (fine-tune an imported GPT-2 /
Llama), ``meshtorch sample`` from such a run or straight from a Hugging Face directory, and ``meshtorch export
--checkpoint-dir CK --hf OUT``.

:func:`run_train` and :func:`run_sample` are what ``meshtorch train`` / ``meshtorch sample`` call: without a
Hugging Face model they hand over to :func:`meshtorch.runtime.train.main_train` /
:func:`meshtorch.runtime.sample.main_sample` unchanged. Checkpoints of a fine-tuning run are ordinary meshtorch
checkpoints (restorable on any mesh and layout) whose manifest ``extra`` holds the model's ``config.json`` as
``hf_config``; the model's ``tokenizer.json`` is copied next to them.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time

import torch

from meshtorch.checkpoint import hf, latest_checkpoint, load_manifest, restore, save
from meshtorch.core.errors import CheckpointError, RunFailure, UsageError
from meshtorch.data.hf_tokenizer import HFTokenizer
from meshtorch.data.text import ByteTokenizer, PackedDataset, load_documents
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.mesh.process import init_distributed
from meshtorch.models.hf_config import HFModelConfig, parse_hf_config
from meshtorch.runtime import checks
from meshtorch.runtime.generate import beam_search, sample
from meshtorch.runtime.optional import optional_module
from meshtorch.runtime.sample import main_sample
from meshtorch.runtime.train import batch_feeds, evaluate, main_train, make_optimizer, resume_point
from meshtorch.runtime.train_config import default_mesh_layout, world_size

TOKENIZER = "tokenizer.json"
_MODEL_FLAGS = ("layers", "d_model", "heads", "d_kv", "d_ff", "experts")


def run_train(args):
    """``meshtorch train``: fine-tune a Hugging Face model with ``--init-from``, else :func:`main_train`."""
    if getattr(args, "init_from", None):
        return main_finetune(args)
    return main_train(args)


def run_sample(args):
    """``meshtorch sample``: from a Hugging Face directory or a fine-tuning run's checkpoints, else
    :func:`main_sample`."""
    d = args.checkpoint_dir  # None: the latest run (main_sample resolves it)
    if d and os.path.isdir(d) and (os.path.isfile(os.path.join(d, hf.CONFIG)) or _hf_manifest(d) is not None):
        return main_hf_sample(args)
    return main_sample(args)


def _hf_manifest(checkpoint_dir: str):
    path = latest_checkpoint(checkpoint_dir) or checkpoint_dir
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        return None
    m = load_manifest(path)
    return m if "hf_config" in (m.get("extra") or {}) else None


def _decoder_only(cfg: HFModelConfig, flag: str) -> None:
    if cfg.family == "t5":
        raise UsageError(f"{flag}: T5 is an encoder-decoder; the command line fine-tunes and samples decoder-only "
                         "models (GPT-2, Llama). Use meshtorch.hf.load from Python (docs/huggingface.md).")


def tokenizer_for(dirs, config: HFModelConfig, flag: str):
    """The model's ``tokenizer.json`` (first of ``dirs`` holding one) through ``tokenizers``; UTF-8 bytes when
    there is none and the vocabulary has at least 256 entries.

    Raises:
        UsageError: naming ``flag``: no tokenizer.json and a vocabulary under 256, or a tokenizer whose ids
            exceed the model's vocabulary.
    """
    for d in dirs:
        path = os.path.join(d, TOKENIZER)
        if d and os.path.isfile(path):
            tok = HFTokenizer(path)
            if tok.vocab_size > config.vocab_size:
                raise UsageError(f"{flag}: {path!r} has {tok.vocab_size} tokens but the model's vocab_size is "
                                 f"{config.vocab_size}.")
            return tok
    if config.vocab_size < 256:
        raise UsageError(f"{flag}: no {TOKENIZER} in {[d for d in dirs if d]} and the model's vocabulary "
                         f"({config.vocab_size}) is too small for UTF-8 bytes; add the model's {TOKENIZER}.")
    return ByteTokenizer()


def check_finetune_args(args) -> HFModelConfig:
    """Check ``meshtorch train --init-from`` flags and the model directory before data is loaded;
    returns the model config with the run's batch and length.

    Raises:
        UsageError: naming the flag (model-size flags given with ``--init-from``, numbers out of range,
            unwritable paths). CheckpointError: the model directory (see :func:`meshtorch.checkpoint.hf.read_config`).
        LayoutError: a ``--layout`` / ``--storage`` rule naming no dimension of the model or axis of the mesh.
    """
    given = [f for f in _MODEL_FLAGS if getattr(args, f, None) is not None]
    if given:
        raise UsageError(f"--{given[0].replace('_', '-')} cannot be combined with --init-from: the model's sizes "
                         f"come from {os.path.join(args.init_from, hf.CONFIG)}.")
    for flag in ("steps", "eval_every", "eval_batches", "keep"):
        checks.positive("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("length", "batch_size"):
        checks.positive("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("threads", "weight_decay", "clip_norm", "checkpoint_every", "sample", "temperature", "top_k"):
        checks.non_negative("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.optimizer == "adafactor":
        checks.number("--lr", args.lr)
    else:
        checks.positive("--lr", args.lr)
    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir (the directory holding the checkpoints).")
    world = world_size()
    args.mesh, args.layout = default_mesh_layout(getattr(args, "mesh", None), getattr(args, "layout", None), world)
    mesh = checks.mesh_shape("--mesh", args.mesh)
    checks.mesh_fits_world("--mesh", args.mesh, mesh, world)
    args.data = checks.input_files("--data", args.data)
    checks.writable_dir("--checkpoint-dir", args.checkpoint_dir)
    cfg = hf.read_config(args.init_from)
    _decoder_only(cfg, "--init-from")
    hf.check_files(args.init_from, cfg)
    length = args.length or min(cfg.max_positions, 128)
    try:
        cfg = cfg.with_shape(args.batch_size or 8, length)
    except ValueError as e:
        raise UsageError(f"--length: {e}") from None
    small = hf.build(HFModelConfig(**{**cfg.to_dict(), "num_layers": 1}))
    names = checks.graph_dim_names(small.graph)
    checks.layout_rules("--layout", args.layout, names, mesh)
    checks.layout_rules("--storage", getattr(args, "storage", ""), names, mesh)
    return cfg


def main_finetune(args) -> dict:
    """Fine-tune the Hugging Face model in ``args.init_from`` on ``--data`` (``meshtorch train --init-from``):
    AdamW (or ``--optimizer``) steps under ``--mesh`` / ``--layout`` / ``--storage``, validation, checkpoints
    (``--checkpoint-dir``, resumable with ``--resume``), and a sample with the model's tokenizer.

    Returns:
        ``{"history", "lowering", "lm", "sample_ids"}``.
    """
    tqdm = optional_module("tqdm", "meshtorch train's progress bar").tqdm
    cfg = check_finetune_args(args)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    if world_size() > 1:
        init_distributed()
    impl = make_mesh_impl(args.mesh, args.layout, storage=getattr(args, "storage", "") or None)
    leader = impl.is_leader()

    def say(*a):
        if leader:
            print(*a, flush=True)

    tok = tokenizer_for([args.init_from], cfg, "--init-from")
    dataset = PackedDataset.from_documents(load_documents(args.data), tok, cfg.length + 1)
    t0 = time.perf_counter()
    lm, lw = hf.load(args.init_from, impl, batch_size=cfg.batch_size, length=cfg.length,
                     optimizer=make_optimizer(args), clip_norm=args.clip_norm or None, seed=args.seed)
    n_params = sum(v.shape.size for v in lm.graph.trainable_variables)
    say(f"imported {cfg.family} from {args.init_from!r} in {time.perf_counter() - t0:.1f} s: {cfg.num_layers} layers, "
        f"d_model {cfg.d_model}, {cfg.num_heads} heads ({cfg.num_kv_heads} kv) x d_kv {cfg.d_kv}, d_ff {cfg.d_ff}, "
        f"vocab {cfg.vocab_size}, {n_params / 1e6:.2f}M parameters; batch {cfg.batch_size} x length {cfg.length}")
    say(f"mesh {args.mesh!r} layout {args.layout!r} storage {getattr(args, 'storage', '')!r}; tokenizer "
        f"{getattr(tok, 'path', 'utf-8 bytes')}; {len(dataset.train)} train / {len(dataset.validation)} validation "
        "sequences")
    start, epoch, in_epoch = 0, 0, 0
    if args.resume or getattr(args, "resume_from", None):
        point, _ = resume_point(args.checkpoint_dir, getattr(args, "resume_from", None))
        if point is not None:
            meta = restore(lw, point)
            pos = (meta.get("extra") or {}).get("data", {})
            start, epoch, in_epoch = meta["step"], pos.get("epoch", 0), pos.get("batch", 0)
            say(f"resumed from {meta['path']} at step {start}")
    if args.checkpoint_dir and leader and isinstance(tok, HFTokenizer):
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        shutil.copyfile(tok.path, os.path.join(args.checkpoint_dir, TOKENIZER))
    history = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    batches = dataset.stream(cfg.batch_size, args.seed, epoch, in_epoch)
    fetches = [lm.loss] + lm.updates
    bar = tqdm(range(start, args.steps), desc="fine-tune", dynamic_ncols=True, mininterval=0.5, disable=not leader)
    try:
        for step in bar:
            epoch, in_epoch, batch = next(batches)
            loss = lw.run(fetches, feeds=batch_feeds(lw, lm, batch), feed_slices=True)[0].item()
            if not math.isfinite(loss):
                raise RunFailure(f"fine-tuning diverged: the loss is {loss} at step {step + 1}; lower --lr.")
            history["step"].append(step)
            history["loss"].append(loss)
            bar.set_postfix(loss=f"{loss:.3f}")
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                val = evaluate(lw, lm, dataset, args.eval_batches)
                history["val_step"].append(step + 1)
                history["val_loss"].append(val)
                if leader:
                    tqdm.write(f"step {step + 1}: train loss {loss:.4f}, validation loss {val:.4f} nats/token")
            if args.checkpoint_dir and ((args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)
                                        or step + 1 == args.steps):
                save(lw, args.checkpoint_dir, step=step + 1, keep=args.keep,
                     extra={"data": {"epoch": epoch, "batch": in_epoch}, "hf_config": cfg.hf_config,
                            "batch_size": cfg.batch_size, "length": cfg.length, "init_from": args.init_from})
    finally:
        bar.close()
    ids = None
    if args.sample:
        ids = sample(lw, lm, tok.encode(args.prompt), max_new_tokens=args.sample, temperature=args.temperature,
                     top_k=args.top_k, seed=args.seed)[0]
        say("sample:\n" + args.prompt + tok.decode(ids))
    return {"history": history, "lowering": lw, "lm": lm, "sample_ids": ids}


def _hf_source(d: str):
    """``(config, checkpoint or None, tokenizer dirs)`` of a Hugging Face directory or a fine-tuning run."""
    if os.path.isfile(os.path.join(d, hf.CONFIG)):
        return hf.read_config(d), None, [d]
    m = _hf_manifest(d)
    if m is None:
        raise CheckpointError(f"{d!r} is neither a Hugging Face directory ({hf.CONFIG}) nor a checkpoint of "
                              "'meshtorch train --init-from'.")
    ckpt = latest_checkpoint(d) or d
    extra = m["extra"]
    root = d if ckpt != d else os.path.dirname(os.path.abspath(d))
    return parse_hf_config(extra["hf_config"], where=f"{ckpt}/manifest.json"), ckpt, [root, extra.get("init_from")]


def main_hf_sample(args):
    """``meshtorch sample --checkpoint-dir D`` where D is a Hugging Face directory or a fine-tuning run:
    decode with the model's tokenizer (greedy with ``--temperature 0``, top-k, beam)."""
    checks.positive("--max-new-tokens", args.max_new_tokens)
    checks.positive("--num-samples", args.num_samples)
    for flag in ("temperature", "top_k", "beam"):
        checks.non_negative("--" + flag.replace("_", "-"), getattr(args, flag))
    cfg, ckpt, tok_dirs = _hf_source(args.checkpoint_dir)
    _decoder_only(cfg, "--checkpoint-dir")
    tok = tokenizer_for(tok_dirs, cfg, "--checkpoint-dir")
    prompt = tok.encode(args.prompt)
    if len(prompt) == 0 or len(prompt) >= cfg.max_positions:
        raise UsageError(f"--prompt is {len(prompt)} tokens; the model has {cfg.max_positions} positions.")
    length = min(cfg.max_positions, len(prompt) + args.max_new_tokens)
    impl = make_mesh_impl(args.mesh, args.layout)
    axis = impl.tensor_dimension_to_mesh_axis("batch")
    split = 1 if axis is None else impl.shape[axis].size
    rows = -(-max(args.beam, args.num_samples) // split) * split  # a batch the layout can split
    cfg = cfg.with_shape(rows, max(length, len(prompt) + 1))
    if ckpt is None:
        lm, lw = hf.load(args.checkpoint_dir, impl, batch_size=cfg.batch_size, length=cfg.length)
    else:
        lm = hf.build(cfg)
        lw = lm.lowering(mesh_impl=impl)
        restore(lw, ckpt)
    if args.beam:
        outs = [beam_search(lw, lm, prompt, beam_size=args.beam, max_new_tokens=args.max_new_tokens)]
    else:
        outs = sample(lw, lm, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, args.num_samples)
    if impl.is_leader():
        for ids in outs:
            print(args.prompt + tok.decode(ids))
            print("-" * 40)
    return outs


def main_export(args) -> list[str]:
    """``meshtorch export --checkpoint-dir CK --hf OUT``: a fine-tuning run's newest checkpoint (or one
    ``ckpt-<step>``) as a Hugging Face directory, restored on ``--mesh`` / ``--layout`` / ``--storage`` and
    gathered variable by variable; the model's ``tokenizer.json`` is copied along.

    Raises:
        UsageError: no ``--hf``; CheckpointError: not a checkpoint of ``meshtorch train --init-from``, or
            ``--hf`` exists and is not empty.
    """
    if not args.hf:
        raise UsageError("--hf: give the output directory of the Hugging Face model.")
    checks.positive("--max-shard-mb", args.max_shard_mb)
    if not os.path.isdir(args.checkpoint_dir):
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r} is not a directory.")
    cfg, ckpt, tok_dirs = _hf_source(args.checkpoint_dir)
    if ckpt is None:
        raise CheckpointError(f"--checkpoint-dir {args.checkpoint_dir!r} is already a Hugging Face directory.")
    if world_size() > 1:
        init_distributed()
    impl = make_mesh_impl(args.mesh, args.layout, storage=args.storage or None)
    lm = hf.build(cfg.with_shape(1, 1))
    lw = lm.lowering(mesh_impl=impl)
    meta = restore(lw, ckpt)
    written = hf.export(lw, lm, args.hf, max_shard_size=int(args.max_shard_mb * 2**20))
    if impl.is_leader():
        for d in tok_dirs:
            if d and os.path.isfile(os.path.join(d, TOKENIZER)):
                shutil.copyfile(os.path.join(d, TOKENIZER), os.path.join(args.hf, TOKENIZER))
                written.append(TOKENIZER)
                break
        print(f"exported {cfg.family} step {meta['step']} from {meta['path']} to {args.hf}: {', '.join(written)}",
              file=sys.stdout, flush=True)
    return written

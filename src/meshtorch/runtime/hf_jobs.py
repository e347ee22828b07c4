"""The command line's Hugging Face jobs besides training: ``meshtorch sample`` from a fine-tuning run or
straight from a Hugging Face directory, and ``meshtorch export --checkpoint-dir CK --hf OUT``.

Fine-tuning (``meshtorch train --init-from DIR``) is :func:`meshtorch.runtime.train.main_train`, the loop of
native runs (the imported model's source: :mod:`meshtorch.runtime.hf_train`). Its checkpoints are ordinary
meshtorch checkpoints (restorable on any mesh and layout) whose manifest ``extra`` (and the run's ``run.json``)
holds the model's ``config.json`` as ``hf_config`` and the source directory as ``init_from``; the model's
``tokenizer.json`` is copied next to them.

:func:`run_sample` is what ``meshtorch sample`` calls: without a Hugging Face model it hands over to
:func:`meshtorch.runtime.sample.main_sample` unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

from meshtorch.checkpoint import hf, latest_checkpoint, load_manifest, restore
from meshtorch.core.errors import CheckpointError, UsageError
from meshtorch.data.hf_tokenizer import HFTokenizer
from meshtorch.data.text import ByteTokenizer
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.mesh.process import init_distributed
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.hf_families import parse_hf_config
from meshtorch.runtime import checks
from meshtorch.runtime.generate import beam_search, sample
from meshtorch.runtime.hf_native import export_native, gpt2_config_of, native_config
from meshtorch.runtime.hf_t5_sample import t5_sample
from meshtorch.runtime.hf_train import TOKENIZER, check_prompt
from meshtorch.runtime.sample import checkpoint_dir, main_sample
from meshtorch.runtime.train_config import world_size


def run_sample(args):
    """``meshtorch sample``: from a Hugging Face directory or a fine-tuning run's checkpoints (``--checkpoint-dir``,
    or the run ``--run-name`` / ``<runs-dir>/latest`` names), else :func:`main_sample`."""
    d = checkpoint_dir(args)
    if os.path.isdir(d) and (os.path.isfile(os.path.join(d, hf.CONFIG)) or _hf_manifest(d) is not None):
        args.checkpoint_dir = d
        return main_hf_sample(args)
    return main_sample(args)


def _hf_manifest(checkpoint_dir: str):
    path = latest_checkpoint(checkpoint_dir) or checkpoint_dir
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        return None
    m = load_manifest(path)
    return m if "hf_config" in (m.get("extra") or {}) else None


def tokenizer_for(dirs, config: HFModelConfig, flag: str, byte: bool = False):
    """The model's ``tokenizer.json`` (first of ``dirs`` holding one) through ``tokenizers``; UTF-8 bytes when
    ``byte`` (a run trained with ``--tokenizer byte``).

    Raises:
        UsageError: naming ``flag`` and the file: no tokenizer.json, or a tokenizer whose ids exceed the model's
            vocabulary.
    """
    if byte:
        return ByteTokenizer()
    for d in dirs:
        path = os.path.join(d, TOKENIZER) if d else ""
        if d and os.path.isfile(path):
            tok = HFTokenizer(path)
            if tok.vocab_size > config.vocab_size:
                raise UsageError(f"{flag}: {path!r} has {tok.vocab_size} tokens but the model's vocab_size is "
                                 f"{config.vocab_size}.")
            return tok
    where = [os.path.join(d, TOKENIZER) for d in dirs if d]
    raise UsageError(f"{flag}: {' or '.join(repr(w) for w in where)} does not exist; the model's tokenizer is needed "
                     "to give its token ids (copy it there).")


def _hf_source(d: str):
    """``(config, checkpoint or None, tokenizer dirs, byte tokenizer)`` of a Hugging Face directory or a
    fine-tuning run (its config with the run's padded vocabulary)."""
    if os.path.isfile(os.path.join(d, hf.CONFIG)):
        return hf.read_config(d), None, [d], False
    m = _hf_manifest(d)
    if m is None:
        raise CheckpointError(f"{d!r} is neither a Hugging Face directory ({hf.CONFIG}) nor a checkpoint of "
                              "'meshtorch train --init-from'.")
    ckpt = latest_checkpoint(d) or d
    extra = m["extra"]
    root = d if ckpt != d else os.path.dirname(os.path.abspath(d))
    cfg = parse_hf_config(extra["hf_config"], where=f"{ckpt}/manifest.json")
    cfg = cfg.replace(vocab_multiple=(extra.get("config") or {}).get("vocab_multiple", 1))  # the saved shapes
    return cfg, ckpt, [root, extra.get("init_from")], extra.get("tokenizer") == "byte"


def main_hf_sample(args):
    """``meshtorch sample --checkpoint-dir D`` where D is a Hugging Face directory or a fine-tuning run:
    decode with the model's tokenizer (greedy with ``--temperature 0``, top-k, beam; a T5 directory:
    :func:`meshtorch.runtime.hf_t5_sample.t5_sample`)."""
    checks.positive("--max-new-tokens", args.max_new_tokens)
    checks.positive("--num-samples", args.num_samples)
    for flag in ("temperature", "top_k", "beam"):
        checks.non_negative("--" + flag.replace("_", "-"), getattr(args, flag))
    cfg, ckpt, tok_dirs, byte = _hf_source(args.checkpoint_dir)
    tok = tokenizer_for(tok_dirs, cfg, "--checkpoint-dir", byte)
    context = min(cfg.max_positions, cfg.sliding_window or cfg.max_positions)  # a sliding window bounds it too
    prompt = check_prompt(tok, args.prompt, context)
    length = min(context, len(prompt) + args.max_new_tokens)
    checks.device("--device", getattr(args, "device", None))
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    if cfg.encoder_decoder:  # a T5 directory or T5 run
        return t5_sample(args, cfg, args.checkpoint_dir, tok, prompt, ckpt)
    impl = make_mesh_impl(args.mesh, args.layout, device=getattr(args, "device", None))
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
        outs = [beam_search(lw, lm, prompt, beam_size=args.beam, max_new_tokens=args.max_new_tokens,
                            eos_ids=cfg.eos_ids, use_cache=not getattr(args, "no_cache", False))]
    else:
        outs = sample(lw, lm, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, args.num_samples,
                      eos_ids=cfg.eos_ids, use_cache=not getattr(args, "no_cache", False))
    if impl.is_leader():
        for ids in outs:
            print(args.prompt + tok.decode(ids))
            print("-" * 40)
    return outs


def main_export(args) -> list[str]:
    """``meshtorch export --checkpoint-dir CK --hf OUT``: a fine-tuning run's newest checkpoint (or one
    ``ckpt-<step>``) as a Hugging Face directory, restored on ``--mesh`` / ``--layout`` / ``--storage`` and
    gathered variable by variable; the model's ``tokenizer.json`` is copied along. A native run is written as
    GPT-2 where its architecture is GPT-2's (``--norm layer``, ungated feed-forward;
    :mod:`meshtorch.runtime.hf_native`).

    Raises:
        UsageError: no ``--hf``; CheckpointError: not a checkpoint of ``meshtorch train``, a native LM that maps to
            no Hugging Face family (one line naming why), or ``--hf`` exists and is not empty.
    """
    if not args.hf:
        raise UsageError("--hf: give the output directory of the Hugging Face model.")
    checks.positive("--max-shard-mb", args.max_shard_mb)
    if not os.path.isdir(args.checkpoint_dir):
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r} is not a directory.")
    native = native_config(args.checkpoint_dir)
    if native is not None:
        gpt2_config_of(native)  # refused in one line before anything is restored
        return _export_native(args, native)
    cfg, ckpt, tok_dirs, _ = _hf_source(args.checkpoint_dir)
    if ckpt is None:
        raise CheckpointError(f"--checkpoint-dir {args.checkpoint_dir!r} is already a Hugging Face directory.")
    impl = _export_impl(args)
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


def _export_impl(args):
    if world_size() > 1:
        init_distributed()
    return make_mesh_impl(args.mesh, args.layout, storage=args.storage or None)


def _export_native(args, c) -> list[str]:
    """A native run as GPT-2 (:mod:`meshtorch.runtime.hf_native`); its ``tokenizer.model`` (SentencePiece) is copied
    along, a byte-level run's ids are UTF-8 bytes (no tokenizer file)."""
    impl = _export_impl(args)
    written, meta = export_native(c, args.checkpoint_dir, impl, args.hf, int(args.max_shard_mb * 2**20))
    if impl.is_leader():
        root = args.checkpoint_dir if latest_checkpoint(args.checkpoint_dir) else os.path.dirname(
            os.path.abspath(args.checkpoint_dir))
        spm = os.path.join(root, "tokenizer.model")
        if os.path.isfile(spm):
            shutil.copyfile(spm, os.path.join(args.hf, "tokenizer.model"))
            written.append("tokenizer.model")
        print(f"exported the native LM as gpt2 (GPT2LMHeadModel) step {meta['step']} from {meta['path']} to "
              f"{args.hf}: {', '.join(written)} (continue it: meshtorch train --init-from {args.hf} --start-step "
              f"{meta['step']} --steps N; docs/huggingface.md, Export)", file=sys.stdout, flush=True)
    return written

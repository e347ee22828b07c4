"""``meshtorch sample``: generate text from a checkpoint written by ``meshtorch train`` (parser:
:mod:`meshtorch.cli.sample`).

The model configuration comes from the checkpoint's manifest; the mesh and layout may differ
from the ones it was trained with (checkpoints restore onto any layout).
"""

from __future__ import annotations

import os
import sys

import torch

from meshtorch.checkpoint import latest_checkpoint, load_manifest, restore
from meshtorch.core.errors import CheckpointError, UsageError
from meshtorch.data.text import ByteTokenizer, SentencePieceTokenizer
from meshtorch.mesh.factory import placement_mesh_impl
from meshtorch.models.transformer import LMConfig, build_lm
from meshtorch.runtime import checks, runs
from meshtorch.runtime.generate import beam_search, sample
from meshtorch.runtime.optional import optional_module


def load_lm(checkpoint_dir: str, mesh_shape: str = "", layout: str = "", device: str | None = None):
    """``(lm, lowering)``: the LM described by the checkpoint, restored onto ``mesh_shape``/``layout`` (slices on
    ``device``, see :func:`meshtorch.mesh.factory.placement_devices`; default cpu)."""
    manifest = load_manifest(latest_checkpoint(checkpoint_dir) or checkpoint_dir)
    extra = manifest.get("extra") or {}
    if "config" not in extra:
        raise CheckpointError(f"checkpoint in {checkpoint_dir!r} has no model config; was it written by "
                                  "'meshtorch train'?")
    cfg = LMConfig(**extra["config"])
    lm = build_lm(cfg, seed=(manifest.get("rng") or {}).get("graph_seed", 0), train=False)
    lowering = lm.lowering(mesh_impl=placement_mesh_impl(mesh_shape, layout, device=device))
    restore(lowering, checkpoint_dir)
    return lm, lowering


def checkpoint_dir(args) -> str:
    """The checkpoint root to decode from: ``--checkpoint-dir``, else ``<runs-dir>/<run-name>/ckpt``, else that
    of the run ``<runs-dir>/latest`` names.

    Raises:
        UsageError: naming ``--checkpoint-dir`` when none is given and there is no latest run.
    """
    if args.checkpoint_dir is not None:
        return args.checkpoint_dir
    runs_dir = getattr(args, "runs_dir", "runs")
    name = getattr(args, "run_name", None)
    if name is None:
        name = runs.read_latest(runs_dir)
        if name is None:
            raise UsageError(f"--checkpoint-dir: not given, and there is no latest run in {runs_dir!r} "
                             f"({os.path.join(runs_dir, runs.LATEST)!r} does not exist); train first "
                             "(meshtorch train) or give --checkpoint-dir.")
    return os.path.join(runs_dir, runs.check_run_name("--run-name", name), "ckpt")


def check_args(args) -> tuple[LMConfig, object]:
    """Check ``meshtorch sample``'s flags against the checkpoint's manifest before the model is built;
    returns the model config and the tokenizer.

    Raises:
        UsageError: naming the flag: a missing ``--checkpoint-dir``, a number out of range, a prompt that
            leaves no room in the context, more samples or beams than the batch.
        CheckpointError: a checkpoint without manifest or model config. LayoutError: a ``--layout`` rule
            matching no dimension of the model or no axis of the mesh.
    """
    args.checkpoint_dir = checkpoint_dir(args)
    if not os.path.isdir(args.checkpoint_dir):
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r} is not a directory; give the --checkpoint-dir "
                         "of a meshtorch train run.")
    if getattr(args, "threads", None) is not None:
        checks.non_negative("--threads", args.threads)
    checks.positive("--max-new-tokens", args.max_new_tokens)
    checks.positive("--num-samples", args.num_samples)
    for flag in ("temperature", "top_k", "beam"):
        checks.non_negative("--" + flag.replace("_", "-"), getattr(args, flag))
    mesh = checks.mesh_shape("--mesh", args.mesh)
    checks.device("--device", getattr(args, "device", None))
    path = latest_checkpoint(args.checkpoint_dir) or args.checkpoint_dir
    used = os.path.basename(path).rsplit("-", 1)[-1]
    step = int(used) if used.isdigit() else -1
    newer = [d for d in checks.step_dirs(args.checkpoint_dir) if int(os.path.basename(d)[5:]) > step
             and not os.path.isfile(os.path.join(d, "manifest.json"))] if step >= 0 else []
    for d in newer:  # a damaged or unfinished newer checkpoint is never skipped silently
        print(f"note: {d!r} has no manifest.json (damaged or unfinished): using {path!r}", file=sys.stderr)
    try:
        manifest = load_manifest(path)
    except CheckpointError as e:
        raise CheckpointError(f"--checkpoint-dir {args.checkpoint_dir!r} holds no complete checkpoint ({e})") from None
    extra = manifest.get("extra") or {}
    if "config" not in extra:
        raise CheckpointError(f"checkpoint {path!r} has no model config; was it written by 'meshtorch train'?")
    cfg = LMConfig(**extra["config"])
    spm_path = os.path.join(args.checkpoint_dir, "tokenizer.model")
    tok = SentencePieceTokenizer.from_file(spm_path) if os.path.exists(spm_path) else ByteTokenizer()
    n = len(tok.encode(args.prompt))
    if n == 0 or n >= cfg.length:
        raise UsageError(f"--prompt is {n} tokens; the model's context is {cfg.length} tokens, so give 1 to "
                         f"{cfg.length - 1}.")
    rows = args.beam or args.num_samples
    if rows > cfg.batch_size:
        flag = "--beam" if args.beam else "--num-samples"
        raise UsageError(f"{flag} {rows} exceeds the model's batch of {cfg.batch_size}.")
    small = cfg if cfg.pipelined else LMConfig(**{**extra["config"], "num_layers": 1})  # a pipeline needs S x R
    checks.layout_rules("--layout", args.layout, checks.graph_dim_names(build_lm(small, train=False).graph), mesh)
    return cfg, tok


def main_sample(args):
    """Run ``meshtorch sample`` from its parsed arguments (:mod:`meshtorch.cli.sample`): print and return
    the generated token ids."""
    cfg, tok = check_args(args)
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    path = latest_checkpoint(args.checkpoint_dir) or args.checkpoint_dir
    print(f"decoding checkpoint {path} (step {load_manifest(path)['step']})", file=sys.stderr, flush=True)
    lm, lowering = load_lm(args.checkpoint_dir, args.mesh, args.layout, getattr(args, "device", None))
    prompt = tok.encode(args.prompt)
    if args.max_new_tokens + len(prompt) > cfg.length:
        print(f"note: {len(prompt)} prompt + {args.max_new_tokens} new tokens exceed the context of {cfg.length}: "
              f"later tokens see only the last {cfg.length - 1}.", file=sys.stderr)
    tqdm = optional_module("tqdm", "meshtorch sample's progress bar (--no-progress: none)").tqdm
    bar = tqdm(total=args.max_new_tokens, desc="sample", unit="tok", leave=False,
               disable=getattr(args, "no_progress", False))
    if args.beam:
        outs = [beam_search(lowering, lm, prompt, beam_size=args.beam, max_new_tokens=args.max_new_tokens,
                            progress=bar.update, use_cache=not getattr(args, "no_cache", False))]
    else:
        outs = sample(lowering, lm, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                      args.num_samples, progress=bar.update, use_cache=not getattr(args, "no_cache", False))
    bar.close()
    for ids in outs:
        print(args.prompt + tok.decode(ids))
        print("-" * 40)
    return outs


"""``meshtorch sample``: generate text from a checkpoint written by ``meshtorch train``.

The model configuration comes from the checkpoint's manifest; the mesh and layout may differ
from the ones it was trained with (checkpoints restore onto any layout).
"""

from __future__ import annotations

import argparse
import os

import meshtorch as mtf
from meshtorch.data.text import ByteTokenizer, SentencePieceTokenizer
from meshtorch.generate import beam_search, sample
from meshtorch.models.transformer import LMConfig, build_lm


def add_sample_subcommand(subparsers) -> None:
    p = subparsers.add_parser("sample", help="generate text from a trained LM checkpoint",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--prompt", default="The ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--beam", type=int, default=0, help="beam width (0: sample)")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default="", help="mesh to decode on (default: 1 processor)")
    p.add_argument("--layout", default="")
    p.set_defaults(func=main_sample)


def load_lm(checkpoint_dir: str, mesh_shape: str = "", layout: str = ""):
    """``(lm, lowering)``: the LM described by the checkpoint, restored onto ``mesh_shape``/``layout``."""
    manifest = mtf.load_manifest(mtf.latest_checkpoint(checkpoint_dir) or checkpoint_dir)
    extra = manifest.get("extra") or {}
    if "config" not in extra:
        raise mtf.CheckpointError(f"checkpoint in {checkpoint_dir!r} has no model config; was it written by "
                                  "'meshtorch train'?")
    cfg = LMConfig(**extra["config"])
    lm = build_lm(cfg, seed=(manifest.get("rng") or {}).get("graph_seed", 0), train=False)
    lowering = lm.lowering(mesh_shape, layout)
    mtf.restore(lowering, checkpoint_dir)
    return lm, lowering


def main_sample(args):
    lm, lowering = load_lm(args.checkpoint_dir, args.mesh, args.layout)
    spm_path = os.path.join(args.checkpoint_dir, "tokenizer.model")
    tok = SentencePieceTokenizer.from_file(spm_path) if os.path.exists(spm_path) else ByteTokenizer()
    prompt = tok.encode(args.prompt)
    if args.beam:
        outs = [beam_search(lowering, lm, prompt, beam_size=args.beam, max_new_tokens=args.max_new_tokens)]
    else:
        outs = sample(lowering, lm, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                      args.num_samples)
    for ids in outs:
        print(args.prompt + tok.decode(ids))
        print("-" * 40)
    return outs


add_parser = add_sample_subcommand  # the cli's module protocol

"""``meshtorch sample``: generate text from a checkpoint written by ``meshtorch train`` (parser:
:mod:`meshtorch.cli.sample`).

The model configuration comes from the checkpoint's manifest; the mesh and layout may differ
from the ones it was trained with (checkpoints restore onto any layout).
"""

from __future__ import annotations

import os

from meshtorch.checkpoint import latest_checkpoint, load_manifest, restore
from meshtorch.core.errors import CheckpointError
from meshtorch.data.text import ByteTokenizer, SentencePieceTokenizer
from meshtorch.mesh.placement import PlacementMeshImpl
from meshtorch.models.transformer import LMConfig, build_lm
from meshtorch.runtime.generate import beam_search, sample


def load_lm(checkpoint_dir: str, mesh_shape: str = "", layout: str = ""):
    """``(lm, lowering)``: the LM described by the checkpoint, restored onto ``mesh_shape``/``layout``."""
    manifest = load_manifest(latest_checkpoint(checkpoint_dir) or checkpoint_dir)
    extra = manifest.get("extra") or {}
    if "config" not in extra:
        raise CheckpointError(f"checkpoint in {checkpoint_dir!r} has no model config; was it written by "
                                  "'meshtorch train'?")
    cfg = LMConfig(**extra["config"])
    lm = build_lm(cfg, seed=(manifest.get("rng") or {}).get("graph_seed", 0), train=False)
    lowering = lm.lowering(mesh_impl=PlacementMeshImpl(mesh_shape, layout))
    restore(lowering, checkpoint_dir)
    return lm, lowering


def main_sample(args):
    """Run ``meshtorch sample`` from its parsed arguments (:mod:`meshtorch.cli.sample`): print and return
    the generated token ids."""
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


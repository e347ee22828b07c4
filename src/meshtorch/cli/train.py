"""``meshtorch train``: the argument parser (the training loop: :mod:`meshtorch.runtime.train`)."""

from __future__ import annotations

import argparse

from meshtorch.models.transformer import PRESETS
from meshtorch.runtime.train import DEFAULT_LAYOUT, DEFAULT_MESH, main_train


def add_train_subcommand(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a Transformer LM (the main job)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    for flag, typ in (("layers", int), ("d-model", int), ("heads", int), ("d-kv", int), ("d-ff", int),
                      ("length", int), ("batch-size", int), ("dropout", float), ("experts", int)):
        p.add_argument(f"--{flag}", type=typ, default=None, help="override the preset")
    p.add_argument("--activation", default=None, choices=["relu", "gelu", "gelu_tanh", "silu"])
    p.add_argument("--gated", action="store_true", help="gated feed-forward (GEGLU/SwiGLU)")
    p.add_argument("--norm", default=None, choices=["rms", "layer"])
    p.add_argument("--mesh", default=DEFAULT_MESH, help='mesh shape, e.g. "data:2,model:2"; "" = 1 processor')
    p.add_argument("--layout", default=DEFAULT_LAYOUT, help="layout rules tensor_dim:mesh_axis;...")
    p.add_argument("--data", nargs="*", default=None, help="UTF-8 text files (default: built-in corpus)")
    p.add_argument("--tokenizer", default="byte", choices=["byte", "sentencepiece"],
                   help="UTF-8 bytes, or a SentencePiece model trained on the training documents")
    p.add_argument("--vocab-size", type=int, default=1024, help="SentencePiece vocabulary size")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "adafactor", "sgd", "momentum"])
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate (adafactor: <= 0 = its own schedule)")
    p.add_argument("--schedule", default="cosine", choices=["constant", "linear-warmup", "rsqrt", "cosine"])
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-norm", type=float, default=1.0, help="global-norm clipping (0: off)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's default). One is fastest for the small per-processor "
                        "slices of a simulated mesh on a few cores; raise it for large models")
    p.add_argument("--plot", default="runs/loss.png", help="loss-curve PNG path ('' to skip)")
    p.add_argument("--checkpoint-dir", default="", help="save checkpoints here (atomic, restorable on any layout)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep", type=int, default=3, help="keep the newest N checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--sample", type=int, default=200, help="bytes to sample after training (0: none)")
    p.add_argument("--prompt", default="The ")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.set_defaults(func=main_train)


add_parser = add_train_subcommand  # the cli's module protocol

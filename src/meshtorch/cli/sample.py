"""``meshtorch sample``: the argument parser (decoding from a checkpoint: :mod:`meshtorch.runtime.sample`)."""

from __future__ import annotations

import argparse

from meshtorch.runtime.sample import main_sample


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


add_parser = add_sample_subcommand  # the cli's module protocol

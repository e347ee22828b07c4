"""Command line: ``meshtorch <command> ...`` (also ``python -m meshtorch``): argument parsing only.

Each command lives in its own module of this package exposing ``add_parser(subparsers)`` (which
sets ``func``, a function of :mod:`meshtorch.runtime`, :mod:`meshtorch.planning` or
:mod:`meshtorch.mesh`); add a new command by appending its module to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys

from meshtorch.cli import launch, mnist, plan, sample, train
from meshtorch.core.errors import MeshtorchError

_COMMANDS = [train, sample, mnist, plan, launch]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per module in ``_COMMANDS``."""
    parser = argparse.ArgumentParser(prog="meshtorch", description="Mesh TensorFlow's named-dimension model "
                                     "parallelism on PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    for mod in _COMMANDS:
        mod.add_parser(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``meshtorch`` script. Returns the exit status (2 on a meshtorch error)."""
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)  # commands may return a result object for programmatic use
        return rc if isinstance(rc, int) else 0
    except (MeshtorchError, ValueError) as e:
        print(f"meshtorch {args.command}: error: {e}", file=sys.stderr)
        return 2

"""The ``meshtorch`` command line (minimal: only ``plan`` on this branch; other subcommands merge in)."""

from __future__ import annotations

import argparse

from meshtorch.planning_cli import add_plan_subcommand


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshtorch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_subcommand(sub)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0

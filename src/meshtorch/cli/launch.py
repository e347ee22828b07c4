"""``meshtorch launch -n N -- <command...>``: the argument parser (spawning: :mod:`meshtorch.runtime.launcher`)."""

from __future__ import annotations

import argparse

from meshtorch.runtime.launcher import launch_command


def add_launch_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add ``launch`` to a CLI's ``argparse`` subparsers (sets ``func=main_launch_args``)."""
    p = subparsers.add_parser(
        "launch", help="run a command as N local processes (one per mesh processor) like torchrun",
        description="Run COMMAND as N processes on this host with torchrun's environment (RANK, WORLD_SIZE, "
                    "LOCAL_RANK, MASTER_ADDR, MASTER_PORT). A COMMAND that is not an executable is taken as a "
                    "meshtorch subcommand: `meshtorch launch -n 4 -- mnist --mesh all:4` runs "
                    "`python -m meshtorch mnist --mesh all:4`. For several hosts use torchrun (docs/distributed.md).")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of processes (= mesh size)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before a collective that a failed or hung rank never joins raises (default 60)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the other ranks get to exit after one fails before they are terminated "
                        "(default: %(default)s)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="start a job whose rank died or hung again, up to N times; a `train` job continues from "
                        "the newest checkpoint of its run that verifies (like torchrun's --max-restarts; each "
                        "restart is logged in the run directory's restarts.jsonl; default: %(default)s)")
    # dest "launched", not "command": the top-level parser keeps the subcommand's name ("launch") in
    # args.command, which error messages print
    p.add_argument("launched", nargs=argparse.REMAINDER, metavar="command", help="the command, after `--`")
    p.set_defaults(func=main_launch_args)
    return p


def main_launch_args(args) -> int:
    """Run parsed ``meshtorch launch`` arguments; returns the job's exit status."""
    return launch_command(args.launched, args.nproc, timeout_s=args.timeout, grace_s=args.grace,
                          max_restarts=args.max_restarts)


add_parser = add_launch_subcommand  # the CLI's per-command hook (meshtorch.cli._COMMANDS)

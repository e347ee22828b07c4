"""Command line: ``meshtorch <command> ...`` (also ``python -m meshtorch``): argument parsing only.

Each command lives in its own module of this package exposing ``add_parser(subparsers)`` (which
sets ``func``, a function of :mod:`meshtorch.runtime`, :mod:`meshtorch.planning` or
:mod:`meshtorch.mesh`); add a new command by appending its module to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import os
import sys

from meshtorch.cli import export, launch, mnist, plan, sample, train
from meshtorch.core.errors import MeshtorchError, RunFailure
from meshtorch.runtime.failures import (
    PEER_FAILED_STATUS,
    describe_failure,
    failed_first,
    forget_run,
    interrupt_message,
    terminate_as_interrupt,
)
from meshtorch.runtime.runs import remove_new_empty_dirs

_COMMANDS = [train, sample, export, mnist, plan, launch]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per module in ``_COMMANDS``."""
    parser = argparse.ArgumentParser(prog="meshtorch", description="Mesh TensorFlow's named-dimension model "
                                     "parallelism on PyTorch.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full Python traceback of an error (default: one line naming the cause)")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    for mod in _COMMANDS:
        mod.add_parser(sub)
    for p in sub.choices.values():  # also accepted after the command: `meshtorch train --debug`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full Python traceback of an error")
    return parser


def main(argv=None) -> int:
    """Entry point of the ``meshtorch`` script. Returns the exit status.

    0 on success; 2 on an input error (a :class:`~meshtorch.core.errors.MeshtorchError` or ValueError
    other than :class:`~meshtorch.core.errors.RunFailure`: a bad flag, file, layout or checkpoint, found
    before training); 1 on a runtime failure (divergence, a failed rank, any other exception). Errors
    are printed as one line without traceback unless ``--debug`` is given (then they propagate).
    """
    words = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(words)
    terminate_as_interrupt()
    remove_new_empty_dirs(remove=False)
    forget_run()
    try:
        rc = args.func(args)  # commands may return a result object for programmatic use
        return rc if isinstance(rc, int) else 0
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM (Interrupted): name the checkpoint to resume from
        remove_new_empty_dirs()
        if int(os.environ.get("RANK", "0")) == 0:
            rest = words[words.index(args.command) + 1:] if args.command in words else []
            print(interrupt_message(args.command, rest, getattr(e, "signame", "SIGINT")), file=sys.stderr,
                  flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - one line; the traceback with --debug
        remove_new_empty_dirs()  # a refused run leaves no empty run or checkpoint directory behind
        if args.debug:
            raise
        ours = isinstance(e, MeshtorchError | ValueError)
        code = 2 if ours and not isinstance(e, RunFailure) else 1
        msg = describe_failure(e)
        if not failed_first(msg):
            code = PEER_FAILED_STATUS  # not this rank's fault: the launcher names the rank that failed first
        if code == 2 and int(os.environ.get("RANK", "0")) > 0:
            return code  # every rank checks the same inputs: rank 0 says what is wrong, once
        hint = "" if ours or code == PEER_FAILED_STATUS else " (--debug shows the traceback)"
        print(f"meshtorch {args.command}: error: {msg}{hint}", file=sys.stderr, flush=True)
        return code

"""The help formatter of every meshtorch command: each flag's default shown once."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already states its default or it has none
    worth showing (None, False, a positional)."""

    def _get_help_string(self, action):
        text = action.help or ""
        hidden = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if "default" in text or hidden or not action.option_strings:
            return text
        return text + " (default: %(default)r)" if isinstance(action.default, str) else text + " (default: %(default)s)"

"""Subcommands of the ``gpt2lab`` CLI (see cli.py)."""
import argparse
import sys

# Autocast dtypes a command accepts ("auto" and the names gpt2lab.distributed.dist.DTYPES maps to torch
# dtypes); config.py imports no torch, so building the parser stays cheap.
from gpt2lab.system.choices import DTYPE_CHOICES as DTYPE_NAMES


def not_yet(name: str, issue: str):
    """A subcommand a later piece of work fills in: says so and exits non-zero."""

    def run(args) -> int:
        print(f"gpt2lab {name}: not implemented yet ({issue})", file=sys.stderr)
        return 2

    return run


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every flag's default, ``(default: X)``, except where there is none to show
    (a required flag, or a default of None that the help text explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)

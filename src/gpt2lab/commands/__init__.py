"""Subcommands of the ``gpt2lab`` CLI (see cli.py)."""

import argparse


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every flag's default, ``(default: X)``, except where there is none to show
    (a required flag, or a default of None that the help text explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)

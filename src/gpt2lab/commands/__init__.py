"""Subcommands of the ``gpt2lab`` CLI (see cli.py)."""
import sys


def not_yet(name: str, issue: str):
    """A subcommand a later piece of work fills in: says so and exits non-zero."""

    def run(args) -> int:
        print(f"gpt2lab {name}: not implemented yet ({issue})", file=sys.stderr)
        return 2

    return run

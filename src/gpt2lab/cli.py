"""The ``gpt2lab`` console script: one subcommand per job, each a thin wrapper.

Each subcommand lives in ``gpt2lab/commands/<name>.py`` with ``add_parser(subparsers)``,
which registers its flags and sets ``func(args) -> int`` as the parser default.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from gpt2lab import __version__

COMMANDS = ["prepare", "train", "sample", "eval", "export", "plot", "bench", "demo", "env", "serve", "report"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpt2lab",
        description="Reproduce and train GPT-2-class language models.",
    )
    parser.add_argument("--version", action="version", version=f"gpt2lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"gpt2lab.commands.{name}").add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

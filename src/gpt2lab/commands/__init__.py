"""Subcommands of the ``gpt2lab`` CLI (see cli.py)."""
import sys

# Autocast dtypes a command accepts ("auto" and the names gpt2lab.distributed.dist.DTYPES maps to torch
# dtypes); config.py imports no torch, so building the parser stays cheap.
from gpt2lab.system.choices import DTYPE_CHOICES as DTYPE_NAMES


def add_inference_dtype_flag(p) -> None:
    """``--dtype`` of the commands that generate text (sample, serve): one flag, one default."""
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="autocast dtype; auto (default): bf16 where the device runs it faster, else fp32")


def not_yet(name: str, issue: str):
    """A subcommand a later piece of work fills in: says so and exits non-zero."""

    def run(args) -> int:
        print(f"gpt2lab {name}: not implemented yet ({issue})", file=sys.stderr)
        return 2

    return run

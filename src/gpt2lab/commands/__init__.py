"""Subcommands of the ``gpt2lab`` CLI (see cli.py)."""
import sys

# Autocast dtypes a command accepts (gpt2lab.dist.DTYPES maps them to torch dtypes); kept
# here so that building the parser does not import torch.
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def add_inference_dtype_flag(p) -> None:
    """``--dtype`` of the commands that generate text (sample, serve): one flag, one default."""
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="autocast dtype")


def not_yet(name: str, issue: str):
    """A subcommand a later piece of work fills in: says so and exits non-zero."""

    def run(args) -> int:
        print(f"gpt2lab {name}: not implemented yet ({issue})", file=sys.stderr)
        return 2

    return run

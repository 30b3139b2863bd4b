"""gpt2lab plot: loss and HellaSwag curves of runs vs GPT-2/GPT-3, and a Markdown summary."""

from __future__ import annotations

import argparse
import os


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot runs (loss, HellaSwag) against GPT-2 and GPT-3")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/plot.png for one run)")
    p.add_argument("--summary", action="store_true", help="also print a Markdown table of the best results")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpt2lab.commands import note_live
    from gpt2lab.observe.plot import plot_runs
    from gpt2lab.system.errors import UsageError

    if args.out is None and len(args.runs) > 1:
        raise UsageError("several runs need --out FILE.png")
    out = args.out or os.path.join(args.runs[0], "plot.png")
    note_live("gpt2lab plot", args.runs)
    table = plot_runs(args.runs, out, summary=args.summary)
    if table:
        print(table)
    print(f"wrote {out}")
    return 0

"""gpt2lab plot: loss and HellaSwag curves of runs vs GPT-2/GPT-3, and a Markdown summary."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot runs (loss, HellaSwag) against GPT-2 and GPT-3")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/plot.png for one run)")
    p.add_argument("--summary", action="store_true", help="also print a Markdown table of the best results")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from gpt2lab.observe.plot import plot_runs
    except ImportError as e:
        raise SystemExit(f"gpt2lab plot needs matplotlib ({e}); pip install 'gpt2lab[plot]'") from None
    out = args.out
    if out is None:
        if len(args.runs) > 1:
            raise SystemExit("gpt2lab plot: several runs need --out FILE.png")
        out = os.path.join(args.runs[0], "plot.png")
    from gpt2lab.system import rundir
    from gpt2lab.system.errors import UsageError

    for run in args.runs:
        note = rundir.live_note(run) if os.path.isdir(run) else None
        if note:
            print(f"gpt2lab plot: note: {note}", file=sys.stderr, flush=True)
    try:
        table = plot_runs(args.runs, out, summary=args.summary)
    except UsageError:  # --out over a file gpt2lab did not write
        raise
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"gpt2lab plot: {e}") from None
    if table:
        print(table)
    print(f"wrote {out}")
    return 0

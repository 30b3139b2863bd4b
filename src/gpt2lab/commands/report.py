"""gpt2lab report: a run's one-page report card (self-contained HTML) and its Markdown twin."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="a run's report card: HTML (plots embedded) and Markdown")
    p.add_argument("run", metavar="RUN_DIR", help="run directory (config.json, metrics.jsonl, checkpoints/)")
    p.add_argument("--out", help="HTML file to write (default RUN_DIR/report.html); the .md and .png go beside it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpt2lab.observe.report import write_report

    out_html, out_md, rep = write_report(args.run, args.out)
    print(rep.status)
    print(f"wrote {out_html} and {out_md}")
    return 0

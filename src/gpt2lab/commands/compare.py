"""gpt2lab compare: the tokens and seconds runs took to reach a loss, and their curves on one plot."""

from __future__ import annotations

import argparse

from gpt2lab.system.choices import finite_float


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="tokens and seconds each run took to reach a loss; curves vs tokens")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="two or more run directories (the first is the baseline)")
    p.add_argument("--loss", type=finite_float, metavar="X", help="--metric value to reach (default: the first run's)")
    p.add_argument(
        "--metric",
        choices=("val_loss", "train_loss", "val_bpb"),
        default="val_loss",
        help="what is compared (default val_loss, nats per token); val_bpb (bits per byte) compares across tokenizers",
    )
    p.add_argument("--out", metavar="FILE.png", help="also plot curves against tokens and seconds (needs matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpt2lab.observe.compare import compare_runs

    print(compare_runs(args.runs, args.out, target=args.loss, metric=args.metric))
    if args.out:
        print(f"wrote {args.out}")
    return 0

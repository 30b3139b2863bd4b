"""gpt2lab tokenizer train|eval: your own byte-level BPE (data/bpe.py), and its bytes per token against GPT-2's."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("tokenizer", help="train your own byte-level BPE tokenizer; bytes per token against GPT-2's")
    tsub = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    tr = tsub.add_parser(
        "train",
        help="train a byte-level BPE on text sources (Hugging Face tokenizers)",
        description="Train a byte-level BPE (GPT-4's split; <|endoftext|>, <|im_start|>, <|im_end|> as ids 0, 1, 2) "
        "into DIR, for `gpt2lab prepare --tokenizer DIR`. The same files give the same bytes.",
    )
    _sources(tr)
    tr.add_argument("--vocab-size", type=int, required=True, metavar="N", help="vocabulary size (at least 260)")
    tr.add_argument("--out", required=True, metavar="DIR", help="new, empty, or an earlier tokenizer (replaced)")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(func=run_train)

    ev = tsub.add_parser("eval", help="bytes per token of a tokenizer against GPT-2's on each source")
    ev.add_argument("--tokenizer", required=True, metavar="DIR", help="a `tokenizer train` directory or its .json")
    _sources(ev)
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ev.set_defaults(func=run_eval)


def _sources(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--source",
        required=True,
        action="append",
        metavar="SRC",
        help="what `gpt2lab prepare --source` takes (a bundled name, files, a directory, a glob, the hub); "
        "repeat for several",
    )
    p.add_argument("--text-field", default="text", help="jsonl/parquet/hub field holding the text")


def run_train(args: argparse.Namespace) -> int:
    from gpt2lab.data.bpe import train_tokenizer

    marker = train_tokenizer(args.source, args.vocab_size, args.out, args.text_field, progress=not args.quiet)
    keys = ("identity", "vocab_size", "special_tokens", "sources")
    print(json.dumps({"out": args.out, **{k: marker[k] for k in keys}}))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from gpt2lab.data.bpe import evaluate_tokenizer
    from gpt2lab.observe.plot import md_table

    rows = evaluate_tokenizer(args.tokenizer, args.source, text_field=args.text_field)
    per = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    table = [["source", "bytes", "documents", "tokens (ours)", "bytes/token (ours)", "tokens (GPT-2)"]]
    table[0] += ["bytes/token (GPT-2)", "GPT-2 tokens / ours"]
    for r in rows:
        a, b = r["tokenizers"]["ours"], r["tokenizers"]["gpt2"]
        counts = [f"{r['bytes']:,}", f"{r['documents']:,}", f"{a['tokens']:,}", per(a["bytes_per_token"])]
        ratio = per(b["tokens"] / a["tokens"] if a["tokens"] else None)
        table.append([r["source"], *counts, f"{b['tokens']:,}", per(b["bytes_per_token"]), ratio])
    print(json.dumps({"tokenizer": args.tokenizer, "sources": rows}) if args.json else "\n".join(md_table(table)))
    return 0

"""gpt2lab prepare: text (FineWeb-Edu, hub datasets, local files, Tiny Shakespeare) -> token shards."""

from __future__ import annotations

import inspect
import json


def add_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize a text source into token shards + manifest.json",
        description="Tokenize SRC with GPT-2's BPE (or --tokenizer DIR's) into llm.c-style shards "
        "({split}_{index:06d}.bin) and a manifest.json. Re-run the same command to resume.",
    )
    p.add_argument(
        "--source",
        required=True,
        help="tinyshakespeare, chitchat (bundled conversations), fineweb-edu, fineweb, hf:NAME[:CONFIG], or a file, "
        "directory or quoted glob ('src/**/*.py'): .jsonl/.json/.parquet one document per row, any other UTF-8 "
        "text file one document (others are skipped with a warning)",
    )
    p.add_argument("--out", required=True, help="output directory for shards and manifest.json")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 1e8)")
    p.add_argument(
        "--val-tokens",
        type=int,
        help="tokens for the val split (default: a shard for the hub, 0.5%% of local sources, 5%% of tinyshakespeare)",
    )
    val = "val is the first {} (implies --val-split documents; the same text whatever the tokenizer)"
    p.add_argument("--val-docs", type=int, metavar="N", help=val.format("N documents"))
    p.add_argument("--val-bytes", type=int, metavar="B", help=val.format("documents up to the one at B UTF-8 bytes"))
    p.add_argument(
        "--val-split",
        choices=("tokens", "documents"),
        help="tokens: val is exactly the first --val-tokens tokens (the default for text); documents: val ends "
        "with a whole document (the default for conversations and with --val-docs/--val-bytes)",
    )
    p.add_argument(
        "--format",
        choices=("auto", "text", "chat"),
        default="auto",
        dest="data_format",
        help="text: documents; chat: conversations (ChatML, the loss on the assistant's tokens); auto (default): "
        'chat when the first JSON line holds "messages" (or "question"/"answer")',
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a `gpt2lab tokenizer train` directory or its tokenizer.json (default: GPT-2's BPE); it goes beside "
        "the shards and every model trained on them uses it",
    )
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--text-field", default="text", help="jsonl/parquet/hub field holding the text")
    p.add_argument("--limit-docs", type=int, default=None, help="use only the first N documents")
    p.add_argument("--config", default=None, help="hub dataset config (default sample-10BT for fineweb-edu/fineweb)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from gpt2lab.data.prepare import prepare
    from gpt2lab.data.tokenizer import data_tokenizer

    # every flag but --out and --quiet is prepare's keyword of the same name
    given = {k: v for k, v in vars(args).items() if k in inspect.signature(prepare).parameters}
    manifest = prepare(**given, out_dir=args.out, progress=not args.quiet)
    summary = {
        name: {k: v for k, v in s.items() if k != "shards"} | {"shards": len(s["shards"])}
        for name, s in manifest["splits"].items()
    }
    keys = ["documents", "tokens", "chat_template", *(["tokenizer", "vocab_size"] if data_tokenizer(manifest) else [])]
    print(json.dumps({"out": args.out, **{k: manifest[k] for k in keys if k in manifest}, "splits": summary}))
    return 0

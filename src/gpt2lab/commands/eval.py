"""gpt2lab eval hellaswag|loss|chat|gsm8k: evaluate any model; the last line printed is JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from gpt2lab.commands import add_model_flags
from gpt2lab.system.choices import HELLASWAG_STRATEGIES, positive_int
from gpt2lab.train.settings import parse_bool


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model: HellaSwag accuracy, validation loss, chat, GSM8K")
    esub = p.add_subparsers(dest="task", metavar="TASK", required=True)
    cached = "downloaded once into ~/.cache/gpt2lab or $GPT2LAB_CACHE"

    hs = _task(esub, "hellaswag", "HellaSwag acc and acc_norm (works under torchrun)", eval_hellaswag, "examples")
    hs.add_argument(
        "--data", help=f"jsonl with ctx/endings/label per line (default: the official validation set, {cached})"
    )
    hs.add_argument("--batch-size", type=positive_int, help="examples per forward, 4 rows each (default: 16)")
    hs.add_argument(
        "--strategy",
        choices=HELLASWAG_STRATEGIES,
        default="auto",
        help="padded: rows of many examples padded into one forward; shared: each context once, continued into its "
        "endings via the KV cache; auto (default): shared for an eager model on CPU, else padded",
    )
    hs.add_argument("--compile", action="store_true", help="torch.compile the model first")

    lo = _task(esub, "loss", "mean next-token loss over the first N tokens of a split", eval_loss)
    lo.add_argument("--data", required=True, help="token shard directory (from gpt2lab prepare)")
    lo.add_argument("--split", default="val")
    # 20 batches of 64 x 1024: what the reference recipe's GPT-2 baseline (3.2924) was measured on.
    lo.add_argument(
        "--tokens", type=positive_int, default=20 * 64 * 1024, help="tokens to evaluate (at most the split)"
    )
    lo.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass")
    lo.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the model's block size)")

    what = "the loss on the assistant's tokens and the share of greedy replies that end their turn"
    ch = _task(esub, "chat", f"held-out conversations: {what}", eval_replies, "conversations", 128)
    ch.add_argument(
        "--data",
        help="conversations: JSON lines in the messages format (.jsonl, .jsonl.zst/.gz/.xz, a directory or a glob) "
        "or a directory from gpt2lab prepare (its held-out ones); default: those the --model run trained on",
    )

    gs = _task(
        esub, "gsm8k", "GSM8K: greedy answers, exact match on the number after ####", eval_replies, "problems", 256
    )
    gs.add_argument(
        "--data",
        help="GSM8K rows {question, answer} as JSON lines (or messages: one user turn, one assistant turn ending "
        f"'#### N'); default: GSM8K's official test split, {cached}",
    )
    gs.add_argument(
        "--calculator",
        type=parse_bool,
        default=True,
        metavar="on|off",
        help="on (default): the reply's <<expr=...>> annotations run as a calculator; off: no calculator",
    )
    gs.add_argument(
        "--samples",
        metavar="FILE.jsonl",
        help="also write the summary and each problem's reply, answer and verdict here (new, or a file gpt2lab wrote)",
    )


def _task(esub, task: str, what: str, func, limit: str = "", max_tokens: int = 0) -> argparse.ArgumentParser:
    """The parser of ``gpt2lab eval TASK``: --model and the inference flags, --limit counting ``limit``
    ("" none) and a reply's --max-tokens (0 none)."""
    p = esub.add_parser(task, help=what)
    add_model_flags(p, required=True)
    if limit:
        p.add_argument("--limit", type=positive_int, help=f"only the first N {limit}")
    if max_tokens:
        p.add_argument(
            "--max-tokens",
            type=positive_int,
            default=max_tokens,
            help=f"tokens a reply may take; one not ended by then did not end its turn (default {max_tokens})",
        )
    p.set_defaults(func=func)
    return p


def _scored(args: argparse.Namespace, score, kind: str = "score", linear: str = "auto", write=None) -> int:
    """``score(model, info)``'s record printed once with the inference decision (``write(record)`` first, if
    given): the model loaded on every rank (torchrun) and held for ``kind`` as rank 0 decided
    (inference/completion.load_for_inference)."""
    import dataclasses

    from gpt2lab.distributed.dist import cleanup, init_distributed
    from gpt2lab.inference.completion import load_for_inference
    from gpt2lab.inference.flags import inference_request

    request = inference_request(args, kind)
    if request.linear == "auto":  # a compiled model keeps F.linear: oneDNN's packed weights are opaque to it
        request = dataclasses.replace(request, linear=linear)
    info = init_distributed(args.device)
    try:
        model, decision = load_for_inference(args.model, info.device, request, "gpt2lab eval")
        record = {**score(model, info), "inference": decision.record()}
        if info.is_main:  # one rank writes and prints
            print(json.dumps(record), flush=True)
            if write is not None:
                write(record)
    finally:
        cleanup()
    return 0


@contextlib.contextmanager
def _one_line(task: str, model: str = ""):
    """Data the task cannot read (or fetch), or a model that cannot take it (``model``: the --model
    words that name it): one line naming the task, exit 1; gpt2lab's own errors go to cli.main as they are."""
    from gpt2lab.system.errors import GPT2LabError

    try:
        yield
    except GPT2LabError:
        raise
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        raise SystemExit(f"gpt2lab eval {task}: {model}{e}") from None


def eval_hellaswag(args: argparse.Namespace) -> int:
    import torch

    from gpt2lab.evals.hellaswag import DEFAULT_BATCH_SIZE, evaluate_hellaswag, load_examples

    with _one_line("hellaswag"):  # the data first: no data, or no network to fetch it, fails before the model loads
        load_examples(args.data, limit=1)

    def score(model, info):
        with _one_line("hellaswag"):
            return evaluate_hellaswag(
                torch.compile(model) if args.compile else model,
                args.data,
                device=info.device,
                batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
                limit=args.limit,
                strategy=args.strategy,
                progress=True,
            )

    return _scored(args, score, linear="plain" if args.compile else "auto")


def eval_loss(args: argparse.Namespace) -> int:
    from gpt2lab.data.shards import read_manifest
    from gpt2lab.data.tokenizer import check_data_tokenizer
    from gpt2lab.evals.loss import evaluate, fit_to_split

    def score(model, info):
        tok, whose = model.config.tokenizer, f"--model {args.model}"
        check_data_tokenizer(args.data, read_manifest(args.data), tok, whose, "evaluate another model")
        seq_len = args.seq_len or model.config.block_size
        with _one_line("loss"):
            # as train does with --eval-tokens: a split holding fewer tokens is taken whole, with a note
            tokens, note = fit_to_split(args.data, args.split, args.tokens, args.batch_size, seq_len, info.world_size)
            if note and info.rank == 0:
                print(f"gpt2lab eval loss: {note}", file=sys.stderr, flush=True)
            res = evaluate(
                model,
                args.data,
                tokens=tokens,
                batch_size=args.batch_size,
                seq_len=seq_len,
                device=info.device,
                split=args.split,
                flags=("--tokens", "--batch-size"),
            )
        return {"task": "loss", "split": args.split, **{k: getattr(res, k) for k in ("tokens", "loss", "bpb", "bytes")}}

    return _scored(args, score)


def eval_replies(args: argparse.Namespace) -> int:
    """eval chat and eval gsm8k: the model's greedy replies, prepared for generating (one row, as ``sample``)."""
    from gpt2lab.evals.chat import chat_data, evaluate_chat, evaluate_gsm8k, gsm8k_test_file, read_conversations
    from gpt2lab.system import rundir
    from gpt2lab.system.files import atomic_write

    gsm8k, samples, rows = args.task == "gsm8k", getattr(args, "samples", None), []
    if samples:  # before the long part: a file there that gpt2lab did not write is refused
        rundir.check(samples, rundir.FILE, "--samples", "pick another path")
    with _one_line(args.task):  # the data first: no data, or no network to fetch it, fails before the model loads
        data, note = (args.data or gsm8k_test_file(), None) if gsm8k else chat_data(args.data, args.model)
    if note:
        print(f"gpt2lab eval chat: {note}", file=sys.stderr, flush=True)
    conversations = read_conversations(data, args.limit, gsm8k=gsm8k)

    def score(model, info) -> dict:
        with _one_line(args.task, f"--model {args.model}: "):  # a model that cannot take the template
            if not gsm8k:
                return {**evaluate_chat(model, conversations, max_tokens=args.max_tokens, progress=True), **where}
            summary, found = evaluate_gsm8k(
                model, conversations, max_tokens=args.max_tokens, calculator=args.calculator, progress=True
            )
        rows.extend(found)
        return {**summary, **where, "samples": samples}

    def write(record: dict) -> None:  # the first line is the summary, marked as gpt2lab's (system/rundir.py)
        with atomic_write(samples, "w") as f:
            for row in [{"format": "gpt2lab-gsm8k-samples", **record}, *rows]:
                f.write(json.dumps(row) + "\n")

    where = {"model": args.model, "data": data}
    return _scored(args, score, "sample", write=write if samples else None)

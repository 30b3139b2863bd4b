"""Any text source -> token shards + manifest.json (``gpt2lab prepare``), in GPT-2's BPE or a tokenizer
``gpt2lab tokenizer train`` made (``tokenizer``: its directory; its tokenizer.json is copied in).

The documents are tokenized in order (in parallel, order kept), each one preceded by
``<|endoftext|>``, into one token stream. The stream is cut at fixed places: the first
``val_tokens`` tokens (or the first documents: ``val_split="documents"``) are the ``val`` split and
the rest ``train``, each split in shards of ``shard_tokens`` (a document may run on into the next shard, as in llm.c and
build-nanogpt). Because shard contents depend only on the stream, a run that resumes
after a crash (from the (document, offset) saved with each finished shard) writes the
same bytes as one that never stopped, and the worker count changes nothing.

The manifest counts tokens and documents per shard (the documents that begin in it), per split
(every document with tokens in it: one the val split cuts counts in both, so a single .txt is a
document of each) and per source file.

This file is the orchestration: the settings, the text or conversation format, the tokenizer and the
encode function. The pieces it runs: data/manifest.py (start, resume or refuse a directory; the
stream cut into shards; conversations: the val split's, as held_out.jsonl beside the shards) and
data/parallel.py (the ordered parallel map).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from gpt2lab.data import chat
from gpt2lab.data.bpe import open_dir
from gpt2lab.data.manifest import resume_point, save_manifest, start_manifest, write_held_out, write_shards
from gpt2lab.data.parallel import ordered_map
from gpt2lab.data.shards import val_size
from gpt2lab.data.sources import Document, JsonLine, SourceError, TextSource, as_text, resolve_source
from gpt2lab.data.tokenizer import Tokenizer, gpt2_tokenizer, save_tokenizer, token_dtype
from gpt2lab.system import rundir
from gpt2lab.system.errors import UsageError
from gpt2lab.system.files import sweep_stale


def prepare(
    source: str,
    out_dir: str,
    *,
    shard_tokens: int = 100_000_000,
    val_tokens: Optional[int] = None,
    workers: Optional[int] = None,
    text_field: str = "text",
    limit_docs: Optional[int] = None,
    config: Optional[str] = None,
    progress: bool = True,
    val_split: Optional[str] = None,
    data_format: str = "auto",
    tokenizer: Optional[str] = None,
    val_docs: Optional[int] = None,
    val_bytes: Optional[int] = None,
) -> Dict:
    """Tokenize ``source`` into shards under ``out_dir``; return the manifest.

    ``val_tokens=None``: one shard for hub sources; for local and bundled ones a fraction
    of the estimated size (0.5%, 5% for tinyshakespeare), at most one shard.
    ``val_split="tokens"`` (the reference FineWeb layout; the default for text): val is exactly the first
    ``val_tokens`` tokens, and the document they cut continues in train. ``"documents"``: val
    is whole documents, the first ones of the source until it holds at least ``val_tokens``
    tokens; train starts with the next document, so no document is in both (held-out text; the
    default for conversations). ``val_docs`` (the first N documents) or ``val_bytes`` (the first
    documents until their text holds at least B UTF-8 bytes) size that split in text instead of
    tokens (and imply ``"documents"``): two prepares of one source with two tokenizers then hold the
    same val documents, so the models' bits per byte are measured on the same text.
    Re-running the same command after a crash or Ctrl-C finishes the job; on a finished
    directory it only checks the shards.
    ``data_format``: ``text`` (documents), ``chat`` (conversations: data/chat.py's template, with
    a loss mask per shard) or ``auto``, chat when the first record of a JSON-lines source is one.
    ``tokenizer``: a directory from ``gpt2lab tokenizer train`` (None: GPT-2's BPE); the manifest
    records its identity, vocabulary and shard dtype, and its tokenizer.json goes beside the shards.
    """
    sizes = {"--val-tokens": val_tokens, "--val-docs": val_docs, "--val-bytes": val_bytes}
    given = [flag for flag, v in sizes.items() if v is not None]
    least = {"--shard-tokens": (shard_tokens, 1), "--workers": (workers, 1), "--limit-docs": (limit_docs, 0)}
    for flag, (v, low) in {**least, **{f: (v, 0) for f, v in sizes.items()}}.items():
        if v is not None and v < low:
            raise UsageError(f"{flag} {v}: must be {low} or more" + (" (0: no val split)" if flag in sizes else ""))
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)}: give one size for the val split, not {len(given)}")
    in_text = val_docs is not None or val_bytes is not None  # the val split in text: the same whatever the tokenizer
    if in_text and val_split == "tokens":
        raise UsageError(
            f"{given[0]} with --val-split tokens: a split sized in text ends with a whole document; "
            "use --val-split documents (the default with it), or --val-tokens"
        )
    src = resolve_source(source, text_field, config)
    val_defaulted = val_tokens is None and not in_text
    val_tokens = default_val_tokens(src, shard_tokens) if val_defaulted else val_tokens
    fmt = detect_format(src, data_format, text_field)
    val_split = val_split or ("documents" if fmt == "chat" or in_text else "tokens")
    if val_split not in VAL_SPLITS:
        raise UsageError(f"--val-split {val_split!r}: choose one of {', '.join(VAL_SPLITS)}")
    # GPT-2's BPE (its chat variant for conversations), or the trained one in ``tokenizer``; a directory
    # holding GPT-2's own vocabulary (a GPT-2 export) is GPT-2's BPE, as with no ``tokenizer``
    own = open_dir(tokenizer) if tokenizer is not None else None
    tok = own if own is not None and own.identity is not None else gpt2_tokenizer(chat=fmt == "chat")
    settings = {
        "source": source,
        "config": src.hub_config,
        "text_field": text_field,
        "limit_docs": limit_docs,
        "shard_tokens": shard_tokens,
        "val_tokens": val_tokens,
        "val_split": val_split,
        "val_docs": val_docs,
        "val_bytes": val_bytes,
        "format": fmt,
        **({"tokenizer": tok.identity} if tok.identity is not None else {}),  # GPT-2's manifests stay as they were
    }
    rundir.check(out_dir, rundir.DATA, "--out", "choose a new or empty --out")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(
            f"--out {out_dir}: cannot write into this directory (permission denied); "
            "choose another --out or fix its permissions"
        )
    manifest = start_manifest(out, settings, val_defaulted, src, tok)
    if not manifest["complete"]:
        if tok.identity is not None and not in_text:
            warnings.warn(
                "the val split is sized in this tokenizer's tokens, so it holds other text than data "
                "prepared with another tokenizer and bits per byte will not compare; to compare, "
                "prepare both with the same --val-docs N or --val-bytes B",
                stacklevel=2,
            )
        save_manifest(out, manifest)  # marks the directory unfinished until the end
        if tok.identity is not None:  # after the manifest: a directory with one is prepare's own
            save_tokenizer(tok, str(out), what_next="run the same prepare command again")
        from tqdm import tqdm

        n_val = val_docs if val_bytes is None else val_documents(src, val_bytes, fmt, limit_docs)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        sweep_stale(str(out))
        start = resume_point(manifest)
        docs = src.documents(start["next_doc"], limit_docs)
        encode = functools.partial(encode_conversations if fmt == "chat" else encode_documents, enc=tok)
        look = dict(desc="prepare", unit="tok", unit_scale=True, dynamic_ncols=True)
        bar = tqdm(disable=not progress, initial=start["tokens"], **look)
        with bar, ordered_map(encode, docs, workers or cores, src.size_bytes) as stream:
            write_shards(out, manifest, src, stream, n_val, bar)
    if "train" not in manifest["splits"]:
        warnings.warn(
            f"{out}: all {manifest['tokens']} tokens ({manifest['documents']} documents) went to val "
            f"({val_size(settings)}); pass a smaller one to get a train split"
        )
    if fmt == "chat":  # the val split's conversations, for `gpt2lab eval chat` (data/manifest.py)
        write_held_out(src, out, manifest)
    return manifest


def val_documents(src: TextSource, val_bytes: int, fmt: str, limit_docs: Optional[int]) -> int:
    """How many of the first documents the val split holds for ``--val-bytes``: up to the one whose
    text reaches ``val_bytes`` UTF-8 bytes (a conversation's text: its messages' contents), read
    from the source itself, so the count is the same whatever the tokenizer."""
    total, n = 0, 0
    for doc in src.documents(0, limit_docs) if val_bytes > 0 else ():  # none: the source is not opened
        chat_line = fmt == "chat" and isinstance(doc, JsonLine)
        text = "".join(content for _, content in doc.turns()) if chat_line else as_text(doc)
        total, n = total + len(text.encode("utf-8", "surrogatepass")), n + 1
        if total >= val_bytes:  # this document reached it: no document past it is read
            break
    return n


# A local source's val split is its val_fraction (0.5%; Tiny Shakespeare 5%), but at least this many
# tokens, or a tenth of a source too small for that: 0.5% of a 200 KB text is some 250 tokens, two
# sequences of 128, too few for one evaluation batch of the CPU presets (up to 16 x 128 + 1 tokens).
MIN_VAL_TOKENS = 8192
SMALL_VAL_FRACTION = 0.1


def default_val_tokens(src: TextSource, shard_tokens: int) -> int:
    if src.size_bytes is None:  # the hub: size unknown up front; one shard, like the reference
        return shard_tokens
    estimate = src.size_bytes / 4  # GPT-2 BPE averages about 4 bytes of English per token
    floor = min(MIN_VAL_TOKENS, math.ceil(SMALL_VAL_FRACTION * estimate))
    return min(shard_tokens, max(1, math.ceil(src.val_fraction * estimate), floor))


FORMATS = ("auto", "text", "chat")
# How the val split ends: at exactly --val-tokens tokens, or at the end of the document reaching them.
VAL_SPLITS = ("tokens", "documents")


def detect_format(src: TextSource, asked: str, text_field: str) -> str:
    """``text`` or ``chat`` for ``--format asked``: auto reads the first record of a JSON-lines
    source (a conversation when it has "messages", or GSM8K's "question" and "answer", and no
    ``text_field``); every other source is text."""
    if asked not in FORMATS:
        raise UsageError(f"--format {asked!r}: choose one of {', '.join(FORMATS)}")
    if asked == "chat" and src.kind != "local":
        raise UsageError(
            f"--format chat: {src.name} is not a local JSON-lines file; conversations are "
            "read from .jsonl files (also .jsonl.zst/.gz/.xz)"
        )
    if asked != "auto" or src.kind != "local":
        return "text" if asked == "auto" else asked
    first = next(iter(src.documents(0, 1)), None)
    try:
        row = first.row() if isinstance(first, JsonLine) else {}
    except SourceError:  # not a JSON object: text, whose reading names the line
        row = {}
    return "chat" if chat.is_conversation(row) and text_field not in row else "text"


# -- the encode functions the parallel map runs ---------------------------------------------
def encode_documents(docs: List[Document], enc: Tokenizer) -> Tuple[np.ndarray, np.ndarray]:
    """Documents -> (tokens, each document EOT first, concatenated, in the shard dtype of ``enc``'s
    vocabulary (GPT-2's: uint16); lengths)."""
    ids = [[enc.eot_id, *enc.encode_ordinary(as_text(d))] for d in docs]
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=token_dtype(enc.n_vocab))
    return flat, np.array([len(x) for x in ids], dtype=np.int64)


def encode_conversations(docs: List[Document], enc: Tokenizer) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """JSON-lines conversations -> (tokens, each conversation <|endoftext|> first, concatenated, in the shard
    dtype of ``enc``'s vocabulary; lengths; uint8 loss mask) in data/chat.py's template (``enc``: the chat
    variant of GPT-2's, or a trained one); a record that is not a conversation is a SourceError naming its
    file, line and field."""
    if not all(isinstance(doc, JsonLine) for doc in docs):
        raise SourceError(
            "conversations are read from JSON-lines files (.jsonl, also compressed); prepare text with --format text"
        )
    pairs = [chat.encode_chat(doc.turns(), tokenizer=enc) for doc in docs]
    ids = np.array([t for a, _ in pairs for t in a], dtype=token_dtype(enc.n_vocab))
    mask = np.array([x for _, m in pairs for x in m], dtype=np.uint8)
    return ids, np.array([len(a) for a, _ in pairs], dtype=np.int64), mask

"""Any text source -> token shards + manifest.json (``gpt2lab prepare``), in GPT-2's BPE or a tokenizer
``gpt2lab tokenizer train`` made (``tokenizer``: its directory; its tokenizer.json is copied in).

The documents are tokenized in order (in parallel, order kept), each one preceded by
``<|endoftext|>``, into one token stream. The stream is cut at fixed places: the first
``val_tokens`` tokens are the ``val`` split and the rest ``train``, each split in shards
of ``shard_tokens`` (a document may run on into the next shard, as in llm.c and
build-nanogpt). Because shard contents depend only on the stream, a run that resumes
after a crash (from the (document, offset) saved with each finished shard) writes the
same bytes as one that never stopped, and the worker count changes nothing.

The manifest counts tokens and documents per shard (the documents that begin in it), per split
(every document with tokens in it: one the val split cuts counts in both, so a single .txt is a
document of each) and per source file.
"""
from __future__ import annotations

import functools
import json
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from gpt2lab.data import chat
from gpt2lab.data.shards import ShardError, mask_path, open_shard, read_header, shard_name, write_mask, write_shard
from gpt2lab.data.sources import Document, JsonLine, Source, SourceError, as_text, resolve_source
from gpt2lab.system import rundir
from gpt2lab.system.errors import UsageError
from gpt2lab.system.files import sweep_stale, write_json
from gpt2lab.data.tokenizer import GPT2, Tokenizer, gpt2_tokenizer, save_tokenizer, token_dtype

MANIFEST = rundir.DATA_MARKER  # the directory's owner mark (system.rundir)
FORMAT = rundir.DATA_FORMAT
VERSION = 2  # 2: the val split is whole documents, per-file counts
# Text per worker task: each message costs the main process ~1 ms, so big tasks; but a
# small source still gets ~8 tasks per worker so the workers stay evenly loaded.
TASK_CHARS_MIN, TASK_CHARS_MAX = 1 << 16, 1 << 20
TASK_DOCS = 4096
# Threads or processes (``use_threads``). tiktoken encodes with the GIL released, so threads
# run in parallel and start in microseconds, but the Python around the encoding (a .jsonl
# line's json.loads, the per-document copy: a share f of the work) takes turns; processes
# pay a start-up S (~100 ms) and never contend. For a source that takes W seconds on one
# core, w workers finish in about W*(f + (1-f)/w) as threads and S + W/w as processes, so
# processes win once W > S / (f * (1 - 1/w)). W and S are both CPU work that a faster
# machine shortens alike, so in bytes the crossover is the same on any machine; it moves
# only with w. Measured on 2 workers (docs/benchmarks.md): threads won on the ~1 MB bundled
# sources, processes on 20x them as .jsonl; the crossover there is this many bytes:
THREAD_POOL_MAX_BYTES = 8 << 20  # at 2 workers; use_threads scales it by 0.5 / (1 - 1/w)


def use_threads(size_bytes: Optional[int], workers: int) -> bool:
    """Tokenize with threads (else processes): sources of known size below the crossover."""
    if size_bytes is None:  # the hub, size unknown: large
        return False
    if workers <= 1:
        return True
    return size_bytes < THREAD_POOL_MAX_BYTES * 0.5 / (1 - 1 / workers)


def prepare(source: str, out_dir: str, *, shard_tokens: int = 100_000_000,
            val_tokens: Optional[int] = None, workers: Optional[int] = None,
            text_field: str = "text", limit_docs: Optional[int] = None,
            config: Optional[str] = None, progress: bool = True, val_split: Optional[str] = None,
            data_format: str = "auto", tokenizer: Optional[str] = None) -> Dict:
    """Tokenize ``source`` into shards under ``out_dir``; return the manifest.

    ``val_tokens=None``: one shard for hub sources; for local and bundled ones a fraction
    of the estimated size (0.5%, 5% for tinyshakespeare), at most one shard.
    ``val_split="tokens"`` (the reference FineWeb layout; the default for text): val is exactly the first
    ``val_tokens`` tokens, and the document they cut continues in train. ``"documents"``: val
    is whole documents, the first ones of the source until it holds at least ``val_tokens``
    tokens; train starts with the next document, so no document is in both (held-out text; the
    default for conversations).
    Re-running the same command after a crash or Ctrl-C finishes the job; on a finished
    directory it only checks the shards.
    ``data_format``: ``text`` (documents), ``chat`` (conversations: data/chat.py's template, with
    a loss mask per shard) or ``auto``, chat when the first record of a JSON-lines source is one.
    ``tokenizer``: a directory from ``gpt2lab tokenizer train`` (None: GPT-2's BPE); the manifest
    records its identity, vocabulary and shard dtype, and its tokenizer.json goes beside the shards.
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens {shard_tokens} must be >= 1")
    n_workers = _workers(workers)
    src = resolve_source(source, text_field, config)
    val_defaulted = val_tokens is None
    if val_tokens is None:
        val_tokens = default_val_tokens(src, shard_tokens)
    if val_tokens < 0 or (limit_docs is not None and limit_docs < 0):
        raise ValueError(f"val_tokens {val_tokens} and limit_docs {limit_docs} must be >= 0")
    fmt = detect_format(src, data_format, text_field)
    val_split = val_split or ("documents" if fmt == "chat" else "tokens")
    tok = _tokenizer(tokenizer, fmt)
    settings = {"source": source, "config": src.hub_config, "text_field": text_field,
                "limit_docs": limit_docs, "shard_tokens": shard_tokens, "val_tokens": val_tokens,
                "val_split": val_split, "format": fmt}
    if tok.identity is not None:  # GPT-2's manifests stay as they were
        settings["tokenizer"] = tok.identity
    if val_split not in VAL_SPLITS:
        raise UsageError(f"--val-split {val_split!r}: choose one of {', '.join(VAL_SPLITS)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out_dir} is a file, not a directory; choose a directory for the shards")
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out_dir}: cannot write into this directory (permission denied); "
                         "choose another --out or fix its permissions")
    manifest = _start_manifest(out, settings, val_defaulted, src, tok)
    if not manifest["complete"]:
        _save_manifest(out, manifest)  # marks the directory unfinished until the end
        if tok.identity is not None:  # after the manifest: a directory with one is prepare's own
            save_tokenizer(tok, str(out), what_next="run the same prepare command again")
        _run(src, out, manifest, n_workers, progress, tok)
    return manifest


def _tokenizer(path: Optional[str], fmt: str) -> Tokenizer:
    """GPT-2's BPE (its chat variant for conversations), or the trained one in ``path``."""
    if path is None:
        return gpt2_tokenizer(chat=fmt == "chat")
    from gpt2lab.data.bpe import open_dir

    return open_dir(path)


# A local source's val split is its val_fraction (0.5%; Tiny Shakespeare 5%), but at least this many
# tokens, or a tenth of a source too small for that: 0.5% of a 200 KB text is some 250 tokens, two
# sequences of 128, too few for one evaluation batch of the CPU presets (up to 16 x 128 + 1 tokens).
MIN_VAL_TOKENS = 8192
SMALL_VAL_FRACTION = 0.1


def default_val_tokens(src: Source, shard_tokens: int) -> int:
    if src.size_bytes is None:  # the hub: size unknown up front; one shard, like the reference
        return shard_tokens
    estimate = src.size_bytes / 4  # GPT-2 BPE averages about 4 bytes of English per token
    floor = min(MIN_VAL_TOKENS, math.ceil(SMALL_VAL_FRACTION * estimate))
    return min(shard_tokens, max(1, math.ceil(src.val_fraction * estimate), floor))


def _workers(workers: Optional[int]) -> int:
    if workers is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if workers < 1:
        raise ValueError(f"workers {workers} must be >= 1")
    return workers


# -- manifest ----------------------------------------------------------------------------
FLAGS = {"source": "--source", "config": "--config", "text_field": "--text-field",
         "limit_docs": "--limit-docs", "shard_tokens": "--shard-tokens", "val_tokens": "--val-tokens",
         "val_split": "--val-split", "format": "--format", "tokenizer": "--tokenizer"}
FORMATS = ("auto", "text", "chat")
# How the val split ends: at exactly --val-tokens tokens, or at the end of the document reaching them.
VAL_SPLITS = ("tokens", "documents")


def _fresh_manifest(settings: Dict, tok: Tokenizer) -> Dict:
    conversations = settings["format"] == "chat"
    manifest = {"format": FORMAT, "version": VERSION, "source": settings["source"], "tokenizer": tok.identity or GPT2,
                "eot_id": tok.eot_id, "vocab_size": tok.n_vocab, "dtype": token_dtype(tok.n_vocab).name,
                "settings": settings, "complete": False, "shards": [], "files": [],
                "resume": {"next_doc": 0, "offset": 0, "tokens": 0,
                           "val_end": 0 if settings["val_tokens"] == 0 else None}}
    if conversations:  # the loader takes the loss on the masked tokens only; a run records the template
        manifest["chat_template"] = chat.TEMPLATE
    return manifest


def detect_format(src: Source, asked: str, text_field: str) -> str:
    """``text`` or ``chat`` for ``--format asked``: auto reads the first record of a JSON-lines
    source (a conversation when it has "messages", or GSM8K's "question" and "answer", and no
    ``text_field``); every other source is text."""
    if asked not in FORMATS:
        raise UsageError(f"--format {asked!r}: choose one of {', '.join(FORMATS)}")
    if asked != "auto":
        if asked == "chat" and src.kind != "local":
            raise UsageError(f"--format chat: {src.name} is not a local JSON-lines file; conversations are "
                             "read from .jsonl files (also .jsonl.zst/.gz/.xz)")
        return asked
    if src.kind != "local":
        return "text"
    first = next(iter(src.documents(0, 1)), None)
    if not isinstance(first, JsonLine):
        return "text"
    row = chat.parse_line(first.line)
    return "chat" if chat.is_conversation(row) and text_field not in row else "text"


def _start_manifest(out: Path, settings: Dict, val_defaulted: bool, src: Source, tok: Tokenizer) -> Dict:
    """A fresh manifest, or the one of an earlier run of the same command (checked).

    Only the flags the user gave are compared: a default worked out from the source
    (``--val-tokens``) is taken from the earlier run, so a rerun after the source lost a
    file is not refused over a value nobody typed. An unfinished run whose shards no
    longer match the source (a file it read was removed or changed) starts over.
    """
    path = out / MANIFEST
    if not path.exists():
        _refuse_foreign_shards(out)
        return _fresh_manifest(settings, tok)
    try:
        manifest = json.loads(path.read_text())
        old = manifest["settings"]
    except (ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{path}: not a readable gpt2lab prepare manifest ({type(e).__name__}: {e}); "
                         "use another --out") from e
    # manifests written before --val-split cut val at a token count; before --format, all were text
    old = {"val_split": "tokens", "format": "text", **old}
    keys = [*settings, *(["tokenizer"] if "tokenizer" not in settings else [])]  # GPT-2's is no key
    differ = [k for k in keys if old.get(k) != settings.get(k) and not (k == "val_tokens" and val_defaulted)]
    if not manifest.get("complete") and not manifest.get("shards"):
        return _start_over(out, manifest, settings, None, tok)  # nothing was written yet
    if differ:
        was = ", ".join(f"{FLAGS[k]} {_flag_value(old.get(k), k)}" for k in differ)
        now = ", ".join(f"{FLAGS[k]} {_flag_value(settings.get(k), k)}" for k in differ)
        raise ShardError(f"{path}: this directory was prepared with {was}, not {now}; rerun with "
                         f"the same flags to {'resume' if not manifest['complete'] else 'check'} it, "
                         "or use another --out")
    if not manifest["complete"]:
        why = _source_changed(manifest, src)
        if why:
            return _start_over(out, manifest, settings, why, tok)
    for shard in manifest["shards"]:
        _check_done_shard(out / shard["name"], shard["tokens"])
    return manifest


def _flag_value(v, key: str = "") -> str:
    if key == "tokenizer":  # an identity: the directory it came from is not recorded
        return "(GPT-2's)" if v is None else f"DIR of tokenizer sha256:{str(v)[:12]}"
    return "(not given)" if v is None else str(v)


def _source_changed(manifest: Dict, src: Source) -> Optional[str]:
    """Why the unfinished run's shards cannot be continued from ``src``, or None."""
    if manifest.get("version") != VERSION:
        return f"it was started by another gpt2lab version (manifest version {manifest.get('version')})"
    for i, f in enumerate(manifest.get("files", [])):
        if i >= len(src.files) or src.files[i] != f["path"]:
            return f"{f['path']} is no longer where it was in the source"
        if os.path.getsize(f["path"]) != f["bytes"]:
            return f"{f['path']} changed size ({f['bytes']} -> {os.path.getsize(f['path'])} bytes)"
    return None


def _start_over(out: Path, manifest: Dict, settings: Dict, why: Optional[str], tok: Tokenizer) -> Dict:
    """Remove the unfinished run's own shards (listed, or renamed just before a crash)."""
    names = {s["name"] for s in manifest.get("shards", [])}
    for split in ("val", "train"):
        names.add(shard_name(split, sum(1 for s in manifest.get("shards", []) if s["split"] == split)))
    for name in sorted(names):
        for path in (out / name, mask_path(out / name)):
            if path.is_file():
                path.unlink()
    if why:
        warnings.warn(f"{out}: the unfinished prepare there cannot be resumed: {why}; starting over")
    _refuse_foreign_shards(out)
    return _fresh_manifest(settings, tok)


def _refuse_foreign_shards(out: Path) -> None:
    """system.rundir's rule: not another kind of gpt2lab directory (a run, an export), and no
    shards without a manifest; other files may stay beside the shards, as they always could."""
    found = rundir.inspect(str(out))
    shards = sorted(p.name for p in out.glob("*.bin"))
    if found.kind in (rundir.RUN, rundir.EXPORT, "hf_model"):
        raise ShardError(f"{out}: holds {rundir.what(found)}, not token shards; nothing was written there; "
                         "use an empty --out directory")
    if shards:
        raise ShardError(f"{out}: holds shards ({', '.join(shards[:3])}) but no {MANIFEST}; "
                         "use an empty --out directory")


def _check_done_shard(path: Path, tokens: int) -> None:
    if not path.exists():
        raise ShardError(f"{path}: listed in {MANIFEST} but missing; delete {path.parent} "
                         "and prepare again")
    if read_header(path) != tokens:
        raise ShardError(f"{path}: token count differs from {MANIFEST}; delete {path.parent} "
                         "and prepare again")


def _save_manifest(out: Path, manifest: Dict) -> None:
    write_json(str(out / MANIFEST), manifest, indent=1)


def _finish_manifest(manifest: Dict) -> None:
    splits: Dict[str, Dict] = {}
    for shard in manifest["shards"]:
        s = splits.setdefault(shard["split"], {"shards": [], "tokens": 0, "documents": 0})
        s["shards"].append(shard["name"])
        s["tokens"] += shard["tokens"]
        s["documents"] += shard["documents"]
        if "supervised" in shard:  # conversations: the tokens the loss is taken on
            s["supervised"] = s.get("supervised", 0) + shard["supervised"]
    manifest["splits"] = splits
    manifest["tokens"] = sum(s["tokens"] for s in splits.values())
    manifest["documents"] = manifest["resume"]["next_doc"]
    files = manifest["files"]  # first_doc/first_token -> documents/tokens of each file
    ends = [(f["first_doc"], f["first_token"]) for f in files[1:]] + [(manifest["documents"], manifest["tokens"])]
    manifest["files"] = [{"path": f["path"], "bytes": f["bytes"], "documents": d - f["first_doc"],
                          "tokens": t - f["first_token"]} for f, (d, t) in zip(files, ends)]
    manifest["complete"] = True
    del manifest["resume"]


# -- the pipeline ------------------------------------------------------------------------
class _Writer:
    """Cuts the token stream into shards; saves the resume state with each shard.

    Train shards hold ``shard_tokens`` tokens each (the last one fewer). The val split ends
    at ``val_end``, the end of the document that reaches ``val_tokens``, so its last shard
    is usually short and train starts with a whole document.
    """

    def __init__(self, out: Path, manifest: Dict, src: Source) -> None:
        self.out, self.manifest, self.src = out, manifest, src
        s = manifest["settings"]
        self.shard_tokens, self.val_tokens = s["shard_tokens"], s["val_tokens"]
        r = manifest["resume"]
        self.doc, self.offset, self.written, self.val_end = r["next_doc"], r["offset"], r["tokens"], r["val_end"]
        if self.val_end is None and s.get("val_split", "tokens") == "tokens":
            self.val_end = self.val_tokens  # a token count, wherever it falls in a document
        self.buf = np.empty(self.shard_tokens, dtype=manifest.get("dtype", "uint16"))
        # conversations: the loss mask beside the tokens, cut into shards at the same places
        self.mask = np.empty(self.shard_tokens, dtype=np.uint8) if s.get("format") == "chat" else None
        self.fill, self.docs_in_shard = 0, 0

    def _in_val(self) -> bool:
        """Whether the shard being filled (it starts at ``self.written``) belongs to val."""
        return self.val_end is None or self.written < self.val_end

    def _files_seen(self, base: int, starts: np.ndarray, n_docs: int) -> None:
        """Record where each source file read so far starts in the stream (per-file counts)."""
        files = self.manifest["files"]
        while len(files) < len(self.src.file_starts):
            i = len(files)
            d = self.src.file_starts[i]
            if d >= self.doc + n_docs:
                break
            token = base + int(starts[d - self.doc]) if d >= self.doc else base
            path = self.src.files[i]
            files.append({"path": path, "bytes": os.path.getsize(path), "first_doc": d, "first_token": token})

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        """Append whole documents (concatenated, EOT first; conversations with their loss ``mask``);
        cut and write shards as they fill.

        Vectorized over the documents: the Python work is per shard, not per document.
        """
        ends = np.cumsum(lengths)
        starts = ends - lengths
        base = self.written + self.fill - self.offset  # stream position of this batch's first token
        self._files_seen(base, starts, len(lengths))
        if self.val_end is None:  # "documents": val ends with the first document to reach val_tokens
            k = int(np.searchsorted(base + ends, self.val_tokens, side="left"))
            if k < len(lengths):
                self.val_end = base + int(ends[k])
        pos, self.offset = self.offset, 0  # only the first document after a resume is partial
        while pos < len(tokens):
            cap = self.shard_tokens
            if self.val_end is not None and self.written < self.val_end:
                cap = min(cap, self.val_end - self.written)
            n = min(cap - self.fill, len(tokens) - pos)
            self.buf[self.fill:self.fill + n] = tokens[pos:pos + n]
            if self.mask is not None:
                self.mask[self.fill:self.fill + n] = mask[pos:pos + n]
            self.docs_in_shard += int(np.searchsorted(starts, pos + n) - np.searchsorted(starts, pos))
            self.fill, pos = self.fill + n, pos + n
            if self.fill == cap:
                k = int(np.searchsorted(ends, pos, side="right"))  # documents finished so far
                self._flush(self.doc + k, pos - int(starts[k]) if k < len(lengths) else 0)
        self.doc += len(lengths)

    def _flush(self, next_doc: int, offset: int) -> None:
        split = "val" if self._in_val() else "train"
        index = sum(1 for s in self.manifest["shards"] if s["split"] == split)
        name = shard_name(split, index)
        entry = {"name": name, "split": split, "tokens": self.fill, "documents": self.docs_in_shard}
        if self.mask is not None:  # the mask first: a shard listed or found on disk has its mask
            write_mask(mask_path(self.out / name), self.mask[:self.fill])
            entry["supervised"] = int(self.mask[:self.fill].sum(dtype=np.int64))
        write_shard(self.out / name, self.buf[:self.fill])
        self.written += self.fill
        self.manifest["shards"].append(entry)
        self.manifest["resume"] = {"next_doc": next_doc, "offset": offset, "tokens": self.written,
                                   "val_end": self.val_end}
        _save_manifest(self.out, self.manifest)  # after the rename: a listed shard is whole
        self.fill, self.docs_in_shard = 0, 0

    def finish(self) -> None:
        if self.fill:
            self._flush(self.doc, 0)
        self._files_seen(self.written, np.zeros(0, dtype=np.int64), 0)
        for i in range(len(self.manifest["files"]), len(self.src.file_starts)):  # files with no documents left
            path = self.src.files[i]
            self.manifest["files"].append({"path": path, "bytes": os.path.getsize(path),
                                           "first_doc": self.doc, "first_token": self.written})
        self.manifest["resume"]["next_doc"] = self.doc
        if not self.manifest["shards"]:
            raise SourceError(f"source {self.manifest['settings']['source']!r}: no documents; "
                              "check the path, glob or --limit-docs")
        if self.written == self.doc:  # one <|endoftext|> per document and nothing else
            raise SourceError(f"source {self.manifest['settings']['source']!r}: all {self.doc} document(s) "
                              "are empty; point --source at files with text")
        _finish_manifest(self.manifest)
        for info in self.manifest["splits"].values():  # a split that begins inside a document holds it too
            if open_shard(self.out / info["shards"][0])[0] != self.manifest["eot_id"]:
                info["documents"] += 1
        if "train" not in self.manifest["splits"]:
            warnings.warn(f"{self.out}: all {self.written} tokens went to val (val_tokens "
                          f"{self.val_tokens}); pass a smaller --val-tokens to get a train split")
        _save_manifest(self.out, self.manifest)


def _run(src: Source, out: Path, manifest: Dict, workers: int, progress: bool, tok: Tokenizer) -> None:
    # the temporaries older gpt2lab versions wrote beside their shards (SHARD.bin.tmp and
    # manifest.json.tmp); another program's *.tmp in --out is not ours to remove
    for stale in [*out.glob("*.bin.tmp"), *out.glob(MANIFEST + ".tmp")]:
        stale.unlink()
    sweep_stale(str(out))
    writer = _Writer(out, manifest, src)
    docs = src.documents(writer.doc, manifest["settings"]["limit_docs"])
    size = src.size_bytes or TASK_CHARS_MAX * 8 * workers
    task_chars = min(TASK_CHARS_MAX, max(TASK_CHARS_MIN, size // (8 * workers)))
    threads = use_threads(src.size_bytes, workers)
    chat_data = manifest["settings"].get("format") == "chat"
    encode = functools.partial(encode_conversations if chat_data else encode_documents, tokenizer=tok)
    with _token_stream(docs, workers, task_chars, threads, encode) as stream, \
            _progress(progress, writer.written) as bar:
        for tokens, lengths, *mask in stream:
            writer.add(tokens, lengths, *mask)
            bar.update(int(lengths.sum()))
            bar.set_postfix(docs=writer.doc, refresh=False)
    writer.finish()


# -- tokenizing, in order, in parallel ---------------------------------------------------
def encode_documents(docs: List[Document], tokenizer: Optional[Tokenizer] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Documents -> (tokens, each document EOT first, concatenated, in the shard dtype of ``tokenizer``'s
    vocabulary (default GPT-2's: uint16); lengths)."""
    enc = tokenizer if tokenizer is not None else gpt2_tokenizer()
    ids = [enc.encode_ordinary(as_text(d)) for d in docs]
    lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    flat = np.empty(int(lengths.sum()), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for s, x in zip(starts, ids):
        flat[s] = enc.eot_id
        flat[s + 1:s + 1 + len(x)] = x
    if len(flat) and (flat.max() >= enc.n_vocab or flat.min() < 0):
        raise ValueError(f"token id {int(flat.max())} does not fit the tokenizer's {enc.n_vocab} tokens")
    return flat.astype(token_dtype(enc.n_vocab)), lengths


def encode_conversations(docs: List[Document], tokenizer: Optional[Tokenizer] = None,
                         ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """JSON-lines conversations -> (uint16 tokens, lengths, uint8 loss mask) in data/chat.py's
    template; a record that is not a conversation is a SourceError naming its file, line and field."""
    records = []
    for doc in docs:
        if not isinstance(doc, JsonLine):
            raise SourceError("conversations are read from JSON-lines files (.jsonl, also compressed); "
                              "prepare text with --format text")
        try:
            records.append(chat.conversation(doc.row()))
        except chat.ChatFormatError as e:
            raise SourceError(f"{doc.path}:{doc.lineno}: {e}; fix or remove that line") from e
    return chat.encode_records(records, tokenizer)


def _tasks(docs: Iterable[Document], task_chars: int) -> Iterator[List[Document]]:
    batch: List[Document] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc) if isinstance(doc, str) else len(doc.line)
        if chars >= task_chars or len(batch) >= TASK_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


@contextmanager
def _token_stream(docs: Iterable[Document], workers: int, task_chars: int, threads: bool = False,
                  encode=encode_documents):
    """``encode``'s (tokens, lengths[, mask]) per task, in order, from ``workers`` threads or processes
    (``encode`` holds its tokenizer, built once here: forked workers and threads share it)."""
    if workers == 1:
        yield map(encode, _tasks(docs, task_chars))
        return
    if threads:
        executor = ThreadPoolExecutor(workers, thread_name_prefix="gpt2lab-prepare")
        try:
            yield _ordered(executor, _tasks(docs, task_chars), 2 * workers, encode)
        finally:  # Ctrl-C or an error: drop queued tasks, let running ones (<= 1 MB of text) end
            executor.shutdown(wait=True, cancel_futures=True)
        return
    with _process_pool(docs, workers, task_chars, encode) as results:
        yield results


# -- the process pool --------------------------------------------------------------------
# multiprocessing.Pool is not used: its terminate() can deadlock when Ctrl-C lands while a
# worker is sending a result (it drains queues under locks a killed worker may hold), and
# every worker prints a KeyboardInterrupt traceback. Here each worker has its own pair of
# pipes and no lock is shared: task i goes to worker i % n and its result is read back
# from that worker, so the order is kept. Workers ignore SIGINT (a terminal's Ctrl-C
# reaches the whole process group); the main process alone decides, and on any way out
# but the normal one it SIGKILLs them, which cannot block.
POLL_S = 0.2  # how often a waiting main process checks that the workers are alive


def _worker(tasks, results, encode) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    while True:
        try:
            task = tasks.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            reply = (True, encode(task))
        except Exception as e:  # SourceError of a bad line: the main process raises it, in order
            reply = (False, e)
        try:
            results.send(reply)
        except (TypeError, AttributeError, pickle.PicklingError):  # an exception that does not pickle
            results.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))


class _Dispatch(threading.Thread):
    """Reads the source, cuts tasks and sends task i to worker i % n (in the main process,
    beside the result loop, so a worker blocked sending a result never blocks the reading)."""

    def __init__(self, docs, conns, task_chars) -> None:
        super().__init__(name="gpt2lab-prepare-dispatch", daemon=True)
        self.docs, self.conns, self.task_chars = docs, conns, task_chars
        self.sent, self.done, self.error, self.stop = 0, False, None, False

    def run(self) -> None:
        try:
            for task in _tasks(self.docs, self.task_chars):
                if self.stop:
                    return
                self.conns[self.sent % len(self.conns)].send(task)
                self.sent += 1
            for c in self.conns:
                c.send(None)
        except BaseException as e:  # a source that cannot be read: raised in order by the reader
            if not self.stop:
                self.error = e
        finally:
            self.done = True


@contextmanager
def _process_pool(docs: Iterable[Document], workers: int, task_chars: int, encode):
    # fork on Linux: workers start in milliseconds with the tokenizer already built
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    procs, task_conns, result_conns = [], [], []
    dispatch = None
    masked = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    try:
        if masked:  # a Ctrl-C during the forks waits until every worker ignores SIGINT
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for _ in range(workers):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, args=(task_r, result_w, encode), daemon=True,
                                name="gpt2lab-prepare-worker")
                p.start()
                task_r.close()
                result_w.close()
                procs.append(p)
                task_conns.append(task_w)
                result_conns.append(result_r)
        finally:
            if masked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        dispatch = _Dispatch(docs, task_conns, task_chars)
        dispatch.start()
        yield _results(dispatch, procs, result_conns)
    except BaseException:
        if dispatch is not None:
            dispatch.stop = True
        for p in procs:  # SIGKILL: nothing a worker is doing can hold us up
            p.kill()
        for p in procs:
            p.join(5)
        raise
    else:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    finally:
        if dispatch is not None:
            dispatch.stop = True
            dispatch.join(5)
        for c in task_conns + result_conns:
            c.close()


def _results(dispatch: "_Dispatch", procs, conns) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    i = 0
    while True:
        if dispatch.done and i >= dispatch.sent:  # every task's result is in
            if dispatch.error is not None:
                raise dispatch.error
            return
        conn, proc = conns[i % len(conns)], procs[i % len(conns)]
        if not conn.poll(POLL_S):
            if not proc.is_alive():
                raise _died(proc)
            continue
        try:
            ok, value = conn.recv()
        except EOFError:  # the worker is gone: after its last task (the end), or killed
            dispatch.join(5)
            if dispatch.done and i >= dispatch.sent:
                continue
            proc.join(1)
            raise _died(proc) from None
        if not ok:
            raise value
        yield value
        i += 1


def _died(proc) -> RuntimeError:
    return RuntimeError(f"a tokenizer worker died (exit code {proc.exitcode}); run the same "
                        "prepare command again to resume")


def _ordered(executor: ThreadPoolExecutor, tasks: Iterator[List[Document]], window: int, encode=encode_documents):
    """Results of ``encode`` over ``tasks`` in order, at most ``window`` in flight
    (``Executor.map`` would read the whole source ahead)."""
    pending: deque = deque()  # on an error, the executor's shutdown cancels what is still queued
    for task in tasks:
        pending.append(executor.submit(encode, task))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


@contextmanager
def _progress(enabled: bool, initial: int):
    from tqdm import tqdm

    bar = tqdm(disable=not enabled, unit="tok", unit_scale=True, initial=initial,
               desc="prepare", dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()

"""A ``gpt2lab prepare`` directory as it is written: its manifest.json, the shards cut from the token
stream, and (conversations) the held-out file.

The manifest: what a run starts from and what it leaves. A new directory gets a fresh manifest; a
directory with an earlier run's manifest of the same command is resumed (unfinished) or checked
(finished); one made with other flags or of another format version (shards.py's
``read_manifest``) is refused. Each source file is recorded by its content (``sha256``) as
well as its path: where a file is no longer the one recorded (edited in place, removed, another in its
place, or recorded by an earlier gpt2lab without its content), the directory goes back to its last
shard made wholly of the files before it (``_roll_back``, a warning naming the file) and the prepare
goes on from there, so no shard ever mixes old and new text.

The shard writer (``write_shards``): the token stream, cut into shards at fixed places. The first
``val_tokens`` tokens (``--val-split tokens``), or the documents up to the one that reaches them
(``documents``), or the first ``val_docs`` documents (``--val-docs``, and ``--val-bytes`` as the
documents its bytes take), are the ``val`` split and the rest ``train``, each in shards of
``shard_tokens``. Each finished shard is written whole (temp name, then rename) and then listed in the
manifest with the (document, offset) to resume from, so a run that stopped goes on from its last listed
shard and writes the same bytes as one that never stopped; the writer adds the per-split and per-file
counts of a finished directory.

The held-out conversations of prepared chat data (``write_held_out``): the val split's conversations,
written beside the shards as messages JSON lines (``held_out.jsonl``), so ``gpt2lab eval chat`` scores a
model on the very conversations its run validated on and never trained on. ``gpt2lab prepare`` writes
the file when it has finished a directory of conversations (and on a rerun of a finished one without
it), atomically, and names it in the manifest (``"held_out"``: an optional key, as ``chat_template``;
the shards' format is unchanged). ``held_out_file`` finds it. The held-out conversations are those
wholly in the val split: under ``--val-split documents`` (conversations' default) all of them, under
``tokens`` all but the one the cut runs through, which continues in train. They are read again from the
source, which prepare has checked is the one the shards were made from.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from pathlib import Path
from typing import Dict, Iterable, Optional

import numpy as np

from gpt2lab.data import chat
from gpt2lab.data.shards import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    ShardError,
    mask_path,
    open_shard,
    read_header,
    read_manifest,
    shard_name,
    unreadable,
    write_shard,
)
from gpt2lab.data.sources import SourceError, TextSource
from gpt2lab.data.tokenizer import GPT2, Tokenizer, short, token_dtype
from gpt2lab.system.files import atomic_write, sha256_file, write_json


def fresh_manifest(settings: Dict, tok: Tokenizer) -> Dict:
    """The manifest of a run that has written nothing yet."""
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "source": settings["source"],
        "tokenizer": tok.identity or GPT2,
        "eot_id": tok.eot_id,
        "vocab_size": tok.n_vocab,
        "dtype": token_dtype(tok.n_vocab).name,
        "settings": settings,
        "complete": False,
        "shards": [],
        "files": [],
        # the loader takes the loss on the masked tokens only; a run records the template
        **({"chat_template": chat.TEMPLATE} if settings["format"] == "chat" else {}),
    }


def start_manifest(out: Path, settings: Dict, val_defaulted: bool, src: TextSource, tok: Tokenizer) -> Dict:
    """A fresh manifest, or the one of an earlier run of the same command (checked, and rolled back
    to before the first source file that is not the one recorded).

    Only the flags the user gave are compared: a default worked out from the source
    (``--val-tokens``) is taken from the earlier run, so a rerun after the source lost a
    file is not refused over a value nobody typed.
    """
    path = out / MANIFEST_FILE
    manifest = read_manifest(out, finished=False)
    if not manifest:
        return fresh_manifest(settings, tok)
    old = manifest["settings"] if isinstance(manifest.get("settings"), dict) else {}
    missing = ["dtype"] if "dtype" not in manifest else []
    missing += [f"settings.{k}" for k in ("val_split", "format") if k not in old]
    if missing:  # written before these were recorded: an older layout, not read
        raise unreadable(path, KeyError(", ".join(missing)), "use another --out")
    keys = [*settings, *(["tokenizer"] if "tokenizer" not in settings else [])]  # GPT-2's is no key
    differ = [k for k in keys if old.get(k) != settings.get(k) and not (k == "val_tokens" and val_defaulted)]
    if not manifest.get("complete") and not manifest.get("shards"):  # nothing was written yet
        _roll_back(out, manifest, 0)
        return fresh_manifest(settings, tok)
    if differ:
        was, now = (", ".join(_said(k, given.get(k)) for k in differ) for given in (old, settings))
        raise ShardError(
            f"{path}: this directory was prepared with {was}, not {now}; rerun with "
            f"the same flags to {'resume' if not manifest['complete'] else 'check'} it, "
            "or use another --out"
        )
    for shard in manifest["shards"]:
        path = out / shard["name"]
        if not path.exists():
            raise ShardError(f"{path}: listed in {MANIFEST_FILE} but missing; delete {out} and prepare again")
        if read_header(path)[0] != shard["tokens"]:
            raise ShardError(f"{path}: token count differs from {MANIFEST_FILE}; delete {out} and prepare again")
    changed = _first_changed(manifest, src.files)
    if changed is None:
        return manifest
    i, why = changed
    # a --val-tokens worked out from the source moves with it: then the whole directory goes
    _roll_back(out, manifest, i if old["val_tokens"] == settings["val_tokens"] else 0)
    kept = len(manifest["shards"])
    again = f"that file on, after the {kept} shard(s) made before it" if kept else "the start"
    warnings.warn(f"{out}: {why}; preparing it again from {again}")
    return manifest if kept else fresh_manifest(settings, tok)


def _said(key: str, v) -> str:
    """A setting as the prepare flag that gives it, with its value (``--val-tokens 5``), for a refusal naming it."""
    # a tokenizer by its identity, as every refusal names one: the directory it came from is not recorded
    value = short(v) if key == "tokenizer" else "(not given)" if v is None else v
    return f"--{key.replace('_', '-')} {value}"


def _first_changed(manifest: Dict, paths: list) -> Optional[tuple[int, str]]:
    """(index, why) of the first recorded source file that is not the file there now, or None."""
    files = manifest["files"]
    for i, f in enumerate(files):
        if i >= len(paths) or paths[i] != f["path"]:
            return i, f"{f['path']} is no longer file {i + 1} of the source"
        if "sha256" not in f:
            return i, f"{f['path']}: its content is not recorded (prepared by an earlier gpt2lab)"
        if sha256_file(paths[i]) != f["sha256"]:
            return i, f"{f['path']} changed since it was prepared (its content differs)"
    if manifest["complete"] and len(paths) > len(files) and manifest["documents"] != manifest["settings"]["limit_docs"]:
        return len(files), f"{paths[len(files)]} is new in the source"
    return None


def _roll_back(out: Path, manifest: Dict, i: int) -> None:
    """Make ``manifest`` an unfinished one that resumes before source file ``i``: keep the shards that
    end before the file's first token, remove the later ones (its own: listed, or renamed just before
    a crash)."""
    files, shards = manifest["files"], manifest["shards"]
    cut = 0 if i == 0 else files[i]["first_token"] if i < len(files) else manifest["tokens"]
    ends = list(itertools.accumulate(s["tokens"] for s in shards))
    keep = [s for s, end in zip(shards, ends) if end < cut]
    names = {s["name"] for s in shards[len(keep) :]}
    names |= {shard_name(split, sum(1 for s in shards if s["split"] == split)) for split in ("val", "train")}
    for name in sorted(names):
        for path in (out / name, mask_path(out / name)):
            if path.is_file():
                path.unlink()
    for key in ("splits", "tokens", "documents", "held_out", "resume"):  # a finished one's counts, the held-out file
        manifest.pop(key, None)
    manifest.update(complete=False, files=files[:i], shards=keep)


def save_manifest(out: Path, manifest: Dict) -> None:
    write_json(str(out / MANIFEST_FILE), manifest, indent=1)


# -- the shard writer ------------------------------------------------------------------------------
def resume_point(manifest: Dict) -> Dict:
    """Where the token stream goes on: after the last shard listed (``start_manifest`` may have rolled
    them back to an earlier one): the next document, the offset into it, the tokens written and where
    the val split ends (None: not known yet)."""
    shards = manifest["shards"]
    return shards[-1]["resume"] if shards else {"next_doc": 0, "offset": 0, "tokens": 0, "val_end": None}


def write_shards(out: Path, manifest: Dict, src: TextSource, batches: Iterable, val_docs: Optional[int], bar) -> None:
    """Cut the token stream into shards, saving the resume point with each, and finish the manifest.

    ``batches``: whole documents from ``resume_point``'s on, each (tokens, concatenated, EOT first;
    lengths; conversations: their loss mask); ``bar`` counts their tokens. Train shards hold
    ``shard_tokens`` tokens each (the last one fewer). The val split ends at ``val_end``: a token count
    (``--val-split tokens``), or the end of the document that reaches ``val_tokens`` (or of document
    ``val_docs``), so its last shard is usually short and train starts with a whole document.
    Vectorized over the documents: the Python work is per shard, not per document.
    """
    s, shards, files = manifest["settings"], manifest["shards"], manifest["files"]
    r = resume_point(manifest)
    doc, offset, written, val_end = r["next_doc"], r["offset"], r["tokens"], r["val_end"]
    if val_end is None and (s["val_split"] == "tokens" or s["val_tokens"] == 0 or val_docs == 0):
        val_end = s["val_tokens"] or 0  # a token count, wherever it falls in a document
    parts: list = []  # the (tokens, mask) pieces of the shard being filled, ``fill`` tokens in all
    fill = 0

    def files_seen(base: int, starts: np.ndarray, n_docs: int) -> None:
        # each source file read so far that starts before document ``doc + n_docs``: by its content
        # (sha256: ``start_manifest`` checks it) and where it starts in the stream (the per-file counts)
        while len(files) < len(src.file_starts) and (d := src.file_starts[len(files)]) < doc + n_docs:
            path = src.files[len(files)]
            entry = {"path": path, "bytes": os.path.getsize(path), "sha256": sha256_file(path), "first_doc": d}
            files.append({**entry, "first_token": base + int(starts[d - doc]) if d >= doc else base})

    def flush(next_doc: int, offset: int) -> int:
        split = "val" if val_end is None or written < val_end else "train"  # where the shard starts
        name = shard_name(split, sum(1 for x in shards if x["split"] == split))
        tokens = np.concatenate([t for t, _ in parts])
        entry = {"name": name, "split": split, "tokens": len(tokens)}
        entry["documents"] = int((tokens == manifest["eot_id"]).sum())  # those that begin in it: one EOT each
        if parts[0][1] is not None:  # the mask first: a shard listed or found on disk has its mask
            mask = np.concatenate([m for _, m in parts])
            write_shard(mask_path(out / name), mask)
            entry["supervised"] = int(mask.sum(dtype=np.int64))
        write_shard(out / name, tokens)
        # where to resume after this shard: a source file changed later goes back to a shard's (``_roll_back``)
        entry["resume"] = {"next_doc": next_doc, "offset": offset, "tokens": written + len(tokens), "val_end": val_end}
        shards.append(entry)
        save_manifest(out, manifest)  # after the rename: a listed shard is whole
        parts.clear()
        return len(tokens)

    for tokens, lengths, *mask in batches:
        ends = np.cumsum(lengths)
        starts = ends - lengths
        base = written + fill - offset  # stream position of this batch's first token
        files_seen(base, starts, len(lengths))
        if val_end is None:  # "documents": val ends with document val_docs, or the first to reach val_tokens
            k = val_docs - 1 - doc if val_docs is not None else int(np.searchsorted(base + ends, s["val_tokens"]))
            val_end = base + int(ends[k]) if 0 <= k < len(lengths) else None
        pos, offset = offset, 0  # only the first document after a resume is partial
        while pos < len(tokens):
            in_val = val_end is not None and written < val_end
            cap = min(s["shard_tokens"], val_end - written) if in_val else s["shard_tokens"]
            n = min(cap - fill, len(tokens) - pos)
            parts.append((tokens[pos : pos + n], mask[0][pos : pos + n] if mask else None))
            fill, pos = fill + n, pos + n
            if fill == cap:
                k = int(np.searchsorted(ends, pos, side="right"))  # documents finished so far
                written += flush(doc + k, pos - int(starts[k]) if k < len(lengths) else 0)
                fill = 0
        doc += len(lengths)
        bar.update(int(lengths.sum()))
        bar.set_postfix(docs=doc, refresh=False)
    if fill:
        written += flush(doc, 0)
    files_seen(written, np.zeros(1, dtype=np.int64), 1)  # files with no documents left: at the end
    source = f"source {s['source']!r}"
    if not shards:
        raise SourceError(f"{source}: no documents; check the path, glob or --limit-docs")
    if written == doc:  # one <|endoftext|> per document and nothing else
        raise SourceError(f"{source}: all {doc} document(s) are empty; point --source at files with text")
    # a finished directory's counts: per split, in all, per file
    splits: Dict[str, Dict] = {}
    for shard in shards:
        info = splits.setdefault(shard["split"], {"shards": []})
        info["shards"].append(shard["name"])
        for key in ("tokens", "documents", "supervised"):  # supervised (conversations): the tokens the loss is on
            if key in shard:
                info[key] = info.get(key, 0) + shard[key]
    for info in splits.values():  # a split that begins inside a document holds it too
        info["documents"] += int(open_shard(out / info["shards"][0])[0] != manifest["eot_id"])
    ends = [(f["first_doc"], f["first_token"]) for f in files[1:]] + [(doc, written)]
    for f, (d, t) in zip(files, ends):  # the documents and tokens of each file, from where each starts
        f.update(documents=d - f["first_doc"], tokens=t - f["first_token"])
    manifest.pop("resume", None)  # kept by an unfinished directory of an earlier gpt2lab
    manifest.update(splits=splits, tokens=written, documents=doc, complete=True)
    save_manifest(out, manifest)


# -- the held-out conversations ------------------------------------------------------------------
HELD_OUT = "held_out.jsonl"
KEY = "held_out"  # the manifest's key naming the file


def write_held_out(src: TextSource, out: Path, manifest: Dict) -> None:
    """Write ``out``'s held-out conversations, unless its finished manifest already names a file that
    is there; record the file in the manifest (nothing without a val split)."""
    path = out / HELD_OUT
    if manifest.get(KEY) == HELD_OUT and path.is_file():
        return
    # the source's first conversations wholly in the val split (none without one)
    val, train = manifest["splits"].get("val", {"documents": 0}), manifest["splits"].get("train")
    n = val["documents"]
    if train and open_shard(out / train["shards"][0])[0] != manifest["eot_id"]:
        n -= 1  # train starts inside the val split's last conversation: it is not held out
    if n < 1:
        return
    with atomic_write(str(path), "w", what_next="free some space and run the same prepare command again") as f:
        for doc in src.documents(0, n):  # the source's first n records: encode_conversations read them
            f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in doc.turns()]}) + "\n")
    manifest[KEY] = HELD_OUT
    save_manifest(out, manifest)


def held_out_file(data_dir: str) -> Optional[str]:
    """The held-out conversations of the prepared directory ``data_dir``; None where it has none
    (text, no val split, or prepared before the file was written). Its manifest is read as every
    reader reads it (another version is a ShardError naming it)."""
    path = os.path.join(data_dir, HELD_OUT)
    return path if read_manifest(data_dir).get(KEY) == HELD_OUT and os.path.isfile(path) else None

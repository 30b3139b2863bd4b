"""A ``gpt2lab prepare`` directory as it is written: its manifest.json, the shards cut from the token
stream, and (conversations) the held-out file.

The manifest: what a run starts from and what it leaves. A new directory gets a fresh manifest; a
directory with an earlier run's manifest of the same command is resumed (unfinished) or checked
(finished); one made with other flags or of another format version (shards.py's
``check_manifest_version``) is refused. Each source file is recorded by its content (``sha256``) as
well as its path: where a file is no longer the one recorded (edited in place, removed, another in its
place, or recorded by an earlier gpt2lab without its content), the directory goes back to its last
shard made wholly of the files before it (``_roll_back``, a warning naming the file) and the prepare
goes on from there, so no shard ever mixes old and new text.

The shard writer (``ShardWriter``): the token stream, cut into shards at fixed places. The first
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
from typing import Dict, Optional

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
from gpt2lab.data.tokenizer import GPT2, Tokenizer, token_dtype
from gpt2lab.system.files import atomic_write, sha256_file, write_json


def fresh_manifest(settings: Dict, tok: Tokenizer) -> Dict:
    """The manifest of a run that has written nothing yet."""
    manifest = {
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
    }
    if settings["format"] == "chat":  # the loader takes the loss on the masked tokens only; a run records the template
        manifest["chat_template"] = chat.TEMPLATE
    return manifest


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
        _check_done_shard(out / shard["name"], shard["tokens"])
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
    if key == "tokenizer":  # an identity: the directory it came from is not recorded
        value = "(GPT-2's)" if v is None else f"DIR of tokenizer sha256:{str(v)[:12]}"
    else:
        value = "(not given)" if v is None else str(v)
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


def _check_done_shard(path: Path, tokens: int) -> None:
    if not path.exists():
        raise ShardError(f"{path}: listed in {MANIFEST_FILE} but missing; delete {path.parent} and prepare again")
    if read_header(path)[0] != tokens:
        raise ShardError(f"{path}: token count differs from {MANIFEST_FILE}; delete {path.parent} and prepare again")


def save_manifest(out: Path, manifest: Dict) -> None:
    write_json(str(out / MANIFEST_FILE), manifest, indent=1)


# -- the shard writer ------------------------------------------------------------------------------
class ShardWriter:
    """Cuts the token stream into shards; saves the resume state with each shard.

    Train shards hold ``shard_tokens`` tokens each (the last one fewer). The val split ends
    at ``val_end``, the end of the document that reaches ``val_tokens`` (or of document
    ``val_docs``), so its last shard is usually short and train starts with a whole document.
    """

    def __init__(self, out: Path, manifest: Dict, src: TextSource, val_docs: Optional[int] = None) -> None:
        self.out, self.manifest, self.src = out, manifest, src
        s = manifest["settings"]
        self.shard_tokens, self.val_tokens, self.val_docs = s["shard_tokens"], s["val_tokens"], val_docs
        # go on after the last shard listed (``start_manifest`` may have rolled them back to an earlier one)
        shards = manifest["shards"]
        r = shards[-1]["resume"] if shards else {"next_doc": 0, "offset": 0, "tokens": 0, "val_end": None}
        self.doc, self.offset, self.written, self.val_end = r["next_doc"], r["offset"], r["tokens"], r["val_end"]
        if self.val_end is None and (s["val_split"] == "tokens" or self.val_tokens == 0):
            self.val_end = self.val_tokens  # a token count, wherever it falls in a document
        if self.val_end is None and val_docs == 0:
            self.val_end = 0
        self.buf = np.empty(self.shard_tokens, dtype=manifest["dtype"])
        # conversations: the loss mask beside the tokens, cut into shards at the same places
        self.mask = np.empty(self.shard_tokens, dtype=np.uint8) if s["format"] == "chat" else None
        self.fill, self.docs_in_shard = 0, 0

    def _files_seen(self, base: int, starts: np.ndarray, n_docs: int) -> None:
        """Record each source file read so far that starts before document ``self.doc + n_docs``: by its
        content (sha256: ``start_manifest`` checks it) and where it starts in the stream (per-file counts)."""
        files, file_starts = self.manifest["files"], self.src.file_starts
        while len(files) < len(file_starts) and (d := file_starts[len(files)]) < self.doc + n_docs:
            path = self.src.files[len(files)]
            entry = {"path": path, "bytes": os.path.getsize(path), "sha256": sha256_file(path), "first_doc": d}
            files.append({**entry, "first_token": base + int(starts[d - self.doc]) if d >= self.doc else base})

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        """Append whole documents (concatenated, EOT first; conversations with their loss ``mask``);
        cut and write shards as they fill.

        Vectorized over the documents: the Python work is per shard, not per document.
        """
        ends = np.cumsum(lengths)
        starts = ends - lengths
        base = self.written + self.fill - self.offset  # stream position of this batch's first token
        self._files_seen(base, starts, len(lengths))
        if self.val_end is None:  # "documents": val ends with document val_docs, or the first to reach val_tokens
            if self.val_docs is not None:
                k = self.val_docs - 1 - self.doc
            else:
                k = int(np.searchsorted(base + ends, self.val_tokens, side="left"))
            if 0 <= k < len(lengths):
                self.val_end = base + int(ends[k])
        pos, self.offset = self.offset, 0  # only the first document after a resume is partial
        while pos < len(tokens):
            cap = self.shard_tokens
            if self.val_end is not None and self.written < self.val_end:
                cap = min(cap, self.val_end - self.written)
            n = min(cap - self.fill, len(tokens) - pos)
            self.buf[self.fill : self.fill + n] = tokens[pos : pos + n]
            if self.mask is not None:
                self.mask[self.fill : self.fill + n] = mask[pos : pos + n]
            self.docs_in_shard += int(np.searchsorted(starts, pos + n) - np.searchsorted(starts, pos))
            self.fill, pos = self.fill + n, pos + n
            if self.fill == cap:
                k = int(np.searchsorted(ends, pos, side="right"))  # documents finished so far
                self._flush(self.doc + k, pos - int(starts[k]) if k < len(lengths) else 0)
        self.doc += len(lengths)

    def _flush(self, next_doc: int, offset: int) -> None:
        split = "val" if self.val_end is None or self.written < self.val_end else "train"  # where the shard starts
        index = sum(1 for s in self.manifest["shards"] if s["split"] == split)
        name = shard_name(split, index)
        entry = {"name": name, "split": split, "tokens": self.fill, "documents": self.docs_in_shard}
        if self.mask is not None:  # the mask first: a shard listed or found on disk has its mask
            write_shard(mask_path(self.out / name), self.mask[: self.fill])
            entry["supervised"] = int(self.mask[: self.fill].sum(dtype=np.int64))
        write_shard(self.out / name, self.buf[: self.fill])
        self.written += self.fill
        # where to resume after this shard: a source file changed later goes back to a shard's (``_roll_back``)
        entry["resume"] = {"next_doc": next_doc, "offset": offset, "tokens": self.written, "val_end": self.val_end}
        self.manifest["shards"].append(entry)
        save_manifest(self.out, self.manifest)  # after the rename: a listed shard is whole
        self.fill, self.docs_in_shard = 0, 0

    def finish(self) -> None:
        if self.fill:
            self._flush(self.doc, 0)
        self._files_seen(self.written, np.zeros(1, dtype=np.int64), 1)  # files with no documents left: at the end
        if not self.manifest["shards"]:
            raise SourceError(
                f"source {self.manifest['settings']['source']!r}: no documents; check the path, glob or --limit-docs"
            )
        if self.written == self.doc:  # one <|endoftext|> per document and nothing else
            raise SourceError(
                f"source {self.manifest['settings']['source']!r}: all {self.doc} document(s) "
                "are empty; point --source at files with text"
            )
        # a finished directory's counts: per split, in all, per file
        splits: Dict[str, Dict] = {}
        for shard in self.manifest["shards"]:
            info = splits.setdefault(shard["split"], {"shards": []})
            info["shards"].append(shard["name"])
            for key in ("tokens", "documents", "supervised"):  # supervised (conversations): the tokens the loss is on
                if key in shard:
                    info[key] = info.get(key, 0) + shard[key]
        for info in splits.values():  # a split that begins inside a document holds it too
            info["documents"] += int(open_shard(self.out / info["shards"][0])[0] != self.manifest["eot_id"])
        files = self.manifest["files"]  # the documents and tokens of each file, from where each starts
        ends = [(f["first_doc"], f["first_token"]) for f in files[1:]] + [(self.doc, self.written)]
        for f, (d, t) in zip(files, ends):
            f.update(documents=d - f["first_doc"], tokens=t - f["first_token"])
        self.manifest.pop("resume", None)  # kept by an unfinished directory of an earlier gpt2lab
        self.manifest.update(splits=splits, tokens=self.written, documents=self.doc, complete=True)
        save_manifest(self.out, self.manifest)


# -- the held-out conversations ------------------------------------------------------------------
HELD_OUT = "held_out.jsonl"
KEY = "held_out"  # the manifest's key naming the file


def write_held_out(src: TextSource, out: Path, manifest: Dict) -> Optional[str]:
    """Write ``out``'s held-out conversations, unless its finished manifest already names a file that
    is there; record the file in the manifest. Returns its path (None: no val split, nothing written)."""
    path = out / HELD_OUT
    if manifest.get(KEY) == HELD_OUT and path.is_file():
        return str(path)
    # the source's first conversations wholly in the val split (none without one)
    val, train = manifest["splits"].get("val", {"documents": 0}), manifest["splits"].get("train")
    n = val["documents"]
    if train and open_shard(out / train["shards"][0])[0] != manifest["eot_id"]:
        n -= 1  # train starts inside the val split's last conversation: it is not held out
    if n < 1:
        return None
    with atomic_write(str(path), "w", what_next="free some space and run the same prepare command again") as f:
        for doc in src.documents(0, n):  # the source's first n records: encode_conversations read them
            f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in doc.turns()]}) + "\n")
    manifest[KEY] = HELD_OUT
    save_manifest(out, manifest)
    return str(path)


def held_out_file(data_dir: str) -> Optional[str]:
    """The held-out conversations of the prepared directory ``data_dir``; None where it has none
    (text, no val split, or prepared before the file was written). Its manifest is read as every
    reader reads it (another version is a ShardError naming it)."""
    name = read_manifest(data_dir).get(KEY)  # {} where there is no manifest
    if not isinstance(name, str) or os.path.basename(name) != name:  # a file beside the shards, nothing else
        return None
    path = os.path.join(data_dir, name)
    return path if os.path.isfile(path) else None

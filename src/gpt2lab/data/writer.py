"""The shard writer of ``gpt2lab prepare``: the token stream, cut into shards at fixed places.

The first ``val_tokens`` tokens (``--val-split tokens``), or the documents up to the one that
reaches them (``documents``), or the first ``val_docs`` documents (``--val-docs``, and
``--val-bytes`` as the documents its bytes take), are the ``val`` split and the rest ``train``, each in shards of
``shard_tokens``. Each finished shard is written whole (temp name, then rename) and then listed in
the manifest with the (document, offset) to resume from, so a run that stopped goes on from its last
listed shard and writes the same bytes as one that never stopped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from gpt2lab.data.manifest import save_manifest
from gpt2lab.data.shards import mask_path, open_shard, shard_name, write_shard
from gpt2lab.data.sources import SourceError, TextSource
from gpt2lab.system.files import sha256_file


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
        # go on after the last shard listed (data/manifest.py may have rolled them back to an earlier one)
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
        content (sha256: data/manifest.py) and where it starts in the stream (per-file counts)."""
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
        # where to resume after this shard: a source file changed later goes back to a shard's (data/manifest.py)
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
            info = splits.setdefault(shard["split"], {"shards": [], "tokens": 0, "documents": 0})
            info["shards"].append(shard["name"])
            info["tokens"] += shard["tokens"]
            info["documents"] += shard["documents"]
            if "supervised" in shard:  # conversations: the tokens the loss is taken on
                info["supervised"] = info.get("supervised", 0) + shard["supervised"]
        for info in splits.values():  # a split that begins inside a document holds it too
            info["documents"] += int(open_shard(self.out / info["shards"][0])[0] != self.manifest["eot_id"])
        files = self.manifest["files"]  # the documents and tokens of each file, from where each starts
        ends = [(f["first_doc"], f["first_token"]) for f in files[1:]] + [(self.doc, self.written)]
        for f, (d, t) in zip(files, ends):
            f.update(documents=d - f["first_doc"], tokens=t - f["first_token"])
        self.manifest.pop("resume", None)  # kept by an unfinished directory of an earlier gpt2lab
        self.manifest.update(splits=splits, tokens=self.written, documents=self.doc, complete=True)
        save_manifest(self.out, self.manifest)

"""The manifest.json of a ``gpt2lab prepare`` directory: what a run starts from and what it leaves.

A new directory gets a fresh manifest; a directory with an earlier run's manifest of the same
command is resumed (unfinished) or checked (finished); one made with other flags or of another
format version (shards.py's ``check_manifest_version``) is refused. Each source file is recorded by
its content (``sha256``) as well as its path: where a file is no longer the one recorded (edited in
place, removed, another in its place, or recorded by an earlier gpt2lab without its content), the
directory goes back to its last shard made wholly of the files before it (``_roll_back``, a warning
naming the file) and the prepare goes on from there, so no shard ever mixes old and new text. While
shards are written (data/writer.py) the manifest records each one with where to resume after it,
and the writer adds the per-split and per-file counts of a finished directory.
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Dict, Optional

from gpt2lab.data import chat
from gpt2lab.data.shards import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    ShardError,
    mask_path,
    read_header,
    read_manifest,
    shard_name,
    unreadable,
)
from gpt2lab.data.sources import TextSource
from gpt2lab.data.tokenizer import GPT2, Tokenizer, token_dtype
from gpt2lab.system.files import sha256_file, write_json


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
        was = ", ".join(f"{_flag(k)} {_flag_value(old.get(k), k)}" for k in differ)
        now = ", ".join(f"{_flag(k)} {_flag_value(settings.get(k), k)}" for k in differ)
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


def _flag(key: str) -> str:
    """The prepare flag that gives a setting (``val_tokens``: ``--val-tokens``), for a refusal naming it."""
    return "--" + key.replace("_", "-")


def _flag_value(v, key: str = "") -> str:
    if key == "tokenizer":  # an identity: the directory it came from is not recorded
        return "(GPT-2's)" if v is None else f"DIR of tokenizer sha256:{str(v)[:12]}"
    return "(not given)" if v is None else str(v)


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
    for split in ("val", "train"):
        names.add(shard_name(split, sum(1 for s in shards if s["split"] == split)))
    for name in sorted(names):
        for path in (out / name, mask_path(out / name)):
            if path.is_file():
                path.unlink()
    for key in ("splits", "tokens", "documents", "held_out", "resume"):  # a finished one's counts, held_out.py's file
        manifest.pop(key, None)
    manifest.update(complete=False, files=files[:i], shards=keep)


def _check_done_shard(path: Path, tokens: int) -> None:
    if not path.exists():
        raise ShardError(f"{path}: listed in {MANIFEST_FILE} but missing; delete {path.parent} and prepare again")
    if read_header(path)[0] != tokens:
        raise ShardError(f"{path}: token count differs from {MANIFEST_FILE}; delete {path.parent} and prepare again")


def save_manifest(out: Path, manifest: Dict) -> None:
    write_json(str(out / MANIFEST_FILE), manifest, indent=1)

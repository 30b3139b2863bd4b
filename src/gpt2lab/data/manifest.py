"""The manifest.json of a ``gpt2lab prepare`` directory: what a run starts from and what it leaves.

A new directory gets a fresh manifest; a directory with an earlier run's manifest of the same
command is resumed (unfinished) or checked (finished); an unfinished one whose shards no longer
match the source starts over; one made with other flags, of another format version (shards.py's
``check_manifest_version``), or holding someone else's files is refused. While shards are written
(data/writer.py) the manifest records each one and where to resume; ``finish_manifest`` turns that
into the per-split and per-file counts of a finished directory.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Dict, Optional

from gpt2lab.data import chat
from gpt2lab.data.shards import (
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    ShardError,
    check_manifest_version,
    mask_path,
    read_header,
    shard_name,
)
from gpt2lab.data.sources import Source
from gpt2lab.data.tokenizer import GPT2, Tokenizer, token_dtype
from gpt2lab.system import rundir
from gpt2lab.system.files import write_json

# The prepare flag of each setting, for a refusal that names what differs.
FLAGS = {
    "source": "--source",
    "config": "--config",
    "text_field": "--text-field",
    "limit_docs": "--limit-docs",
    "shard_tokens": "--shard-tokens",
    "val_tokens": "--val-tokens",
    "val_split": "--val-split",
    "val_docs": "--val-docs",
    "val_bytes": "--val-bytes",
    "format": "--format",
    "tokenizer": "--tokenizer",
}


def fresh_manifest(settings: Dict, tok: Tokenizer) -> Dict:
    """The manifest of a run that has written nothing yet."""
    conversations = settings["format"] == "chat"
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
        "resume": {"next_doc": 0, "offset": 0, "tokens": 0, "val_end": 0 if settings["val_tokens"] == 0 else None},
    }
    if conversations:  # the loader takes the loss on the masked tokens only; a run records the template
        manifest["chat_template"] = chat.TEMPLATE
    return manifest


def start_manifest(out: Path, settings: Dict, val_defaulted: bool, src: Source, tok: Tokenizer) -> Dict:
    """A fresh manifest, or the one of an earlier run of the same command (checked).

    Only the flags the user gave are compared: a default worked out from the source
    (``--val-tokens``) is taken from the earlier run, so a rerun after the source lost a
    file is not refused over a value nobody typed. An unfinished run whose shards no
    longer match the source (a file it read was removed or changed) starts over.
    """
    path = out / MANIFEST
    if not path.exists():
        refuse_foreign_shards(out)
        return fresh_manifest(settings, tok)
    try:
        manifest = json.loads(path.read_text())
        if isinstance(manifest, dict):
            check_manifest_version(path, manifest)  # a ShardError of its own, not caught here
        old = manifest["settings"]
        missing = ["dtype"] if "dtype" not in manifest else []
        missing += [f"settings.{k}" for k in ("val_split", "format") if k not in old]
        if missing:  # written before these were recorded: an older layout, not read
            raise KeyError(", ".join(missing))
    except ShardError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise ShardError(
            f"{path}: not a readable gpt2lab prepare manifest ({type(e).__name__}: {e}); use another --out"
        ) from e
    keys = [*settings, *(["tokenizer"] if "tokenizer" not in settings else [])]  # GPT-2's is no key
    differ = [k for k in keys if old.get(k) != settings.get(k) and not (k == "val_tokens" and val_defaulted)]
    if not manifest.get("complete") and not manifest.get("shards"):
        return _start_over(out, manifest, settings, None, tok)  # nothing was written yet
    if differ:
        was = ", ".join(f"{FLAGS[k]} {_flag_value(old.get(k), k)}" for k in differ)
        now = ", ".join(f"{FLAGS[k]} {_flag_value(settings.get(k), k)}" for k in differ)
        raise ShardError(
            f"{path}: this directory was prepared with {was}, not {now}; rerun with "
            f"the same flags to {'resume' if not manifest['complete'] else 'check'} it, "
            "or use another --out"
        )
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
    refuse_foreign_shards(out)
    return fresh_manifest(settings, tok)


def refuse_foreign_shards(out: Path) -> None:
    """system.rundir's rule: not another kind of gpt2lab directory (a run, an export), and no
    shards without a manifest; other files may stay beside the shards, as they always could."""
    found = rundir.inspect(str(out))
    shards = sorted(p.name for p in out.glob("*.bin"))
    if found.kind in (rundir.RUN, rundir.EXPORT, "hf_model"):
        raise ShardError(
            f"{out}: holds {rundir.what(found)}, not token shards; nothing was written there; "
            "use an empty --out directory"
        )
    if shards:
        raise ShardError(
            f"{out}: holds shards ({', '.join(shards[:3])}) but no {MANIFEST}; use an empty --out directory"
        )


def _check_done_shard(path: Path, tokens: int) -> None:
    if not path.exists():
        raise ShardError(f"{path}: listed in {MANIFEST} but missing; delete {path.parent} and prepare again")
    if read_header(path) != tokens:
        raise ShardError(f"{path}: token count differs from {MANIFEST}; delete {path.parent} and prepare again")


def save_manifest(out: Path, manifest: Dict) -> None:
    write_json(str(out / MANIFEST), manifest, indent=1)


def finish_manifest(manifest: Dict) -> None:
    """Turn the resume state into a finished directory's counts: per split, in all, per file."""
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
    manifest["files"] = [
        {"path": f["path"], "bytes": f["bytes"], "documents": d - f["first_doc"], "tokens": t - f["first_token"]}
        for f, (d, t) in zip(files, ends)
    ]
    manifest["complete"] = True
    del manifest["resume"]

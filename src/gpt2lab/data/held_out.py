"""The held-out conversations of prepared chat data: the val split's conversations, written beside the
shards as messages JSON lines (``held_out.jsonl``), so ``gpt2lab eval chat`` scores a model on the very
conversations its run validated on and never trained on.

``gpt2lab prepare`` writes the file when it has finished a directory of conversations (and on a rerun
of a finished one without it), atomically, and names it in the manifest (``"held_out"``: an optional
key, as ``chat_template``; the shards' format is unchanged). ``held_out_file`` finds it. The val split
is the stream's first documents (data/writer.py); the held-out conversations are those wholly in it:
under ``--val-split documents`` (conversations' default) all of them, under ``tokens`` all but the one
the cut runs through, which continues in train. They are read again from the source, which prepare has
checked is the one the shards were made from (data/manifest.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional

from gpt2lab.data.manifest import save_manifest
from gpt2lab.data.shards import open_shard, read_manifest
from gpt2lab.data.sources import TextSource
from gpt2lab.system.files import atomic_write

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

"""Token shard files: write, list, open (memory-mapped) and validate.

The ``.bin`` format is llm.c's: a header of 256 int32 (magic 20240520, version 1, token
count), then the tokens as uint16. A vocabulary past 65,536 tokens (a trained tokenizer's) needs
uint32 tokens: llm.c's header for those, magic 20240801, version 7. build-nanogpt's ``.npy``
shards (a bare uint16 array) are read too. Every check names the file and says what to do, because a bad shard found
hours into a run is expensive.

``read_manifest`` reads the manifest.json ``gpt2lab prepare`` writes beside its shards (data/manifest.py),
refusing one of another format version.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import List, Union

import numpy as np

from gpt2lab.system import formats, rundir
from gpt2lab.system.errors import DataError
from gpt2lab.system.files import atomic_write

MAGIC = 20240520
VERSION = 1
# (magic, version) of a file's header -> its dtype: llm.c's GPT-2 shards, its uint32 ones, and a conversation
# shard's loss mask (``train_000000.mask`` beside ``train_000000.bin``: one uint8 per token, 1: the loss is taken on it)
HEADERS = {(MAGIC, VERSION): np.dtype(np.uint16), (20240801, 7): np.dtype(np.uint32), (20241125, 1): np.dtype(np.uint8)}
HEADER_OF = {dtype: key for key, dtype in HEADERS.items()}
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SHARD_SUFFIXES = (".bin", ".npy")

PathLike = Union[str, os.PathLike]


class ShardError(DataError):
    """A shard or shard directory that cannot be used as it is."""


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def mask_path(shard: PathLike) -> Path:
    """The loss-mask file of a token shard."""
    return Path(shard).with_suffix(".mask")


def write_shard(path: PathLike, values: np.ndarray) -> None:
    """Write ``values`` as a ``.bin`` shard: tokens (uint16, or uint32 for a vocabulary past 65,536) or,
    at ``mask_path``, its loss mask (uint8 0/1); atomic: temp name, then rename."""
    if values.dtype not in HEADER_OF:
        raise TypeError(f"{path}: shard tokens must be uint16 or uint32 (a loss mask uint8), got {values.dtype}")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (*HEADER_OF[values.dtype], len(values))
    again = "free some space and run the same prepare command again: it resumes after the last whole shard"
    with atomic_write(str(path), "wb", what_next=again) as f:
        f.write(header.tobytes())
        f.write(np.ascontiguousarray(values).tobytes())


def open_mask(shard: PathLike, tokens: int) -> np.ndarray:
    """The loss mask of ``shard`` (``tokens`` long) as a read-only uint8 memmap; a missing, foreign
    or cut-short mask is a ShardError naming it."""
    path = mask_path(shard)
    redo = "re-run gpt2lab prepare on the conversations into a new directory"
    if not path.is_file():
        raise ShardError(f"{path}: missing; the shards hold conversations and each needs its loss mask; {redo}")
    mask = open_shard(path)
    if len(mask) != tokens:
        raise ShardError(f"{path}: holds {len(mask)} of {tokens} tokens' mask; {redo}")
    return mask


def read_header(path: PathLike) -> tuple[int, np.dtype]:
    """(token count, token dtype) of a ``.bin`` shard (or ``.mask``) whose header and size are valid."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ShardError(
            f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
            "the shard is truncated: delete it and re-run gpt2lab prepare"
        )
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    magic, version = int(header[0]), int(header[1])
    if magic not in {m for m, _ in HEADERS}:
        raise ShardError(
            f"{path}: magic {magic} is not {MAGIC}; not a gpt2lab/llm.c shard (re-create it with gpt2lab prepare)"
        )
    dtype = HEADERS.get((magic, version))
    if dtype is None:
        expected = " or ".join(f"{v} ({HEADERS[m, v]} tokens)" for m, v in HEADERS if m == magic)
        raise ShardError(
            f"{path}: shard version {version} is not supported (expected {expected}); re-create it with gpt2lab prepare"
        )
    count = int(header[2])
    have = (size - HEADER_BYTES) // dtype.itemsize
    if have != count or (size - HEADER_BYTES) % dtype.itemsize:
        what = "truncated" if have < count else "longer than its header says"
        raise ShardError(
            f"{path}: header says {count} tokens but the file holds {have}; the shard "
            f"is {what}: delete it and re-run gpt2lab prepare"
        )
    return count, dtype


def open_shard(path: PathLike) -> np.ndarray:
    """The shard's tokens as a read-only uint16 (or uint32) memmap (no data is read yet)."""
    path = str(path)
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ShardError(
                f"{path}: not a readable .npy token shard ({e}); re-create it or remove it from the directory"
            ) from e
        if arr.dtype != np.uint16 or arr.ndim != 1:
            raise ShardError(
                f"{path}: a .npy shard must be a 1-D uint16 array, got "
                f"{arr.ndim}-D {arr.dtype}; re-create it with gpt2lab prepare"
            )
        return arr
    count, dtype = read_header(path)
    if (dtype == np.uint8) != path.endswith(".mask"):  # a loss mask is no token shard, nor the other way round
        raise ShardError(f"{path}: holds {dtype} values, not its kind's; re-create it with gpt2lab prepare")
    # an empty shard: a plain empty array, nothing to map
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,)) if count else np.zeros(0, dtype)


def check_vocab(path: PathLike, tokens: np.ndarray, vocab_size: int) -> None:
    """Fail on any token id >= vocab_size, naming the file and the first bad position."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        pos = int(np.argmax(tokens >= vocab_size))
        raise ShardError(
            f"{path}: token {int(tokens[pos])} at position {pos} is >= the vocab "
            f"size {vocab_size}; the shard was made with another tokenizer or is "
            "corrupt: re-create it with gpt2lab prepare"
        )


# -- the manifest data/manifest.py writes beside the shards ------------------------------------
MANIFEST_FILE = rundir.DATA_MARKER  # manifest.json: the directory's owner mark (system.rundir)
MANIFEST_FORMAT = rundir.DATA_FORMAT
MANIFEST_VERSION = formats.MANIFEST.version


def read_manifest(data_dir: PathLike, finished: bool = True) -> dict:
    """``data_dir``'s manifest.json ({} where there is none, or no such directory); an unreadable
    one, one of another format version, or (``finished``) one whose ``gpt2lab prepare`` has not
    finished is a ShardError naming it."""
    path = Path(data_dir) / MANIFEST_FILE
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict):
            raise TypeError(f"a JSON {type(manifest).__name__}, not an object")
    except (OSError, ValueError, TypeError) as e:
        raise unreadable(path, e, "re-run gpt2lab prepare" if finished else "use another --out") from e
    fmt, version = manifest.get("format"), manifest.get("version")
    if fmt != MANIFEST_FORMAT or type(version) is not int:
        raise ShardError(
            f"{path}: not a gpt2lab prepare manifest (format {fmt!r}, version {version!r}; this gpt2lab "
            f"reads {MANIFEST_FORMAT!r} version {MANIFEST_VERSION}); prepare the data again into a new directory"
        )
    formats.check_version(str(path), version, formats.MANIFEST, ShardError)
    if not manifest.get("complete", True) and finished:
        raise ShardError(
            f"{path}: `gpt2lab prepare` has not finished this directory (source {manifest.get('source')!r}: it "
            "stopped, failed or is still running); run the same prepare command again to finish it"
        )
    return manifest


def unreadable(path: Path, e: Exception, fix: str) -> ShardError:
    return ShardError(f"{path}: not a readable gpt2lab prepare manifest ({type(e).__name__}: {e}); {fix}")


def val_size(settings: dict) -> str:
    """The flag and value that sized a prepared directory's val split ("--val-docs 100")."""
    key = next(k for k in ("val_docs", "val_bytes", "val_tokens") if settings.get(k) is not None)
    return f"--{key.replace('_', '-')} {settings[key]}"


def list_shards(data_dir: PathLike, split: str) -> List[Path]:
    """The ``.bin``/``.npy`` shards of ``split`` in ``data_dir``, sorted by name.

    A file belongs to a split when the split name appears in it as a whole word
    (``val_000000.bin``, build-nanogpt's ``edufineweb_train_000001.npy``).
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise ShardError(f"{root}: no such data directory; create it with `gpt2lab prepare --source SRC --out {root}`")
    manifest = read_manifest(root)  # an unfinished prepare is named as such
    files = [p for p in root.iterdir() if p.is_file() and p.suffix in SHARD_SUFFIXES]
    if not files:
        raise ShardError(
            f"{root}: no .bin or .npy token shards in this directory; create them "
            f"with `gpt2lab prepare --source SRC --out {root}`"
        )
    word = re.compile(rf"(^|[_.\-]){re.escape(split)}([_.\-]|$)")
    mine = sorted(p for p in files if word.search(p.stem))
    if not mine and manifest.get("splits"):
        raise ShardError(
            f"{root}: no {split} split: prepared with {val_size(manifest['settings'])}, all its "
            f"{manifest['tokens']:,} tokens are in {' and '.join(manifest['splits'])}; prepare it again with "
            "another size"
        )
    if not mine:
        names = ", ".join(sorted(p.name for p in files)[:5])
        raise ShardError(
            f"{root}: no shards for split '{split}' (found: {names}); shard names "
            f"must contain '{split}', e.g. {shard_name(split, 0)}"
        )
    return mine

"""Text sources for ``gpt2lab prepare``: each is an ordered stream of documents (str).

- ``tinyshakespeare``: the text shipped in the package, one document per speech (the
  blank-line separated blocks: 7,222 of them), so the shuffling loader has documents to
  permute. Joining the documents with a blank line gives the file back exactly.
- ``chitchat``: 1,500 two-person conversations shipped in the package (``assets/chitchat.jsonl.zst``,
  the messages format; what ``gpt2lab demo --chat`` fine-tunes on), read as the local file it is.
- local files: ``.jsonl``/``.json`` (JSON lines: one document per line, field ``text_field``),
  ``.parquet`` (column ``text_field``), and any other file as UTF-8 text, one document per file
  (``.txt``, ``.py``, ``.md``, ``Makefile``, ...); ``.txt`` and the JSON lines ones also
  compressed (``.gz``, ``.zst``, ``.xz``, ``.bz2``: ``docs.jsonl.zst``, ``book.txt.gz``); or a
  directory / glob of them (files in sorted order; ``'src/**/*.py'`` is recursive; a directory
  leaves out names beginning with a dot, as a glob does). Compressed files are decompressed as a
  stream, a chunk at a time; a corrupt or truncated one is a ``SourceError`` naming it. A file of
  no known kind in a directory or glob that is not UTF-8 text (an image, a ``.tar.gz``: a NUL
  byte or a byte sequence UTF-8 does not have) is skipped, and a warning line gives how many and
  names them: prepare never leaves out part of the user's data without saying so. Named alone, such
  a file is a ``SourceError``.
- the hub, through HF ``datasets`` streaming: ``fineweb-edu``, ``fineweb`` (config
  ``sample-10BT`` unless ``config`` says otherwise) and any ``hf:NAME[:CONFIG]``.

Bad input raises ``SourceError`` naming the file (and line or row) and what to do.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import itertools
import json
import lzma
import os
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, List, NamedTuple, Optional, Tuple, Union

from gpt2lab.data import chat
from gpt2lab.data.tokenizer import asset_path
from gpt2lab.system.errors import DataError

HUB_ALIASES = {"fineweb-edu": "HuggingFaceFW/fineweb-edu", "fineweb": "HuggingFaceFW/fineweb"}
HUB_DEFAULT_CONFIG = "sample-10BT"
TEXT_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".zst", ".xz", ".bz2")
LOCAL_SUFFIXES = tuple(TEXT_KINDS) + tuple(k + c for k in (".txt", ".jsonl", ".json") for c in COMPRESSIONS)
READ_CHUNK = 1 << 17  # compressed bytes read at a time
INSTALL_HINT = "pip install 'gpt2lab[data]'"


class SourceError(DataError):
    """A text source that cannot be read as it is."""


class JsonLine(NamedTuple):
    """A .jsonl line not parsed yet: the tokenizer workers parse it, off the main process."""

    line: str
    path: str
    lineno: int
    field: str

    def row(self) -> dict:
        """The line's JSON object (a SourceError naming the file and line when it is not one)."""
        where = f"{self.path}:{self.lineno}"
        try:
            row = json.loads(self.line)
        except json.JSONDecodeError as e:
            raise SourceError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix or remove that line") from e
        if not isinstance(row, dict):
            raise SourceError(
                f"{where}: a JSON {type(row).__name__}, not an object with "
                'a text field; each line must be {"text": ...}'
            )
        return row

    def turns(self) -> list[tuple[str, str]]:
        """The line's conversation (data/chat.py: (role, content) turns); a SourceError naming the file,
        line and field when it is not one."""
        try:
            return chat.conversation(self.row())
        except chat.ChatFormatError as e:
            raise SourceError(f"{self.path}:{self.lineno}: {e}; fix or remove that line") from e


Document = Union[str, JsonLine]


def as_text(doc: Document) -> str:
    return doc if isinstance(doc, str) else _field(doc.row(), doc.field, f"{doc.path}:{doc.lineno}")


@dataclass
class TextSource:
    """An ordered document stream; ``documents(skip, limit)`` yields documents ``skip..limit-1``.

    A document is its text, or a ``JsonLine`` that ``as_text`` turns into its text.
    """

    name: str
    kind: str  # "bundled", "local" or "hub"
    size_bytes: Optional[int]  # of the text, when known without reading it (for the val default)
    documents: Callable[[int, Optional[int]], Iterator[Document]]
    val_fraction: float = 0.005
    hub_config: Optional[str] = None
    files: List[str] = field(default_factory=list)  # a local source's files, in reading order
    # the document index at which each of ``files`` starts, appended as reading reaches it
    file_starts: List[int] = field(default_factory=list)


def resolve_source(source: str, text_field: str = "text", config: Optional[str] = None) -> TextSource:
    """Turn the ``--source`` string into a TextSource."""
    if source == "tinyshakespeare":  # 5%: a val split of ~17k tokens, enough for a steady val loss at T=256
        path = Path(asset_path("tinyshakespeare.txt"))  # one document per speech
        speeches = _slice(lambda: path.read_text(encoding="utf-8").split("\n\n"))
        return TextSource(source, "bundled", path.stat().st_size, speeches, val_fraction=0.05)
    if source in HUB_ALIASES or source.startswith("hf:"):
        return _hub_source(source, text_field, config)
    # chitchat: 2%, a val split of ~30 whole conversations
    files = [asset_path("chitchat.jsonl.zst")] if source == "chitchat" else _local_files(source)
    # compressed text is ~3-4x its file size: the val default estimates the text's size
    size = sum(os.path.getsize(f) * (4 if f.endswith(COMPRESSIONS) else 1) for f in files)
    starts: List[int] = []
    documents = _slice(lambda: _local_docs(files, text_field, starts))
    frac = 0.02 if source == "chitchat" else 0.005
    return TextSource(source, "local", size, documents, val_fraction=frac, files=files, file_starts=starts)


def _slice(make: Callable[[], Iterable[Document]]) -> Callable[[int, Optional[int]], Iterator[Document]]:
    return lambda skip, limit: itertools.islice(make(), skip, limit)


# -- local files -------------------------------------------------------------------------
def _local_files(source: str) -> List[str]:
    # a leading ~ the shell left alone (a quoted glob, --source=~/...) is the user's home, as the shell's would be
    source = os.path.expanduser(source)
    if any(c in source for c in "*?["):
        files = sorted(f for f in glob.glob(source, recursive=True) if os.path.isfile(f))
        what = f"glob {source!r} matches"
    elif os.path.isdir(source):
        # leaving out any path with a part beginning with a dot (``.git/``, ``.DS_Store``)
        paths = [p for p in Path(source).rglob("*") if not any(x.startswith(".") for x in p.relative_to(source).parts)]
        files = sorted(str(p) for p in paths if p.is_file())
        what = f"directory {source} holds"
    elif os.path.isfile(source):
        return [source]  # named alone: read as what it is (text that is not UTF-8: one line, when read)
    elif os.path.exists(source):
        raise SourceError(f"--source {source!r}: not a file or a directory (a device, pipe or socket); name files")
    else:
        raise SourceError(
            f"--source {source!r}: no such file or directory, and not one of "
            f"tinyshakespeare, chitchat, {', '.join(HUB_ALIASES)}, hf:NAME[:CONFIG]"
        )
    binary = [f for f in files if not f.endswith(LOCAL_SUFFIXES) and not _is_utf8_text(f)]
    usable = [f for f in files if f not in set(binary)]
    if not usable:
        found = f" (the {len(binary)} there are not UTF-8 text)" if binary else ""
        raise SourceError(f"{what} no files{found}; point --source at text files ({KINDS_HINT})")
    if binary:  # never leave out part of the user's data without saying so: how many, and which
        names = ", ".join(binary[:10]) + (f" and {len(binary) - 10} more" if len(binary) > 10 else "")
        warnings.warn(f"{what} {len(binary)} file(s) that are not UTF-8 text, skipped: {names}", stacklevel=3)
    return usable


def _is_utf8_text(path: str) -> bool:
    """Whether a file of no known kind is UTF-8 text: no NUL byte (the mark of binary data, as
    git and grep take it) and every byte sequence one UTF-8 has. An unreadable file counts as text
    here, so that reading it gives its one-line error."""
    try:
        with open(path, encoding="utf-8") as f:  # decoded a chunk at a time, to the end (or the first NUL)
            return all("\0" not in chunk for chunk in iter(lambda: f.read(READ_CHUNK), ""))
    except UnicodeDecodeError:
        return False
    except OSError:
        return True


KINDS_HINT = (
    "any UTF-8 text file is one document; .jsonl/.json (JSON lines) and .parquet one per row; "
    ".txt/.jsonl/.json also as .gz/.zst/.xz/.bz2"
)


def kind_of(path: str) -> Tuple[str, Optional[str]]:
    """(``txt``/``jsonl``/``parquet``, compression suffix or None) of a local file name; a name of no
    known kind is text (``txt``), read as it is."""
    # notes.tar.gz: not a compressed kind prepare reads; its bytes, as a file of no known kind
    comp = next((c for c in COMPRESSIONS if path.endswith(c) and path.endswith(LOCAL_SUFFIXES)), None)
    inner = path[: -len(comp)] if comp else path
    return TEXT_KINDS.get(Path(inner).suffix, "txt"), comp


def _local_docs(files: List[str], text_field: str, starts: List[int]) -> Iterator[Document]:
    readers = {"txt": _txt_docs, "jsonl": _jsonl_docs, "parquet": _parquet_docs}
    starts.clear()  # each reading from the start records them afresh
    n = 0
    for f in files:
        starts.append(n)  # read by the shard writer for the per-file counts in the manifest
        for doc in readers[kind_of(f)[0]](f, text_field):
            n += 1
            yield doc


class _ZstdRaw(io.RawIOBase):
    """A .zst file's decompressed bytes, a frame's chunk at a time; frames one after another (as
    ``zstd`` and ``pzstd`` write them) are read through; a file that ends inside a frame is
    an EOFError (zstandard's own stream reader would just stop)."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "rb")
        self.chunks, self.pending = _zstd_chunks(self.f), memoryview(b"")

    def close(self) -> None:
        self.f.close()
        super().close()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.pending:
            chunk = next(self.chunks, None)
            if chunk is None:
                return 0
            self.pending = memoryview(chunk)
        n = min(len(b), len(self.pending))
        b[:n], self.pending = self.pending[:n], self.pending[n:]
        return n


def _zstd_chunks(f: IO[bytes]) -> Iterator[bytes]:
    import zstandard

    d = None  # the frame being read
    while chunk := f.read(READ_CHUNK):
        while chunk:  # a frame that ends in the chunk: the rest starts the next one
            d = d or zstandard.ZstdDecompressor().decompressobj()
            try:
                yield d.decompress(chunk)
            except zstandard.ZstdError as e:  # not zstd data, or damaged: a read error like the others
                raise OSError(str(e)) from e
            chunk, d = (d.unused_data, None) if d.eof else (b"", d)
    if d is not None:
        raise EOFError("the file ends inside a zstd frame (truncated)")


def _open_text(path: str) -> IO[str]:
    """``path`` as UTF-8 text, decompressed on the fly when its name says it is compressed."""
    comp = kind_of(path)[1]
    if comp == ".zst":
        return io.TextIOWrapper(io.BufferedReader(_ZstdRaw(path), READ_CHUNK), encoding="utf-8")
    return {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open, None: open}[comp](path, "rt", encoding="utf-8")


@contextmanager
def _reading(path: str) -> Iterator[None]:
    """Turn what a damaged file raises while it is read into one line naming the file."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 text ({e}); convert it to UTF-8") from e
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:
        comp = kind_of(path)[1]
        what = f"not a readable {comp} file" if comp else "cannot be read"
        raise SourceError(
            f"{path}: {what} ({type(e).__name__}: {e}); the file is corrupt or "
            "truncated: fetch it again, or remove it from --source"
        ) from e


def _txt_docs(path: str, text_field: str) -> Iterator[str]:
    # one document, so whole in memory (as for .txt); JSON lines stream document by document
    with _reading(path), _open_text(path) as f:
        text = f.read()
    if not text.strip() and path.endswith(LOCAL_SUFFIXES):  # kept (as a .jsonl's empty row is), but worth knowing about
        # (a .txt only: an empty file of code, an __init__.py, is common and says nothing)
        warnings.warn(f"{path}: empty text file; it adds only an <|endoftext|>", stacklevel=2)
    yield text


def _jsonl_docs(path: str, text_field: str) -> Iterator[Document]:
    with _reading(path), _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.isspace():  # a blank line holds no document
                yield JsonLine(line, path, lineno, text_field)


def _field(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        fields = ", ".join(list(row)[:10])
        raise SourceError(f"{where}: no field '{text_field}' (fields: {fields}); pass --text-field NAME")
    text = row[text_field]
    if not isinstance(text, str):
        raise SourceError(
            f"{where}: field '{text_field}' is {type(text).__name__}, not text; "
            "fix the row or pick another --text-field"
        )
    return text


def _parquet_docs(path: str, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise SourceError(f"{path}: reading .parquet needs pyarrow: {INSTALL_HINT}") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (not a Parquet file), OSError, ...
        raise SourceError(
            f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); convert it or remove it from --source"
        ) from e
    if text_field not in pf.schema_arrow.names:
        raise SourceError(
            f"{path}: no column '{text_field}' (columns: {', '.join(pf.schema_arrow.names)}); pass --text-field NAME"
        )
    texts = (t for batch in pf.iter_batches(columns=[text_field], batch_size=4096) for t in batch.column(0).to_pylist())
    for row, text in enumerate(texts):
        yield _field({text_field: text}, text_field, f"{path}: row {row}")


# -- the hub -----------------------------------------------------------------------------
def _hub_source(source: str, text_field: str, config: Optional[str]) -> TextSource:
    if source in HUB_ALIASES:
        name, config = HUB_ALIASES[source], config or HUB_DEFAULT_CONFIG
    else:
        name, _, cfg = source[len("hf:") :].partition(":")
        config = config or cfg or None
        if not name:
            raise SourceError(f"--source {source!r}: write hf:NAME or hf:NAME:CONFIG")

    def documents(skip: int, limit: Optional[int]) -> Iterator[str]:
        try:
            import datasets
        except ImportError as e:
            raise SourceError(f"hub source {name} needs the HF datasets library: {INSTALL_HINT}") from e
        try:
            ds = datasets.load_dataset(name, config, split="train", streaming=True)
        except Exception as e:  # network, unknown name or config: one clear message, not a traceback
            raise SourceError(
                f"hub dataset {name} (config {config}): {type(e).__name__}: {e}; check "
                "the name, --config and the network, or prepare a local copy"
            ) from e
        if skip:
            ds = ds.skip(skip)  # resuming: no tokenizing of what is already in shards
        rows = itertools.islice(ds, None if limit is None else max(0, limit - skip))
        for i, row in enumerate(rows, skip):
            yield _field(row, text_field, f"{name} ({config}) row {i}")

    return TextSource(name, "hub", None, documents, hub_config=config)

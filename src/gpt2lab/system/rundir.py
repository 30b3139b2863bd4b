"""Whose file or directory is it: the one rule of every command that writes, and the run lock.

A directory is gpt2lab's when it holds gpt2lab's own marker, written first and atomically:

  run      ``run_info.json`` with ``"format": "gpt2lab-run"`` (``gpt2lab train``; runs written
           before the tag are known by their run_info.json / config.json)
  export   ``gpt2lab_export.json`` (``gpt2lab export``, an HF GPT-2 directory)
  data     ``manifest.json`` of ``gpt2lab prepare`` (token shards)
  tokenizer  ``gpt2lab_tokenizer.json`` (``gpt2lab tokenizer train``, beside its tokenizer.json)

A file is gpt2lab's when its first bytes carry gpt2lab's mark (``marked``): a PNG's ``Software``
text chunk, an HTML or Markdown comment, a JSON ``"format": "gpt2lab-..."`` field.

``check(path, kind, flag, what_next)`` is the rule every writing command applies before writing a
byte: a directory only when missing, empty or of its own kind (and, for a command that replaces it
whole, holding nothing else); a file only when missing or gpt2lab's. Anything else is refused in
one line naming the path, what was found there and what to do (DirectoryError, a UsageError: exit
2). Nothing is ever written over, written into or deleted that gpt2lab did not write.

A run directory is also locked while a run writes it: ``claim`` takes an OS advisory lock
(``fcntl.flock``) on ``run.lock`` inside it and holds it for the life of the process; the
kernel drops it when the process ends, however it ends (kill -9 included), so no lock is ever
stale. The file holds the holder's pid, host and start time, read by whoever finds it locked:
a second ``train`` refuses at once naming them, ``report``/``plot``/``sample`` say the run is
live (``holder``) and only read.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from gpt2lab.system.errors import UsageError
from gpt2lab.system.files import _remove, read_json_object, tmp_name, write_json

RUN, EXPORT, DATA, TOKENIZER, FILE = "run", "export", "data", "tokenizer", "file"
RUN_MARKER, RUN_FORMAT = "run_info.json", "gpt2lab-run"
RUN_TAG = {"format": RUN_FORMAT, "version": 1}  # the marker's own fields (a run adds its facts to them)
EXPORT_MARKER, EXPORT_FORMAT = "gpt2lab_export.json", "gpt2lab-hf-export"
DATA_MARKER, DATA_FORMAT = "manifest.json", "gpt2lab-token-shards"
TOKENIZER_MARKER, TOKENIZER_FORMAT = "gpt2lab_tokenizer.json", "gpt2lab-tokenizer"
LOCK_FILE = "run.lock"
_WHAT = {
    RUN: "a gpt2lab run (run_info.json)",
    EXPORT: "a gpt2lab export (gpt2lab_export.json, written by `gpt2lab export`)",
    DATA: "prepared token shards (manifest.json of `gpt2lab prepare`)",
    TOKENIZER: "a gpt2lab tokenizer (gpt2lab_tokenizer.json, written by `gpt2lab tokenizer train`)",
    "hf_model": "a Hugging Face model directory (config.json with model_type), not written by gpt2lab",
}
# A file's mark, in its first 64 KiB: a PNG's text chunk (matplotlib's ``metadata=PNG_MARK``), the comment
# HTML and Markdown begin with, a JSON object's format field.
PNG_MARK = {"Software": "gpt2lab"}
TEXT_MARK = "<!-- written by gpt2lab -->"
_MARKS = (b"Software\x00gpt2lab", TEXT_MARK.encode(), b'"format": "gpt2lab-')
# A run directory's own plot and report, as versions before the marks wrote them.
_RUN_FILES = ("plot.png", "report.html", "report.md", "report.png")
# How long `claim` retries a lock that is busy: a reader's probe (``holder``) holds it for microseconds.
_LOCK_RETRY_S = 0.5
_BUSY = (BlockingIOError, PermissionError)  # a lock another process holds: EWOULDBLOCK/EAGAIN, or EACCES


class DirectoryError(UsageError):
    """A file or directory a command may not write (someone else's, or another kind), or a locked run."""


@dataclass(frozen=True)
class Found:
    kind: str  # "missing", "empty", "file", RUN, EXPORT, DATA, TOKENIZER, "hf_model", "checkpoints" or "foreign"
    entries: tuple[str, ...]  # the directory's names, sorted


def inspect(path: str) -> Found:
    """What ``path`` is: missing, empty, a file, one of gpt2lab's kinds, an HF model or someone's."""
    if not os.path.lexists(path):
        return Found("missing", ())
    if not os.path.isdir(path) or os.path.islink(path):
        return Found("file", ())
    entries = tuple(sorted(os.listdir(path)))
    if not entries:
        return Found("empty", ())
    info, manifest, marker, config = (
        read_json_object(os.path.join(path, name)) or {}
        for name in (RUN_MARKER, DATA_MARKER, TOKENIZER_MARKER, "config.json")
    )
    kinds = (  # the first that holds
        # a run (its run_info.json without the format tag: a run from before the tag)
        (RUN, info.get("format") == RUN_FORMAT or {"world_size", "torch"} <= set(info)),
        (EXPORT, EXPORT_MARKER in entries),
        (DATA, manifest.get("format") == DATA_FORMAT or "shards" in manifest),
        (TOKENIZER, marker.get("format") == TOKENIZER_FORMAT),
        (RUN, _is_run_config(config)),  # a run killed before it wrote run_info.json (older versions), or a checkpoint
        # a run's checkpoints alone (copied, or of an older version)
        (RUN, "checkpoints" in entries and _has_run_checkpoint(os.path.join(path, "checkpoints"))),
        ("hf_model", "model_type" in config),
        # a run's checkpoints folder
        ("checkpoints", all(n.startswith("step_") for n in entries) and _has_run_checkpoint(path)),
    )
    return Found(next((kind for kind, holds in kinds if holds), "foreign"), entries)


def what(found: Found) -> str:
    """What was found, for a message: "a gpt2lab export (...)", "files that gpt2lab did not write (...)"."""
    shown = ", ".join(found.entries[:4]) + (", ..." if len(found.entries) > 4 else "")  # its first names
    if found.kind == RUN and RUN_MARKER not in found.entries:
        kind = "a gpt2lab checkpoint" if "model.safetensors" in found.entries else "a gpt2lab run without run_info.json"
        return f"{kind} ({shown})"
    if found.kind == "checkpoints":
        return f"a gpt2lab run's checkpoints ({shown})"
    if found.kind in _WHAT:
        return _WHAT[found.kind]
    n = len(found.entries)
    return f"files that gpt2lab did not write ({n} {'entry' if n == 1 else 'entries'}: {shown})"


def _has_run_checkpoint(folder: str) -> bool:
    with contextlib.suppress(OSError):  # no such folder
        names = [n for n in os.listdir(folder) if n.startswith("step_")]
        return any(_is_run_config(read_json_object(os.path.join(folder, n, "config.json")) or {}) for n in names)
    return False


def _is_run_config(config: dict) -> bool:
    """A run's config.json: it names max_steps and micro_batch_size in their sections, as
    TrainConfig.to_dict nests them (its format version is checked by the readers of its settings)."""
    optim, batch = config.get("optim"), config.get("batch")
    return isinstance(optim, dict) and "max_steps" in optim and isinstance(batch, dict) and "micro_batch_size" in batch


def marked(path: str) -> bool:
    """Whether the file ``path`` is gpt2lab's: its mark in its first 64 KiB (``_MARKS``), or a run
    directory's own plot or report."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    if any(m in head for m in _MARKS):
        return True
    return os.path.basename(path) in _RUN_FILES and inspect(os.path.dirname(os.path.abspath(path))).kind == RUN


def check(path: str, want: str, flag: str, what_next: str, replaces: Optional[tuple] = None) -> Found:
    """Return what ``path`` is when a command writing a ``want`` there may write it, else raise.

    A file (``want`` FILE): missing, or one gpt2lab wrote (``marked``). A directory: missing,
    empty, or of kind ``want``; one the command replaces whole must hold only the names it writes,
    ``replaces``. ``flag`` names the path in the message ("" for a positional or a function's).
    """
    found = inspect(path)
    extra = sorted(set(found.entries) - set(replaces or found.entries))
    if want == FILE:
        if found.kind == "missing" or (found.kind == "file" and marked(path)):
            return found
        said = "is a file gpt2lab did not write" if found.kind == "file" else "is a directory"
    elif found.kind in ("missing", "empty") or (found.kind == want and not extra):
        return found
    elif found.kind == "file":
        said = "is a file, not a directory"
    elif found.kind == want:
        said = (
            f"holds {what(found)} and {', '.join(extra[:4])}, which gpt2lab did not write and replacing it would remove"
        )
    else:
        said = f"holds {what(found)}"
    raise DirectoryError(f"{flag + ' ' if flag else ''}{path}: {said}; nothing was written there; {what_next}")


def _create_marker(path: str) -> None:
    """Write the run marker unless one is there (never replacing another process's)."""
    final = os.path.join(path, RUN_MARKER)
    tmp = tmp_name(final) + ".marker"
    write_json(tmp, RUN_TAG)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, final)  # atomic, and fails if a marker is there already (a run's, or another process's)
    finally:
        os.unlink(tmp)


def resume_command(words: Sequence[str], prog: str) -> str:
    """The command line that continues a run started by ``PROG WORDS`` (``train ...``): the same words
    with ``--resume auto`` for any --resume given, without --dry-run."""
    kept = [  # each word but --resume, its value (the word after it), --resume=VALUE and --dry-run
        word
        for before, word in zip(["", *words], words)
        if "--resume" not in (before, word) and not word.startswith("--resume=") and word != "--dry-run"
    ]
    return f"{prog} {shlex.join([*kept, '--resume', 'auto'])}"


# -- the lock --------------------------------------------------------------------------------
def _flock(fd: int, exclusive: bool) -> Optional[dict]:
    """Take the run lock on ``fd`` (shared: a reader's probe) without waiting: None when taken, else who
    holds it ({"pid", "host", "started"}, as its file says; a partial line reads as unknown)."""
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return None
    except _BUSY:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
            info = None
        return {k: info.get(k) if isinstance(info, dict) else None for k in ("pid", "host", "started")}


def holder(path: str) -> Optional[dict]:
    """Who holds the run's lock ({"pid", "host", "started"}), or None when no live run holds it.

    Probes with a shared lock, dropped at once (the file is closed): it never blocks and never writes.
    """
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        return _flock(fd, exclusive=False)
    finally:
        os.close(fd)  # drops the probe's shared lock


def local_time(when) -> str:
    """A time.time() stamp as local "YYYY-MM-DD HH:MM:SS" ("?" where it is not a number)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else "?"


def describe(who: dict) -> str:
    return f"pid {who.get('pid', '?')} on {who.get('host', '?')}, started {local_time(who.get('started'))}"


@contextlib.contextmanager
def lock(path: str) -> Iterator[None]:
    """Hold ``path``'s run lock until the block ends (or the process does); raise if another holds it."""
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + _LOCK_RETRY_S
        while (who := _flock(fd, exclusive=True)) is not None:
            if time.monotonic() > deadline:
                raise DirectoryError(
                    f"{path} is in use by another run ({describe(who)}); "
                    "wait for it to end or stop it (it saves a checkpoint on SIGTERM), "
                    "or train into another --out"
                )
            time.sleep(0.05)
        # the lock file is the lock itself, so it is rewritten in place (a rename would make a new,
        # unlocked file); readers only read it while it is held, and tolerate a partial line
        os.ftruncate(fd, 0)
        who = {"pid": os.getpid(), "host": socket.gethostname(), "started": round(time.time(), 3)}
        os.pwrite(fd, json.dumps(who).encode() + b"\n", 0)
        yield
    finally:
        os.close(fd)  # drops the lock (the kernel does the same when the process dies)


# What a run writes at the top of its directory: a start that fails before training removes those of
# them it created (Claim.undo), never another name.
RUN_WRITES = (RUN_MARKER, LOCK_FILE, "config.json", "metrics.jsonl", "plot.png", "tensorboard", "wandb", "wandb_id")
RUN_WRITES += ("checkpoints", "tokenizer.json")


@dataclass
class Claim:
    """A start's hold on its run directory: what it found there, so that a start failing before its
    first step can remove exactly what it created (``undo``). ``began`` is set once a step was taken."""

    path: str
    created: bool  # this start made the directory
    top: str  # the outermost folder it made (the parents of a new --out too)
    before: frozenset  # the names that were in it
    began: bool = False

    def undo(self) -> None:
        """Remove what this start wrote that was not there before it (of the names in RUN_WRITES), then
        the directory and the parents it made, if it made them and nothing else is in them."""
        if self.began:
            return
        for name in set(RUN_WRITES) - self.before:
            with contextlib.suppress(OSError):
                _remove(os.path.join(self.path, name))
        where = os.path.abspath(self.path)
        with contextlib.suppress(OSError):
            while self.created and len(where) >= len(self.top) and not os.listdir(where):
                os.rmdir(where)
                where = os.path.dirname(where)


@contextlib.contextmanager
def claim(path: str, flag: str = "--out", what_next: str = "choose a new or empty --out") -> Iterator[Claim]:
    """For ``train``: check ``path`` (missing, empty or a run), mark it as a run, hold its lock.

    Yields the Claim. A start that fails (any exception) before its first step removes what it
    created, while still holding the lock; a directory this call created in which nothing but the
    marker and the lock was written is removed on the way out too.
    """
    check(path, RUN, flag, what_next)
    top = os.path.abspath(path)
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    held = Claim(path, not os.path.exists(path), top, frozenset(os.listdir(path) if os.path.exists(path) else ()))
    os.makedirs(path, exist_ok=True)
    try:
        _create_marker(path)
        with lock(path):
            try:
                yield held
            except BaseException:
                held.undo()  # while still holding the lock: no other run can be starting there
                raise
    finally:
        with contextlib.suppress(OSError):  # made here, and holding only the bare marker (no run wrote it) and the lock
            info = read_json_object(os.path.join(path, RUN_MARKER)) or {}
            if held.created and set(os.listdir(path)) <= {RUN_MARKER, LOCK_FILE} and set(info) <= set(RUN_TAG):
                held.undo()

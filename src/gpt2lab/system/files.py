"""Writing files so that nothing is ever half-written: one helper for every writer.

Every file or directory gpt2lab writes is first written under a temporary sibling name
``.tmp_<name>_<pid>``, flushed, then renamed over the final name (``os.replace`` is
atomic on one filesystem). A failure removes the temporary; a full disk becomes a
``DiskFullError`` naming the path. A process killed mid-write leaves its temporary
behind: ``sweep_stale`` removes those of dead processes at the next start-up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from typing import IO, Any, Iterator, Optional

from gpt2lab.system.errors import disk_full, is_disk_full

_TMP = re.compile(r"^\.tmp_(.+)_(\d+)$")


def tmp_name(path: str) -> str:
    """The temporary sibling of ``path`` this process writes first."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".tmp_{tail}_{os.getpid()}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def _replacing(path: str, what_next: Optional[str]) -> Iterator[str]:
    """Yield the temporary that becomes ``path`` when the block succeeds (``os.replace``; a directory takes an
    existing one's place by two renames: a crash between them leaves both, never neither). A failure removes
    the temporary; a full disk becomes a DiskFullError naming ``path``."""
    tmp = tmp_name(path)
    _remove(tmp)  # our own leftover: the same pid cannot be writing it twice
    try:
        yield tmp
        old = tmp + ".old"
        if os.path.isdir(tmp) and os.path.lexists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        _remove(old)
    except BaseException as e:
        _remove(tmp)
        if is_disk_full(e):
            raise disk_full(path, *([what_next] if what_next else [])) from e
        raise


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", what_next: Optional[str] = None) -> Iterator[IO]:
    """``with atomic_write(p) as fh: fh.write(...)``: ``p`` appears whole or not at all."""
    with _replacing(path, what_next) as tmp, open(tmp, mode) as fh:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_dir(path: str, what_next: Optional[str] = None) -> Iterator[str]:
    """Yield a fresh temporary directory that becomes ``path`` when the block succeeds.

    It takes the place of an existing ``path`` (the caller has decided that is safe).
    The directory gets the usual permissions (umask), not mkdtemp's 0700.
    """
    with _replacing(path, what_next) as tmp:
        os.makedirs(tmp)
        yield tmp
        _settle(tmp)


def write_json(path: str, data: Any, indent: Optional[int] = 2) -> None:
    """``data`` as JSON (newline-terminated) at ``path``, atomically."""
    with atomic_write(path) as fh:
        json.dump(data, fh, indent=indent)
        fh.write("\n")


def read_json_object(path: str) -> Optional[dict]:
    """The JSON object in ``path``, or None where there is none to read (missing, unreadable,
    not JSON, not an object): for sniffing what a folder holds, never for a file that must be there."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return value if isinstance(value, dict) else None


def _settle(folder: str) -> None:
    """Each file in ``folder`` on disk (fsync) with the mode a plain ``open`` gives (0666 less the umask):
    some writers (safetensors) create their file 0600 whatever the umask says."""
    mask = os.umask(0o022)  # the umask is read by setting it and setting it back: there is no getter
    os.umask(mask)
    for name in os.listdir(folder):
        full = os.path.join(folder, name)
        if os.path.isfile(full) and not os.path.islink(full):
            os.chmod(full, 0o666 & ~mask)
            with open(full, "rb") as fh:
                os.fsync(fh.fileno())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale(folder: str) -> None:
    """Remove ``.tmp_*_<pid>`` entries directly in ``folder`` whose process is gone.

    Only names this module makes are touched, and only those of dead processes, so a
    run writing into the same folder right now keeps its temporaries. A warning names
    what was removed.
    """
    if not os.path.isdir(folder):
        return
    removed = []
    for name in sorted(os.listdir(folder)):
        m = _TMP.match(name.removesuffix(".old"))
        if m and int(m.group(2)) != os.getpid() and not _pid_alive(int(m.group(2))):
            _remove(os.path.join(folder, name))
            removed.append(name)
    if removed:
        warnings.warn(
            f"{folder}: removed {len(removed)} temporary file(s) left by stopped runs "
            f"({', '.join(removed[:3])}{', ...' if len(removed) > 3 else ''})",
            stacklevel=2,
        )


def sha256_file(path: str) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks (hashlib.file_digest is Python 3.11's; 3.10 is supported)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 24):
            h.update(block)
    return h.hexdigest()

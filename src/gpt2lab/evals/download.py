"""The data sets an evaluation downloads (HellaSwag, GSM8K): fetched once into gpt2lab's cache, whole
and checked, or not at all.

``cached_file`` is the one way every eval gets its data set. A file already in the cache is used as it
is, with no network. Otherwise: one attempt at the data set's URL (``DOWNLOAD_TIMEOUT_S``, no
retries); a second source (a Hugging Face dataset's copy) only where that server answered without the
file, or with a file that is not the data set; nothing at all under HF_HUB_OFFLINE /
HF_DATASETS_OFFLINE. The bytes go to a temporary name beside the cache file (system/files.py), are
checked by the data set's own reader, and are renamed into place only then: a download cut short
(fewer bytes than the server announced) or not the data set never stands in the cache. A failure is
one line naming the data set, the URL, the flag for a local file and where the file could be put.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Optional, TypeVar

from gpt2lab.system import env
from gpt2lab.system.errors import GPT2LabError
from gpt2lab.system.files import atomic_write, sweep_stale, tmp_name

T = TypeVar("T")

# Seconds the one download attempt waits to connect (and for each read): an unreachable network
# fails in this long at most, with no retries.
DOWNLOAD_TIMEOUT_S = 10


@dataclass(frozen=True)
class DataSet:
    """A file an eval downloads: what it is (for messages), its URL, its place in the cache, what a
    local file passed instead holds, its reader (raises ValueError on a file that is not the data
    set) and a second source: the Hugging Face dataset holding its rows (``from_hub``)."""

    what: str  # "the official HellaSwag validation set"
    url: str
    path: str  # under gpt2lab's cache (system.env.cache_dir): "hellaswag/hellaswag_val.jsonl"
    form: str  # what --data FILE holds instead: "a jsonl with ctx, endings, label"
    check: Callable[[str], object]
    second: tuple[str, Optional[str], str, tuple[str, ...]]  # the dataset's name, config, split, a row's fields

    def cached(self) -> str:
        """Where it is cached (it may not be there yet)."""
        return os.path.join(env.cache_dir(), self.path)


def cached_file(ds: DataSet, flag: str = "--data") -> str:
    """The path of ``ds`` in the cache, downloading it on first use (module docstring). Offline,
    unreachable or no good copy anywhere: a RuntimeError in one line naming ``flag``, the caller's
    flag for a local file."""
    dest = ds.cached()
    if os.path.isfile(dest):
        return dest
    if env.offline():
        raise _unavailable(ds, flag, f"{' and '.join(env.offline())} set")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    sweep_stale(os.path.dirname(dest))  # the temporaries of downloads that were killed
    try:
        _store(ds, lambda out: _fetch_url(ds.url, out))
        return dest
    except GPT2LabError:  # a full disk: its own error and exit code
        raise
    except urllib.error.HTTPError as e:  # the server is there but the file is not: try the second source
        first = str(e)
    except (OSError, http.client.HTTPException) as e:  # no network, no DNS, cut short: a second would fail too
        raise _unavailable(ds, flag, str(getattr(e, "reason", None) or e)) from None
    except ValueError as e:  # downloaded, but not the data set (the check named the temporary file it read)
        first = f"not {ds.what}: " + str(e).replace(f"{tmp_name(dest)}:", "the download, line ")
    try:
        _store(ds, lambda out: from_hub(ds, out))
        return dest
    except GPT2LabError:
        raise
    except Exception as e:  # the hub raises many types
        raise _unavailable(ds, flag, f"{first}; {ds.second[0]}: {type(e).__name__}: {e}") from None


def from_hub(ds: DataSet, out: BinaryIO) -> None:
    """The second source's copy of ``ds``: its Hugging Face dataset's rows as JSON lines of the fields it names."""
    from datasets import load_dataset  # optional dependency, only for this fallback

    name, config, split, fields = ds.second
    for row in load_dataset(name, config, split=split):
        out.write((json.dumps({k: row[k] for k in fields}) + "\n").encode())


def json_lines(path: str, parse: Callable[[Any], T], limit: Optional[int] = None) -> list[T]:
    """``parse`` of the JSON value of each line of ``path`` (blank lines skipped; the first ``limit``). A line
    that is not JSON, or that ``parse`` refuses (a ValueError saying why), is a ValueError naming ``path:line``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            try:
                out += [parse(json.loads(line))] if line.strip() else []
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object"
                ) from None
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    return out


def _unavailable(ds: DataSet, flag: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"{ds.what} is not in the cache and could not be downloaded from {ds.url} ({why}); "
        f"pass {flag} FILE ({ds.form}), or download that file to {ds.cached()}"
    )


def _store(ds: DataSet, fetch: Callable[[BinaryIO], None]) -> None:
    """``fetch`` writes the file; it becomes the cache file only once ``ds.check`` has read it whole."""
    dest = ds.cached()
    with atomic_write(dest, "wb", what_next=f"free some space, or pass a local file instead of {ds.what}") as out:
        fetch(out)
        out.flush()
        ds.check(tmp_name(dest))  # the temporary atomic_write renames when the block ends


def _fetch_url(url: str, out: BinaryIO) -> None:
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as r:
        announced = r.headers.get("Content-Length")
        start = out.tell()
        shutil.copyfileobj(r, out)
        got = out.tell() - start
    # http.client returns what it got when a connection closes early, so the length is checked here
    if announced is not None and announced.isdigit() and got != int(announced):
        raise OSError(f"the download ended after {got:,} of {int(announced):,} bytes")

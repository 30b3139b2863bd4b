"""The format version of every file gpt2lab writes and reads back, and the one check of it.

Each artefact that a later gpt2lab may read carries the version of its layout under
``format_version`` (FORMAT_KEY), written by its writer (``stamp``):

  run         the run's settings, ``config.json`` of a run directory and of each checkpoint
              (train.config.save_config, checkpoint.store.save); version 1 was the unversioned,
              flat or half-nested config.json of gpt2lab 0.1.0's first runs
  checkpoint  a checkpoint's ``state.pt`` (checkpoint.store.save), beside that config.json
  manifest    a prepared directory's ``manifest.json`` (its ``version`` key: data/shards.py)
  probes      the probe cache ``probes.json`` (its ``version`` key): a cache,
              so one of another version is measured again, never refused (``is_current``)

A reader hands what it read to ``unstamp``, which returns it without the key, or refuses a
file of an older version (none at all counts as older) or a newer one in one line naming the
file, its version, the one this gpt2lab reads and what to do, as the reader's typed error
(ConfigError for a run directory's config.json, CheckpointError for a checkpoint's files).
Nothing converts an old file: a layout changes, its version goes up, and the files of the
version before are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpt2lab.system.errors import ConfigError, GPT2LabError

FORMAT_KEY = "format_version"


@dataclass(frozen=True)
class Format:
    """One kind of file: what it is called in a message, the version this gpt2lab writes and
    reads, and what to do with a file of an older one."""

    what: str
    version: int
    older: str


_AGAIN = "train it again, or read it with the gpt2lab 0.1.x that wrote it"
RUN = Format("run config", 2, _AGAIN)
CHECKPOINT = Format("checkpoint", 1, _AGAIN)
PROBES = Format("probe cache", 3, "it is measured again")
# a prepared directory's manifest.json (its "version" key; 2: the val split is whole documents, per-file counts)
MANIFEST = Format("prepare manifest", 2, "prepare the data again into a new directory")


def stamp(data: Mapping[str, Any], fmt: Format) -> dict:
    """``data`` as its writer writes it: ``format_version`` first, then the rest."""
    return {FORMAT_KEY: fmt.version, **{k: v for k, v in data.items() if k != FORMAT_KEY}}


def check_version(path: str, found: Any, fmt: Format, error: type[GPT2LabError] = ConfigError) -> None:
    """Raise ``error`` in one line unless ``found`` (a file's version; None: it has none) is ``fmt``'s."""
    known = isinstance(found, int) and not isinstance(found, bool)
    if known and found == fmt.version:
        return
    from gpt2lab import __version__

    reads = f"this gpt2lab ({__version__}) reads {fmt.what} format {fmt.version}"
    if found is None or known and found < fmt.version:
        said = f"a {fmt.what} without {FORMAT_KEY}" if found is None else f"{fmt.what} format {found}"
        raise error(f"{path}: {said}, written by an older gpt2lab; {reads}; {fmt.older}")
    what = f"format {found}, written by a newer gpt2lab" if known else f"format {found!r}, unknown to this gpt2lab"
    raise error(f"{path}: {fmt.what} {what}; {reads}; upgrade gpt2lab to read it")


def unstamp(data: Mapping[str, Any], path: str, fmt: Format, error: type[GPT2LabError] = ConfigError) -> dict:
    """What a file held, without its ``format_version``, once ``check_version`` has passed it."""
    check_version(path, data.get(FORMAT_KEY), fmt, error)
    return {k: v for k, v in data.items() if k != FORMAT_KEY}


def is_current(data: Any, fmt: Format, key: str = FORMAT_KEY) -> bool:
    """Whether a cache's content is of ``fmt``'s version (else its reader measures it again)."""
    found = data.get(key) if isinstance(data, Mapping) else None
    return isinstance(found, int) and not isinstance(found, bool) and found == fmt.version

"""The manifest.json of a prepared directory: a manifest of another format version is refused in one
line naming the file, its version, the version this gpt2lab reads and what to do, both where a
directory is read (shards.read_manifest: training, eval, the loader) and where prepare resumes it;
an older layout of the same version is refused as unreadable, not guessed at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpt2lab
from gpt2lab import cli
from gpt2lab.data import TokenLoader
from gpt2lab.data.prepare import prepare
from gpt2lab.data.shards import MANIFEST_FORMAT, MANIFEST_VERSION, ShardError, read_manifest
from gpt2lab.system.errors import EXIT_ERROR, DataError

OLDER = (
    "{path}: prepare manifest format {v}, written by an older gpt2lab; this gpt2lab ("
    + gpt2lab.__version__
    + f") reads prepare manifest format {MANIFEST_VERSION}; prepare the data again into a new directory"
)
NEWER = (
    "{path}: prepare manifest format {v}, written by a newer gpt2lab; this gpt2lab ("
    + gpt2lab.__version__
    + f") reads prepare manifest format {MANIFEST_VERSION}; upgrade gpt2lab to read it"
)
VERSIONS = [
    pytest.param(MANIFEST_VERSION - 1, OLDER, id="older"),
    pytest.param(MANIFEST_VERSION + 1, NEWER, id="newer"),
]


def _source(tmp_path: Path) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"Document {i}: " + "the quick brown fox " * i}) + "\n" for i in range(30))
    )
    return str(path)


def _prepare(tmp_path: Path, out: str = "data") -> str:
    prepare(_source(tmp_path), str(tmp_path / out), shard_tokens=100, val_tokens=120, workers=1, progress=False)
    return str(tmp_path / out)


def _set(data: str, **fields) -> Path:
    """Rewrite ``data``'s manifest with ``fields`` changed (None: removed)."""
    path = Path(data) / "manifest.json"
    manifest = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            manifest.pop(key)
        else:
            manifest[key] = value
    path.write_text(json.dumps(manifest))
    return path


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_a_prepared_directory_is_in_the_version_this_gpt2lab_reads(tmp_path):
    manifest = read_manifest(_prepare(tmp_path))
    assert manifest["format"] == MANIFEST_FORMAT == "gpt2lab-token-shards" and manifest["version"] == MANIFEST_VERSION
    assert read_manifest(tmp_path / "none") == {}  # no manifest (build-nanogpt's .npy shards): nothing to check


@pytest.mark.parametrize("version, line", VERSIONS)
def test_reading_a_manifest_of_another_version_is_refused_in_one_line(tmp_path, version, line):
    data = _prepare(tmp_path)
    path = _set(data, version=version)
    with pytest.raises(ShardError) as e:
        read_manifest(data)
    assert str(e.value) == line.format(path=path, v=version) and isinstance(e.value, DataError)
    with pytest.raises(ShardError) as e:  # the loader reads it the same way
        TokenLoader(data, "train", 1, 8)
    assert str(e.value) == line.format(path=path, v=version)


@pytest.mark.parametrize("version, line", VERSIONS)
def test_the_cli_prints_the_refusal_as_one_line_and_exits_1(tmp_path, capsys, version, line):
    data = _prepare(tmp_path)
    path = _set(data, version=version)
    argv = ["train", "--preset", "shakespeare-cpu", "--data", data, "--out", str(tmp_path / "run"), "--dry-run"]
    assert cli.main(argv) == EXIT_ERROR
    assert _one_line(capsys.readouterr().err) == "gpt2lab train: " + line.format(path=path, v=version)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("complete", [True, False], ids=["finished", "unfinished"])
@pytest.mark.parametrize("version, line", VERSIONS)
def test_prepare_refuses_to_resume_or_check_a_directory_of_another_version(tmp_path, capsys, version, line, complete):
    data = _prepare(tmp_path)
    before = {p.name: p.read_bytes() for p in Path(data).iterdir() if p.name != "manifest.json"}
    path = _set(data, version=version, complete=complete)
    argv = [
        "prepare",
        "--source",
        _source(tmp_path),
        "--out",
        data,
        "--shard-tokens",
        "100",
        "--val-tokens",
        "120",
        "--workers",
        "1",
        "--quiet",
    ]
    assert cli.main(argv) == EXIT_ERROR
    assert _one_line(capsys.readouterr().err) == "gpt2lab prepare: " + line.format(path=path, v=version)
    assert {p.name: p.read_bytes() for p in Path(data).iterdir() if p.name != "manifest.json"} == before
    assert json.loads(path.read_text())["version"] == version  # nothing was started over


@pytest.mark.parametrize(
    "fields, found",
    [
        (dict(version=None), f"format {MANIFEST_FORMAT!r}, version None"),
        (dict(version="2"), f"format {MANIFEST_FORMAT!r}, version '2'"),
        (dict(format="someone-else", version=MANIFEST_VERSION), f"format 'someone-else', version {MANIFEST_VERSION}"),
    ],
)
def test_a_manifest_without_gpt2labs_format_and_version_is_not_read(tmp_path, fields, found):
    data = _prepare(tmp_path)
    path = _set(data, **fields)
    for read in (
        read_manifest,
        lambda d: prepare(_source(tmp_path), d, shard_tokens=100, val_tokens=120, workers=1, progress=False),
    ):
        with pytest.raises(ShardError) as e:
            read(data)
        assert str(e.value) == (
            f"{path}: not a gpt2lab prepare manifest ({found}; this gpt2lab reads "
            f"{MANIFEST_FORMAT!r} version {MANIFEST_VERSION}); prepare the data again into a "
            "new directory"
        )


@pytest.mark.parametrize(
    "drop, named", [("dtype", "dtype"), ("val_split", "settings.val_split"), ("format", "settings.format")]
)
def test_an_older_layout_of_the_same_version_is_refused_not_guessed(tmp_path, drop, named):
    """Manifests written before these fields existed were read with defaults; no longer."""
    data = _prepare(tmp_path)
    path = Path(data) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["complete"] = False
    manifest.pop(drop) if drop == "dtype" else manifest["settings"].pop(drop)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as e:
        prepare(_source(tmp_path), data, shard_tokens=100, val_tokens=120, workers=1, progress=False)
    assert str(e.value) == (f"{path}: not a readable gpt2lab prepare manifest (KeyError: '{named}'); use another --out")

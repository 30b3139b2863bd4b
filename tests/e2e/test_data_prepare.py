"""gpt2lab prepare: round trip, manifest, workers, crash + resume, sources, bad input, CLI.

The reference for every token stream is a plain loop: for each document, EOT then
``encode_ordinary(text)``.
"""

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA

import gpt2lab.data.manifest as shard_writer
import gpt2lab.data.parallel as par
import gpt2lab.data.prepare as prep
from gpt2lab.cli import main
from gpt2lab.data.prepare import prepare
from gpt2lab.data.shards import MANIFEST_FILE, ShardError
from gpt2lab.data.shards import write_shard as real_write_shard
from gpt2lab.data.sources import SourceError, resolve_source
from gpt2lab.data.tokenizer import EOT_ID, asset_path, gpt2_tokenizer

DOCS = [f"Document {i}: " + "the quick brown fox " * (i % 7) + "ünïcödé ✓ 漢字" * (i % 3) for i in range(40)]
DOCS[5] = ""  # an empty document is still a document
DOCS[9] = "a literal <|endoftext|> in text is text, not the separator"


def _jsonl(path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _reference(docs):
    enc = gpt2_tokenizer()
    return np.array([t for d in docs for t in [EOT_ID] + enc.encode_ordinary(d)], dtype=np.uint16)


def _read(path):
    """A shard read without gpt2lab: header ints, then uint16."""
    header = np.fromfile(path, dtype="<i4", count=256)
    toks = np.fromfile(path, dtype="<u2", offset=1024)
    assert header[0] == 20240520 and header[1] == 1 and header[2] == len(toks)
    return toks


def _stream(out, manifest):
    return np.concatenate([_read(out / s["name"]) for s in manifest["shards"]])


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_round_trip_jsonl_and_manifest(tmp_path):
    out = tmp_path / "out"
    m = prepare(
        str(_jsonl(tmp_path / "docs.jsonl")), str(out), shard_tokens=97, val_tokens=150, workers=1, progress=False
    )
    stream = _stream(out, m)
    assert np.array_equal(stream, _reference(DOCS))
    starts = np.flatnonzero(stream == EOT_ID)
    enc = gpt2_tokenizer()
    decoded = [enc.decode(p[1:].tolist()) for p in np.split(stream, starts[1:])]
    assert decoded == DOCS
    assert m["complete"] and m["documents"] == len(DOCS) and m["tokens"] == len(stream)
    # val is exactly the first 150 tokens (the default --val-split tokens)
    lengths = [1 + len(enc.encode_ordinary(d)) for d in DOCS]
    assert m["splits"]["val"]["tokens"] == 150 and m["splits"]["val"]["shards"] == ["val_000000.bin", "val_000001.bin"]
    raw = (tmp_path / "docs.jsonl").read_bytes()
    assert m["files"] == [
        {
            "path": str(tmp_path / "docs.jsonl"),
            "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),  # the file is known by its content
            "first_doc": 0,
            "first_token": 0,
            "documents": len(DOCS),
            "tokens": sum(lengths),
        }
    ]
    for split in ("val", "train"):
        shards = [s for s in m["shards"] if s["split"] == split]
        assert all(s["tokens"] == 97 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 97
        cut = int(_read(out / shards[0]["name"])[0] != EOT_ID)  # the split begins inside a document
        assert m["splits"][split]["documents"] == sum(s["documents"] for s in shards) + cut
    for s in m["shards"]:
        toks = _read(out / s["name"])
        assert s["tokens"] == len(toks) and s["documents"] == int((toks == EOT_ID).sum())
    assert json.loads((out / "manifest.json").read_text()) == m


@pytest.mark.parametrize("thread_pool_max_bytes", [0, 1 << 40], ids=["processes", "threads"])
def test_one_worker_and_two_workers_write_the_same_shards(tmp_path, monkeypatch, thread_pool_max_bytes):
    monkeypatch.setattr(par, "THREAD_POOL_MAX_BYTES", thread_pool_max_bytes)  # which pool tokenizes
    monkeypatch.setattr(par, "TASK_DOCS", 3)  # many small tasks, so the pool really interleaves
    src = str(_jsonl(tmp_path / "docs.jsonl"))
    prepare(src, str(tmp_path / "w1"), shard_tokens=64, val_tokens=100, workers=1, progress=False)
    prepare(src, str(tmp_path / "w2"), shard_tokens=64, val_tokens=100, workers=2, progress=False)
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")


# Above Linux's largest pid_max (2**22): the process that left a temporary with this pid is gone.
DEAD_PID = 2**22 + 1


def _crash_after(monkeypatch, n_shards, exc=KeyboardInterrupt):
    real, calls = shard_writer.write_shard, []

    def flaky(path, tokens):
        if len(calls) == n_shards:
            (path.parent / f".tmp_{path.name}_{DEAD_PID}").write_bytes(b"half a shard")  # as if killed mid-write
            raise exc("injected crash")
        calls.append(path)
        real(path, tokens)

    monkeypatch.setattr(shard_writer, "write_shard", flaky)


@pytest.mark.parametrize("thread_pool_max_bytes", [0, 1 << 40], ids=["processes", "threads"])
def test_crash_then_rerun_equals_uninterrupted_run(tmp_path, monkeypatch, thread_pool_max_bytes):
    monkeypatch.setattr(par, "THREAD_POOL_MAX_BYTES", thread_pool_max_bytes)
    monkeypatch.setattr(par, "TASK_DOCS", 4)
    src = str(_jsonl(tmp_path / "docs.jsonl"))
    kw = dict(shard_tokens=80, val_tokens=120, progress=False)
    prepare(src, str(tmp_path / "ref"), workers=1, **kw)
    _crash_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        prepare(src, str(tmp_path / "out"), workers=2, **kw)
    half = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert not half["complete"] and len(half["shards"]) == 3 and half["shards"][-1]["resume"]["next_doc"] > 0
    monkeypatch.setattr(shard_writer, "write_shard", real_write_shard)
    prepare(src, str(tmp_path / "out"), workers=1, **kw)
    assert _files(tmp_path / "ref") == _files(tmp_path / "out")
    with pytest.raises(ShardError, match="prepared with"):
        prepare(src, str(tmp_path / "out"), workers=1, shard_tokens=81, val_tokens=120, progress=False)


@pytest.mark.parametrize("first_run", ["killed", "finished", "earlier gpt2lab"])
def test_a_source_file_edited_in_place_is_named_and_never_mixed_in(tmp_path, monkeypatch, first_run):
    """The second of three files edited in place, its size and its mtime kept: the rerun names it and
    ends with exactly the files of a fresh prepare of the edited source, whether the first run was
    killed after some of the file's shards or had finished (the shards made before the file are
    kept, not written again). A manifest of the earlier gpt2lab (no content recorded, no resume point per
    shard) is read and prepared again from the start."""
    d = tmp_path / "src"
    d.mkdir()
    for i, name in enumerate("abc"):
        _jsonl(d / f"{name}.jsonl", DOCS[i::3])
    kw = dict(shard_tokens=60, val_tokens=100, workers=1, progress=False)
    if first_run == "finished":
        prepare(str(d), str(tmp_path / "out"), **kw)
    else:
        _crash_after(monkeypatch, 12)
        with pytest.raises(KeyboardInterrupt):
            prepare(str(d), str(tmp_path / "out"), **kw)
        monkeypatch.setattr(shard_writer, "write_shard", real_write_shard)
    path = tmp_path / "out" / MANIFEST_FILE
    old = json.loads(path.read_text())
    assert len(old["files"]) >= 2 and old["files"][1]["path"] == str(d / "b.jsonl")  # shards hold some of b
    kept = [s["name"] for s in old["shards"] if s["resume"]["tokens"] < old["files"][1]["first_token"]]
    if first_run == "earlier gpt2lab":  # as the version before content ids wrote it
        for entry in old["files"] + old["shards"]:
            entry.pop("sha256", None), entry.pop("resume", None)
        path.write_text(json.dumps(old))
    b = d / "b.jsonl"
    stat, text = b.stat(), b.read_text()
    b.write_text(text.replace("quick", "QUICK"))  # the same size, other text
    os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert b.stat().st_size == stat.st_size and b.stat().st_mtime_ns == stat.st_mtime_ns and b.read_text() != text
    if first_run == "earlier gpt2lab":
        kept, said = [], f"{d / 'a.jsonl'}: its content is not recorded (prepared by an earlier gpt2lab)"
        said += "; preparing it again from the start"
    else:
        said = f"{b} changed since it was prepared (its content differs); preparing it again from that file on, "
        said += f"after the {len(kept)} shard(s) made before it"
    assert len(kept) > 1 or first_run == "earlier gpt2lab"
    inodes = {n: (tmp_path / "out" / n).stat().st_ino for n in kept}
    with pytest.warns(UserWarning) as caught:
        prepare(str(d), str(tmp_path / "out"), **kw)
    assert said in [str(w.message).split(": ", 1)[1] for w in caught]
    prepare(str(d), str(tmp_path / "fresh"), **kw)
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")
    assert {n: (tmp_path / "out" / n).stat().st_ino for n in kept} == inodes  # kept, not written again


def test_local_sources_agree(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = DOCS[:12]
    pq.write_table(pa.table({"body": docs}), tmp_path / "docs.parquet", row_group_size=5)
    _jsonl(tmp_path / "docs.jsonl", docs, field="body")
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, d in enumerate(docs):
        (txt / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    ref = _reference(docs)
    for name, src in [
        ("pq", tmp_path / "docs.parquet"),
        ("jl", tmp_path / "docs.jsonl"),
        ("dir", txt),
        ("glob", txt / "*.txt"),
    ]:
        m = prepare(str(src), str(tmp_path / name), val_tokens=0, text_field="body", progress=False)
        assert np.array_equal(_stream(tmp_path / name, m), ref), name
    m = prepare(
        str(tmp_path / "docs.jsonl"),
        str(tmp_path / "lim"),
        val_tokens=0,
        text_field="body",
        limit_docs=5,
        progress=False,
    )
    assert np.array_equal(_stream(tmp_path / "lim", m), _reference(docs[:5]))


def test_hub_source_streams_through_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    data = _jsonl(tmp_path / "docs.jsonl")
    asked, real_load = [], datasets.load_dataset

    def local_load(name, config, split, streaming):
        asked.append((name, config, split, streaming))
        return real_load("json", data_files=str(data), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", local_load)
    kw = dict(shard_tokens=90, val_tokens=100, limit_docs=30, workers=1, progress=False)
    m = prepare("fineweb-edu", str(tmp_path / "ref"), **kw)
    assert asked[0] == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)
    assert np.array_equal(_stream(tmp_path / "ref", m), _reference(DOCS[:30]))
    _crash_after(monkeypatch, 2, RuntimeError)  # the resume skips documents with ds.skip
    with pytest.raises(RuntimeError):
        prepare("hf:some/name:cfg", str(tmp_path / "out"), **kw)
    monkeypatch.setattr(shard_writer, "write_shard", real_write_shard)
    prepare("hf:some/name:cfg", str(tmp_path / "out"), **kw)
    assert asked[-1][:2] == ("some/name", "cfg")
    ref_files = _files(tmp_path / "ref")
    out_files = _files(tmp_path / "out")
    assert {k: v for k, v in out_files.items() if k != "manifest.json"} == {
        k: v for k, v in ref_files.items() if k != "manifest.json"
    }


def test_hub_without_datasets_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(SourceError, match=r"pip install 'gpt2lab\[data\]'"):
        prepare("fineweb-edu", str(tmp_path / "out"), progress=False)


def test_hub_unreachable_is_a_clear_error(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SourceError, match=r"HuggingFaceFW/fineweb \(config sample-100BT\).*network"):
        prepare("fineweb", str(tmp_path / "out"), config="sample-100BT", workers=1, progress=False)


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"text": "ok"', r"docs.jsonl:3: not valid JSON"),
        ('{"body": "no text field"}', r"docs.jsonl:3: no field 'text' \(fields: body\)"),
        ('{"text": 42}', r"docs.jsonl:3: field 'text' is int"),
        ('["a", "list"]', r"docs.jsonl:3: a JSON list"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, line, match):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n' + line + "\n")
    with pytest.raises(SourceError, match=match):
        prepare(str(path), str(tmp_path / "out"), workers=1, progress=False)


@pytest.mark.parametrize("thread_pool_max_bytes", [0, 1 << 40], ids=["processes", "threads"])
def test_bad_line_found_by_a_worker_is_reported(tmp_path, monkeypatch, thread_pool_max_bytes):
    monkeypatch.setattr(par, "THREAD_POOL_MAX_BYTES", thread_pool_max_bytes)
    monkeypatch.setattr(par, "TASK_DOCS", 2)
    path = _jsonl(tmp_path / "docs.jsonl")
    path.write_text(path.read_text() + '{"txt": "typo"}\n')
    with pytest.raises(SourceError, match=rf"docs.jsonl:{len(DOCS) + 1}: no field 'text'"):
        prepare(str(path), str(tmp_path / "out"), workers=2, progress=False)
    assert not json.loads((tmp_path / "out" / "manifest.json").read_text())["complete"]


def test_other_bad_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(SourceError, match="no such file or directory"):
        prepare(str(tmp_path / "missing.jsonl"), str(tmp_path / "out"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match=r"empty holds no files; point --source at text files \(any UTF-8 text file"):
        prepare(str(tmp_path / "empty"), str(tmp_path / "out"), progress=False)
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(SourceError, match=r"d.parquet: no column 'text' \(columns: content\)"):
        prepare(str(tmp_path / "d.parquet"), str(tmp_path / "out"), progress=False)


def test_tinyshakespeare_documents_are_its_speeches():
    src = resolve_source("tinyshakespeare")
    docs = list(src.documents(0, None))
    text = open(asset_path("tinyshakespeare.txt"), encoding="utf-8").read()
    assert len(docs) == 7222 and "\n\n".join(docs) == text
    assert docs[0] == "First Citizen:\nBefore we proceed any further, hear me speak."
    assert prep.default_val_tokens(src, 10**8) == int(np.ceil(0.05 * len(text.encode()) / 4))


def test_cli_prepare(tmp_path, capsys):
    src = str(_jsonl(tmp_path / "docs.jsonl"))
    rc = main(
        [
            "prepare",
            "--source",
            src,
            "--out",
            str(tmp_path / "out"),
            "--shard-tokens",
            "100",
            "--val-tokens",
            "50",
            "--workers",
            "1",
        ]
    )
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert rc == 0 and out["documents"] == len(DOCS) and out["splits"]["val"]["tokens"] == 50
    assert "docs=40" in cap.err and "tok" in cap.err  # the progress bar: documents and tokens
    rc = main(["prepare", "--source", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o2")])
    assert rc == 1 and "nope.jsonl" in capsys.readouterr().err


def _default_sigint() -> None:
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_state() -> list:
    """This process's blocked, ignored and caught signals (Linux), for a failure's message."""
    with open(f"/proc/{os.getpid()}/status") as f:
        return [ln for ln in f.read().splitlines() if ln.startswith(("SigBlk", "SigIgn", "SigCgt"))]


def test_ctrl_c_of_the_cli_then_rerun_equals_uninterrupted(tmp_path):
    import signal
    import subprocess
    import time

    args = ["--shard-tokens", "50000", "--val-tokens", "20000"]
    speeches = list(resolve_source("tinyshakespeare").documents(0, None))
    # A fast machine can finish a small source between the first shard and the signal: then the
    # source grows (4x, 16x, 64x Tiny Shakespeare, ~1.3M to ~21M tokens) until the signal lands mid-run.
    for scale in (4, 16, 64):
        src = str(_jsonl(tmp_path / f"big{scale}.jsonl", speeches * scale))
        out = tmp_path / f"out{scale}"
        cmd = [
            sys.executable,
            "-m",
            "gpt2lab",
            "prepare",
            "--source",
            src,
            "--out",
            str(out),
            "--workers",
            "2",
            "--quiet",
            *args,
        ]
        # a Ctrl-C as a terminal sends it: the child starts with SIGINT unblocked and at its default, whatever
        # signal state this test process was left in (a blocked or ignored signal is inherited through exec)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)
        manifest = out / "manifest.json"
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            try:
                if json.loads(manifest.read_text())["shards"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if proc.returncode == 0 and json.loads(manifest.read_text())["complete"]:
            continue  # done before the signal: try a bigger source
        break
    assert proc.returncode == 130, (_signal_state(), err.decode()[-2000:])
    half = json.loads(manifest.read_text())
    assert not half["complete"] and 0 < len(half["shards"]) < 26 * scale
    assert main(["prepare", "--source", src, "--out", str(out), "--quiet", *args]) == 0
    assert main(["prepare", "--source", src, "--out", str(tmp_path / "ref"), "--quiet", *args]) == 0
    assert _files(tmp_path / "ref") == _files(out)


# -- compressed sources, real text (a slice of the shared Wikipedia set) -----------------
WIKI = DATA / "wiki_slice.jsonl.zst"


def _wiki_rows():
    import zstandard

    return [json.loads(line) for line in zstandard.decompress(WIKI.read_bytes()).decode().splitlines()]


def test_compressed_sources_agree_with_plain_ones(tmp_path):
    import bz2
    import gzip
    import lzma

    import zstandard

    rows = _wiki_rows()[:6]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    frames = zstandard.ZstdCompressor().compress(
        lines[: len(lines) // 2].encode()
    ) + zstandard.ZstdCompressor().compress(lines[len(lines) // 2 :].encode())  # two frames, as pzstd writes
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_text(lines)
    (d / "b.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (d / "c.json.gz").write_bytes(gzip.compress(lines.encode()))
    (d / "d.jsonl.zst").write_bytes(frames)
    (d / "e.jsonl.xz").write_bytes(lzma.compress(lines.encode()))
    (d / "f.jsonl.bz2").write_bytes(bz2.compress(lines.encode()))
    (d / "g.txt.gz").write_bytes(gzip.compress(rows[0]["text"].encode()))
    (d / "h.txt.zst").write_bytes(zstandard.compress(rows[1]["text"].encode()))
    (d / "i.txt.xz").write_bytes(lzma.compress(rows[2]["text"].encode()))
    texts = [r["text"] for r in rows]
    expected = texts * 6 + texts[:3]
    m = prepare(str(d), str(tmp_path / "out"), val_tokens=0, workers=1, progress=False)
    assert np.array_equal(_stream(tmp_path / "out", m), _reference(expected))
    enc = gpt2_tokenizer()
    per_doc = [1 + len(enc.encode_ordinary(t)) for t in texts]
    counts = {Path(f["path"]).name: (f["documents"], f["tokens"]) for f in m["files"]}
    assert counts == {
        **{
            n: (6, sum(per_doc))
            for n in ["a.jsonl", "b.jsonl.gz", "c.json.gz", "d.jsonl.zst", "e.jsonl.xz", "f.jsonl.bz2"]
        },
        "g.txt.gz": (1, per_doc[0]),
        "h.txt.zst": (1, per_doc[1]),
        "i.txt.xz": (1, per_doc[2]),
    }
    m = prepare(str(d / "*.jsonl.*"), str(tmp_path / "glob"), val_tokens=0, workers=1, progress=False)
    assert np.array_equal(_stream(tmp_path / "glob", m), _reference(texts * 4))


def _damaged(tmp_path):
    import gzip

    import zstandard

    lines = "".join(json.dumps(r) + "\n" for r in _wiki_rows()[:4]).encode()
    z, g = zstandard.compress(lines), gzip.compress(lines)
    files = {
        "cut.jsonl.zst": z[: len(z) // 2],
        "cut.jsonl.gz": g[: len(g) // 2],
        "junk.jsonl.zst": b"not zstd at all" * 50,
        "junk.txt.gz": b"not gzip" * 50,
        "junk.txt.xz": b"not xz" * 50,
        "junk.jsonl.bz2": b"not bz2" * 50,
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return list(files)


@pytest.mark.parametrize("workers", [1, 2])
def test_damaged_compressed_file_is_one_line_naming_it(tmp_path, monkeypatch, capsys, workers):
    monkeypatch.setattr(par, "THREAD_POOL_MAX_BYTES", 0)  # 2 workers: processes
    for name in _damaged(tmp_path):
        rc = main(
            [
                "prepare",
                "--source",
                str(tmp_path / name),
                "--out",
                str(tmp_path / f"out-{name}"),
                "--workers",
                str(workers),
                "--quiet",
            ]
        )
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"gpt2lab prepare: {tmp_path / name}: not a readable .") and "corrupt or truncated" in err


def test_any_text_file_is_a_document_and_binary_ones_are_skipped_naming_each(tmp_path):
    """Files of no known kind are text, one document each; in a directory those that are not UTF-8 text
    (a NUL byte, bytes UTF-8 does not have) are skipped with a warning naming them, and names beginning
    with a dot are left out, as a glob leaves them."""
    d = tmp_path / "src"
    (d / "pkg" / "sub").mkdir(parents=True)
    (d / ".git").mkdir()
    _jsonl(d / "a.jsonl")
    (d / "README.md").write_text("about ✓")
    (d / "pkg" / "sub" / "mod.py").write_text("def f():\n    return 1\n")
    (d / "pkg" / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (d / "pkg" / "old.dat").write_bytes("café".encode("latin-1"))
    (d / ".git" / "config").write_text("[core]")
    (d / ".hidden.md").write_text("secret")
    with pytest.warns(UserWarning, match=r"holds 2 file\(s\) that are not UTF-8 text, skipped: .*img.png, .*old.dat$"):
        m = prepare(str(d), str(tmp_path / "out"), val_tokens=0, workers=1, progress=False)
    assert [f["path"] for f in m["files"]] == [str(d / "README.md"), str(d / "a.jsonl"), str(d / "pkg/sub/mod.py")]
    got = np.concatenate(
        [np.fromfile(tmp_path / "out" / n, dtype=np.uint16, offset=1024) for n in m["splits"]["train"]["shards"]]
    )
    np.testing.assert_array_equal(got, _reference(["about ✓", *DOCS, "def f():\n    return 1\n"]))
    # a recursive glob, quoted: the same .py file, nothing else
    m = prepare(str(d / "**" / "*.py"), str(tmp_path / "py"), val_tokens=0, workers=1, progress=False)
    assert [f["path"] for f in m["files"]] == [str(d / "pkg/sub/mod.py")]
    # named alone, a file that is not UTF-8 is one line naming it
    with pytest.raises(SourceError, match=r"old.dat: not UTF-8 text .*convert it to UTF-8"):
        prepare(str(d / "pkg" / "old.dat"), str(tmp_path / "one"), workers=1, progress=False)
    with pytest.raises(SourceError, match=r"matches no files \(the 1 there are not UTF-8 text\)"):
        prepare(str(d / "pkg" / "*.png"), str(tmp_path / "png"), workers=1, progress=False)


@pytest.mark.parametrize("bad", ["garbage", "truncated"])
def test_rerun_after_a_bad_file_was_removed_starts_cleanly(tmp_path, capsys, bad):
    """garbage: none of the bad file reached a shard, so the rerun goes on from what is
    there (its --val-tokens default, worked out from the source's size, changed with the
    removal and must not matter: the bug was a refusal over it); truncated: shards hold
    some of its articles, so the rerun starts over (the --val-tokens default moved with the source).
    Either way the shards equal a fresh run's."""
    import zstandard

    rows = _wiki_rows()
    d = tmp_path / "src"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[10:13]))
    whole = zstandard.compress(("".join(json.dumps(r) + "\n" for r in rows[:10])).encode())
    (d / "b.jsonl.zst").write_bytes(b"\0" * len(whole) if bad == "garbage" else whole[: len(whole) * 3 // 4])
    args = ["prepare", "--source", str(d), "--shard-tokens", "2000", "--workers", "1", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 1
    assert "b.jsonl.zst: not a readable .zst file" in capsys.readouterr().err
    half = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert not half["complete"] and (bad == "garbage" or half["shards"])
    (d / "b.jsonl.zst").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*args, "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    said = f"{d / 'b.jsonl.zst'} is no longer file 2 of the source; preparing it again from the start"
    assert (said in " ".join(str(w.message) for w in caught)) == (bad == "truncated")
    assert main([*args, "--out", str(tmp_path / "ref")]) == 0
    out, ref = _files(tmp_path / "out"), _files(tmp_path / "ref")
    assert out.pop("manifest.json") and ref.pop("manifest.json") and out == ref and len(out) > 3
    capsys.readouterr()
    assert main([*args[:-1], "--shard-tokens", "999", "--quiet", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err  # only the flag that differs, as a flag
    assert "prepared with --shard-tokens 2000, not --shard-tokens 999" in err and "{" not in err


def test_val_split_is_whole_held_out_articles(tmp_path):
    rows = _wiki_rows()
    enc = gpt2_tokenizer()
    m = prepare(
        str(WIKI),
        str(tmp_path / "out"),
        shard_tokens=6000,
        val_tokens=20_000,
        workers=2,
        progress=False,
        val_split="documents",
    )

    def docs(split):
        toks = np.concatenate([_read(tmp_path / "out" / n) for n in m["splits"][split]["shards"]])
        assert toks[0] == EOT_ID  # the split starts with a whole document
        starts = np.flatnonzero(toks == EOT_ID)
        return [enc.decode(p[1:].tolist()) for p in np.split(toks, starts[1:])]

    val, train = docs("val"), docs("train")
    lengths = np.cumsum([1 + len(enc.encode_ordinary(r["text"])) for r in rows])
    k = int(np.searchsorted(lengths, 20_000)) + 1  # articles up to the one that reaches 20,000 tokens
    assert val == [r["text"] for r in rows[:k]] and train == [r["text"] for r in rows[k:]]
    assert m["splits"]["val"]["tokens"] == lengths[k - 1] >= 20_000 > lengths[k - 2]
    assert len(m["splits"]["val"]["shards"]) > 1  # an article ran across val shards, and stayed in val
    assert not {r["title"] for r in rows[:k]} & {r["title"] for r in rows[k:]}


def test_val_split_by_tokens_is_the_reference_layout(tmp_path):
    """The default: val is exactly the first val_tokens tokens of the stream, and the article
    they cut goes on at the start of train (the reference FineWeb script's layout)."""
    rows = _wiki_rows()
    enc = gpt2_tokenizer()
    m = prepare(str(WIKI), str(tmp_path / "out"), shard_tokens=6000, val_tokens=20_000, workers=2, progress=False)
    stream = np.concatenate([np.array([EOT_ID, *enc.encode_ordinary(r["text"])], dtype=np.uint16) for r in rows])
    val = np.concatenate([_read(tmp_path / "out" / n) for n in m["splits"]["val"]["shards"]])
    train = np.concatenate([_read(tmp_path / "out" / n) for n in m["splits"]["train"]["shards"]])
    assert len(val) == 20_000 and np.array_equal(np.concatenate([val, train]), stream)
    assert train[0] != EOT_ID  # the cut article continues in train


@pytest.mark.slow
def test_ctrl_c_at_many_moments_ends_fast_and_resumes_byte_identically(tmp_path):
    """Terminal Ctrl-C (SIGINT to the whole process group) at a range of moments of a
    process-pool run; each run must exit 130 within seconds without a traceback, and the
    chain of resumed runs must equal one uninterrupted run."""
    import signal
    import subprocess
    import time

    import zstandard

    lines = "".join(json.dumps(r) + "\n" for r in _wiki_rows()) * 2  # ~250k tokens
    src = tmp_path / "wiki.jsonl.zst"
    src.write_bytes(zstandard.compress(lines.encode()))
    flags = ["--shard-tokens", "7000", "--val-tokens", "20000", "--workers", "2", "--quiet"]
    code = (
        "import sys, gpt2lab.data.parallel as p; p.THREAD_POOL_MAX_BYTES = 0; p.TASK_CHARS_MAX = 1 << 15; "
        "from gpt2lab.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", code, "prepare", "--source", str(src), "--out", str(out), *flags]
    interrupted, waits = 0, []

    def manifest_inode():
        try:
            return os.stat(out / "manifest.json").st_ino
        except FileNotFoundError:
            return None

    def shards():
        return {p.name for p in out.glob("*.bin")} if out.exists() else set()

    # Moments measured by the run's own progress, not by the clock (a fast machine finishes the whole
    # source in a few tenths of a second): right after its manifest, then after 1, 2, 5 and 8 shards
    # more than it found, and once 20 ms after its next shard (tasks in flight in the pool).
    for new_shards, delay in [(0, 0.0), (1, 0.0), (2, 0.0), (5, 0.0), (1, 0.02), (8, 0.0)]:
        before, found = manifest_inode(), shards()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.time() + 60
        while manifest_inode() in (None, before) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.001)  # until the run has begun: it writes its manifest (a new file) first
        while len(shards() - found) < new_shards and proc.poll() is None and time.time() < deadline:
            time.sleep(0.001)
        time.sleep(delay)
        sent = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        waits.append(time.time() - sent)
        if proc.returncode == 0 or json.loads((out / "manifest.json").read_text())["complete"]:
            break  # finished before the signal (it may land in the interpreter's exit: -SIGINT)
        interrupted += 1
        assert proc.returncode == 130 and err.decode().strip() == "gpt2lab prepare: interrupted", err.decode()
    print("interrupted", interrupted, "waits", [round(w, 2) for w in waits])
    assert interrupted >= 4 and max(waits) < 10, (interrupted, waits)
    assert main(["prepare", "--source", str(src), "--out", str(out), *flags]) == 0
    assert main(["prepare", "--source", str(src), "--out", str(tmp_path / "ref"), *flags]) == 0
    assert _files(tmp_path / "ref") == _files(out)


def test_prepare_removes_its_own_stopped_temporaries_and_no_one_elses(tmp_path, monkeypatch):
    """A stopped run's temporary (.tmp_NAME_PID of a dead process) goes; another program's *.tmp stays."""
    out, src = tmp_path / "out", str(_jsonl(tmp_path / "docs.jsonl"))
    kw = dict(shard_tokens=64, val_tokens=100, workers=1, progress=False)
    _crash_after(monkeypatch, 1)  # a stopped prepare: its directory, unfinished
    with pytest.raises(KeyboardInterrupt):
        prepare(src, str(out), **kw)
    monkeypatch.setattr(shard_writer, "write_shard", real_write_shard)
    (out / "keep.tmp").write_text("someone else's")
    (out / "shard_000001.bin.tmp").write_bytes(b"not gpt2lab's name")
    (out / f".tmp_{MANIFEST_FILE}_{DEAD_PID}").write_text("{")
    with pytest.warns(UserWarning, match="removed 2 temporary file"):  # the crash's half shard too
        prepare(src, str(out), **kw)
    assert (out / "keep.tmp").read_text() == "someone else's"
    assert (out / "shard_000001.bin.tmp").read_bytes() == b"not gpt2lab's name"
    assert not (out / f".tmp_{MANIFEST_FILE}_{DEAD_PID}").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool forks its workers on Linux only")
def test_ctrl_c_while_the_workers_fork_leaves_none_of_them_running(monkeypatch):
    """Ctrl-C landing inside Process.start, after the fork: the worker must still be among those the pool
    stops (a worker left out lived on, blocked on its task queue, and a caller reading the output waited
    for ever). Here the signal is sent to the process just after each fork, while another thread runs: the
    kernel may hand it to that thread (blocking it in the main one is no protection), and Python raises
    it in the main thread all the same."""
    import multiprocessing.process
    import signal
    import threading
    import time

    import psutil

    started, real_start = [], multiprocessing.process.BaseProcess.start

    def start_then_ctrl_c(self):
        real_start(self)
        started.append(self.pid)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Python runs the handler at its next check, here

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_then_ctrl_c)
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with par.ordered_map(len, iter(["a document"]), 2, None) as results:  # size unknown: processes
                list(results)
    finally:
        done.set()
        other.join()
    assert len(started) == 2  # both forks ran: the signal waited for the end of the loop

    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    assert not any(running(pid) for pid in started)

"""The held-out conversations `gpt2lab prepare` writes beside conversation shards (data/manifest.py),
checked against the val shard's own tokens, and how `gpt2lab eval chat` finds them (evals/chat.py's
chat_data): a prepared directory, or by default the data the run trained on."""

from __future__ import annotations

import json
import sys
from unittest import mock

import numpy as np
import pytest
from conftest import DATA, ROOT, cli_args

from gpt2lab import cli
from gpt2lab.data import chat
from gpt2lab.data.manifest import HELD_OUT, held_out_file
from gpt2lab.data.prepare import prepare
from gpt2lab.data.shards import list_shards, open_shard
from gpt2lab.evals.chat import chat_data, read_conversations
from gpt2lab.system import formats
from gpt2lab.system.errors import UsageError

CHAT_SLICE = str(DATA / "chat_slice.jsonl.zst")


def _ids(conversations) -> list[int]:
    return [t for turns in conversations for t in chat.encode_chat(turns)[0]]


def _split_tokens(out, split) -> list[int]:
    return np.concatenate([np.asarray(open_shard(p)) for p in list_shards(out, split)]).tolist()


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("held") / "shards"
    manifest = prepare(CHAT_SLICE, str(out), progress=False, shard_tokens=20_000, val_tokens=2000)
    return out, manifest


def test_the_held_out_file_is_the_val_splits_conversations(chat_dir):
    out, manifest = chat_dir
    assert manifest["held_out"] == HELD_OUT and held_out_file(str(out)) == str(out / HELD_OUT)
    assert json.loads((out / "manifest.json").read_text())["held_out"] == HELD_OUT  # saved, not only returned
    held = read_conversations(str(out / HELD_OUT))
    n = manifest["splits"]["val"]["documents"]
    assert 1 < n < 60 and held == read_conversations(CHAT_SLICE)[:n]  # the source's first n, as read from it
    assert _ids(held) == _split_tokens(out, "val")  # exactly what the val shards hold, token for token
    lines = (out / HELD_OUT).read_text().splitlines()
    assert all(set(json.loads(line)) == {"messages"} for line in lines)  # the messages format


def test_a_token_cut_val_split_holds_out_only_whole_conversations(tmp_path):
    out = tmp_path / "shards"
    manifest = prepare(CHAT_SLICE, str(out), progress=False, shard_tokens=20_000, val_tokens=2000, val_split="tokens")
    held = read_conversations(str(out / HELD_OUT))
    val, train = _split_tokens(out, "val"), _split_tokens(out, "train")
    assert len(val) == 2000 and train[0] != manifest["eot_id"]  # the cut runs through a conversation
    assert len(held) == manifest["splits"]["val"]["documents"] - 1  # that one is in train too: not held out
    ids = _ids(held)
    assert ids == val[: len(ids)] and val[len(ids)] == manifest["eot_id"]  # the next one starts in val


def test_a_rerun_of_a_finished_directory_without_the_file_writes_it(tmp_path):
    out = tmp_path / "shards"
    prepare(CHAT_SLICE, str(out), progress=False, shard_tokens=20_000, val_tokens=2000)
    first = (out / HELD_OUT).read_bytes()
    (out / HELD_OUT).unlink()  # as a directory prepared before gpt2lab wrote the file
    m = json.loads((out / "manifest.json").read_text())
    del m["held_out"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert held_out_file(str(out)) is None
    shards = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    prepare(CHAT_SLICE, str(out), progress=False, shard_tokens=20_000, val_tokens=2000)
    assert (out / HELD_OUT).read_bytes() == first and held_out_file(str(out)) == str(out / HELD_OUT)
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == shards  # the shards only checked


def test_text_data_has_no_held_out_conversations(tiny_data):
    assert held_out_file(tiny_data) is None
    with pytest.raises(UsageError, match=f"--data {tiny_data}: prepared data without held-out conversations"):
        chat_data(tiny_data, "gpt2")


def test_chat_data_takes_a_file_a_prepared_directory_or_the_runs_data(chat_dir, tmp_path):
    out, _ = chat_dir
    assert chat_data(CHAT_SLICE, "gpt2") == (CHAT_SLICE, None)  # a file as given
    assert chat_data(str(out), "gpt2") == (str(out / HELD_OUT), None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(formats.stamp({"data": str(out), "model": {}}, formats.RUN)))
    path, note = chat_data(None, str(run))
    assert path == str(out / HELD_OUT) and note == (
        f"no --data: the held-out conversations of {out}, which --model {run} trained on: {path}"
    )
    with pytest.raises(UsageError) as e:
        chat_data(None, "gpt2")
    assert str(e.value) == (
        "--data is needed: --model gpt2 is not a run that names its prepared data; pass --data FILE.jsonl "
        "(conversations in the messages format) or --data DIR (from gpt2lab prepare)"
    )
    (run / "config.json").write_text(json.dumps(formats.stamp({"data": str(tmp_path / "gone")}, formats.RUN)))
    with pytest.raises(UsageError, match=f"{tmp_path / 'gone'}, the data --model {run} trained on, is not here"):
        chat_data(None, str(run))


def test_eval_chat_without_data_scores_the_runs_held_out_conversations(chat_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPT2LAB_PROBE", "0")  # eval's kernels by the device's rule: no timing
    out, manifest = chat_dir
    run = tmp_path / "run"
    argv = ["train", "--preset", "shakespeare-cpu", *cli_args(data=str(out), out=str(run), max_steps=1)]
    with mock.patch.object(sys, "argv", ["/venv/bin/gpt2lab", *argv]):
        assert cli.main(argv) == 0
    capsys.readouterr()
    rc = cli.main(["eval", "chat", "--model", str(run), "--max-tokens", "2", "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    captured = capsys.readouterr()
    held = str(out / HELD_OUT)
    assert f"gpt2lab eval chat: no --data: the held-out conversations of {out}, which --model {run} trained on: " in (
        captured.err
    )
    result = json.loads(captured.out.strip().splitlines()[-1])
    val = manifest["splits"]["val"]
    assert result["data"] == held and result["conversations"] == val["documents"]
    assert result["assistant_tokens"] == val["supervised"]  # the val shards' supervised tokens, all of them


def test_a_rerun_after_the_source_changed_writes_the_new_sources_conversations(tmp_path):
    """The source changed under a finished directory (its first conversation dropped): the rerun
    prepares it again, and its held-out conversations are those of a fresh prepare of the new source."""
    import zstandard

    src = tmp_path / "chats.jsonl.zst"
    src.write_bytes(open(CHAT_SLICE, "rb").read())
    kw = dict(progress=False, shard_tokens=20_000, val_tokens=2000)
    prepare(str(src), str(tmp_path / "shards"), **kw)
    (tmp_path / "shards" / HELD_OUT).unlink()
    lines = zstandard.ZstdDecompressor().stream_reader(open(CHAT_SLICE, "rb")).read().splitlines(keepends=True)
    src.write_bytes(zstandard.compress(b"".join(lines[1:])))  # not what the shards were made from
    with pytest.warns(UserWarning, match=f"{src} changed since it was prepared"):
        prepare(str(src), str(tmp_path / "shards"), **kw)
    prepare(str(src), str(tmp_path / "fresh"), **kw)
    for name in (HELD_OUT, "manifest.json", "val_000000.bin"):
        assert (tmp_path / "shards" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    first = json.loads((tmp_path / "fresh" / HELD_OUT).read_text().splitlines()[0])
    assert first["messages"][0]["content"] == json.loads(lines[1])["messages"][0]["content"]


def test_the_docs_count_of_chitchats_held_out_conversations_is_what_prepare_holds_out(tmp_path):
    """`prepare --source chitchat` holds out as many conversations as README and the docs say it does
    (the figure `eval chat --data data/chitchat` scores, not the 306 outside the bundled set)."""
    out = tmp_path / "chitchat"
    prepare("chitchat", str(out), progress=False)
    n = len(read_conversations(str(out / HELD_OUT)))
    manifest = json.loads((out / "manifest.json").read_text())
    assert n == sum(s["documents"] for s in manifest["shards"] if s["split"] == "val") > 0
    docs = {p: (ROOT / p).read_text() for p in ("README.md", "docs/evaluation.md", "docs/fine-tuning.md")}
    assert f"holds out {n} of the bundled ones" in " ".join(docs["README.md"].split())
    assert f"held-out {n} are what `eval chat --data data/chitchat` scores" in " ".join(
        docs["docs/evaluation.md"].split()
    )
    assert f"(not its held-out {n})" in docs["docs/fine-tuning.md"]

"""Shard format (llm.c header, .npy) and every bad-input error of the loader."""

import json

import numpy as np
import pytest
import torch

from gpt2lab.data import ShardError, TokenLoader
from gpt2lab.data.shards import HEADER_BYTES, MANIFEST_FORMAT, MANIFEST_VERSION, open_mask, open_shard, write_shard
from gpt2lab.data.tokenizer import EOT_ID


def _tokens(n=200, seed=0):
    toks = np.random.default_rng(seed).integers(0, 50000, n).astype(np.uint16)
    toks[::17] = EOT_ID
    return toks


def test_bin_layout_is_llm_c(tmp_path):
    toks = _tokens()
    write_shard(tmp_path / "train_000000.bin", toks)
    raw = (tmp_path / "train_000000.bin").read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert list(header[:3]) == [20240520, 1, 200] and not header[3:].any()
    assert np.array_equal(np.frombuffer(raw[1024:], dtype="<u2"), toks)
    assert np.array_equal(open_shard(tmp_path / "train_000000.bin"), toks)
    assert not list(tmp_path.glob("*.tmp"))


def test_npy_shards_give_the_same_batches_as_bin(tmp_path):
    toks = _tokens(600)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_shard(tmp_path / "a" / "train_000000.bin", toks[:300])
    write_shard(tmp_path / "a" / "train_000001.bin", toks[300:])
    np.save(tmp_path / "b" / "edufineweb_train_000000.npy", toks[:300])  # build-nanogpt names
    np.save(tmp_path / "b" / "edufineweb_train_000001.npy", toks[300:])
    np.save(tmp_path / "b" / "edufineweb_val_000000.npy", toks[:50])
    la, lb = (TokenLoader(tmp_path / d, "train", 2, 32, seed=4) for d in "ab")
    for _ in range(12):
        (xa, ya), (xb, yb) = la.next_batch(), lb.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def _bad(path, match):
    with pytest.raises(ShardError, match=match) as err:
        TokenLoader(path.parent if path.is_file() else path, "train", 2, 8).next_batch()
    return str(err.value)


def test_missing_empty_and_wrong_split(tmp_path):
    assert "no such data directory" in _bad(tmp_path / "nope", "nope")
    assert "no .bin or .npy" in _bad(tmp_path, "gpt2lab prepare")
    write_shard(tmp_path / "val_000000.bin", _tokens())
    assert "no shards for split 'train'" in _bad(tmp_path, "val_000000.bin")


def test_truncated_shard(tmp_path):
    path = tmp_path / "train_000000.bin"
    write_shard(path, _tokens())
    path.write_bytes(path.read_bytes()[: HEADER_BYTES + 300])
    msg = _bad(path, "truncated")
    assert str(path) in msg and "header says 200 tokens but the file holds 150" in msg


def test_wrong_magic_and_version(tmp_path):
    path = tmp_path / "train_000000.bin"
    write_shard(path, _tokens())
    raw = bytearray(path.read_bytes())
    raw[4:8] = np.int32(2).tobytes()
    path.write_bytes(bytes(raw))
    assert str(path) in _bad(path, "version 2 is not supported")
    raw[0:4] = np.int32(1234).tobytes()
    path.write_bytes(bytes(raw))
    assert str(path) in _bad(path, "magic 1234")


def test_a_loss_mask_is_read_checked_against_its_shard(tmp_path):
    shard, mask = tmp_path / "train_000000.bin", tmp_path / "train_000000.mask"
    with pytest.raises(ShardError, match="train_000000.mask: missing"):
        open_mask(shard, 200)
    bits = (_tokens() % 2).astype(np.uint8)
    write_shard(mask, bits)
    assert list(np.frombuffer(mask.read_bytes()[:12], dtype="<i4")) == [20241125, 1, 200]
    assert np.array_equal(open_mask(shard, 200), bits)
    with pytest.raises(ShardError, match="holds 200 of 201 tokens' mask"):
        open_mask(shard, 201)
    mask.rename(shard)  # a mask where a token shard belongs
    with pytest.raises(ShardError, match="holds uint8 values"):
        open_shard(shard)


def test_token_id_out_of_vocab(tmp_path):
    toks = _tokens()
    toks[123] = 50257
    path = tmp_path / "train_000000.bin"
    write_shard(path, toks)
    msg = _bad(path, "position 123")
    assert str(path) in msg and "50257" in msg


def test_unfinished_prepare_is_refused(tmp_path):
    write_shard(tmp_path / "train_000000.bin", _tokens())
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "complete": False, "source": "x"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    _bad(tmp_path, "has not finished")


def test_too_short_for_one_sequence(tmp_path):
    write_shard(tmp_path / "train_000000.bin", _tokens(8))
    _bad(tmp_path, "smaller seq_len")


@pytest.mark.parametrize("form", ["~/texts/*.txt", "~/texts", "~/texts/a.txt"])
def test_a_source_under_home_written_with_tilde_is_found(tmp_path, monkeypatch, form):
    """A quoted glob or --source=~/... reaches prepare with its ~ unexpanded: it is the home the shell
    would have put there."""
    from gpt2lab.data.sources import as_text, resolve_source

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("To be, or not to be.")
    src = resolve_source(form)
    assert src.files == [str(tmp_path / "texts" / "a.txt")]
    assert [as_text(d) for d in src.documents(0, None)] == ["To be, or not to be."]

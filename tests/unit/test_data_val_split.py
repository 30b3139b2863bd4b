"""The default val split of ``gpt2lab prepare``: half a percent of a local source, but enough for one
evaluation batch of the small presets; a single .txt is one document of each split."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpt2lab.data import TokenLoader
from gpt2lab.data.prepare import default_val_tokens
from gpt2lab.data.shards import open_shard
from gpt2lab.train.settings import load_preset


def test_a_small_txt_gets_a_val_split_for_the_small_presets_and_counts_as_a_document_of_each(small_text):
    m = json.loads(Path(small_text, "manifest.json").read_text())
    tokens = m["tokens"]
    assert m["splits"]["val"]["tokens"] == min(8192, -(-200_000 // 4) // 10)  # a tenth of the estimated 50,000
    assert m["documents"] == 1 and m["files"][0]["documents"] == 1
    assert m["splits"]["val"]["documents"] == m["splits"]["train"]["documents"] == 1  # the text runs on into train
    train = open_shard(Path(small_text, m["splits"]["train"]["shards"][0]))
    assert train[0] != 50256 and m["splits"]["val"]["tokens"] + len(train) == tokens
    for preset in ("shakespeare-cpu", "shakespeare-cpu-fast", "wiki-cpu", "wiki-cpu-fast"):
        cfg = load_preset(preset)
        val = TokenLoader(small_text, "val", cfg.batch.micro_batch_size, cfg.batch.seq_len)
        assert val.sequences_per_epoch >= cfg.batch.micro_batch_size, preset  # one evaluation batch at least


@pytest.mark.parametrize("size, val", [(200_000, 5000), (1_000_000, 8192), (100_000_000, 125_000)])
def test_the_default_val_split_is_half_a_percent_but_enough_to_evaluate(size, val):
    # estimated tokens size / 4: a tenth of 50,000; 8,192 (0.5% would be 1,250); 0.5% of 25,000,000
    assert default_val_tokens(SimpleNamespace(size_bytes=size, val_fraction=0.005), 10**8) == val


# -- a val split sized in text: the same held-out documents whatever the tokenizer ----------------------
@pytest.fixture(scope="module")
def code(tmp_path_factory) -> tuple[Path, str]:
    """A directory of Python files (gpt2lab's own data package, copied) and a small BPE trained on them."""
    import shutil

    import gpt2lab.data
    from gpt2lab.data.bpe import train_tokenizer

    root = tmp_path_factory.mktemp("code")
    for f in sorted(Path(gpt2lab.data.__file__).parent.glob("*.py"))[:8]:
        shutil.copy(f, root / f.name)
    tok = str(root.parent / "tok")
    train_tokenizer([str(root / "*.py")], 400, tok, progress=False)
    return root, tok


def _val_documents(data: str) -> tuple[list[bytes], int]:
    """The val split's documents decoded (cut at <|endoftext|>), and the bytes its targets decode to
    (what bits per byte divides by: every val token but the first, special tokens 0 bytes)."""
    import numpy as np

    from gpt2lab.data.tokenizer import byte_lengths, for_data

    tok = for_data(data)
    m = json.loads(Path(data, "manifest.json").read_text())
    ids = np.concatenate([open_shard(Path(data, n)) for n in m["splits"]["val"]["shards"]]).astype(np.int64)
    assert ids[0] == tok.eot_id
    cuts = [i for i, t in enumerate(ids) if t == tok.eot_id] + [len(ids)]
    docs = [b"".join(tok.decode_single_token_bytes(int(t)) for t in ids[a + 1 : b]) for a, b in zip(cuts, cuts[1:])]
    return docs, int(byte_lengths(tok)[ids[1:]].sum())


@pytest.mark.parametrize("size", [{"val_docs": 3}, {"val_bytes": 20_000}], ids=["docs", "bytes"])
def test_two_tokenizers_hold_the_same_val_text_and_bytes(code, tmp_path, size):
    from gpt2lab.data.prepare import prepare

    root, tok = code
    files = sorted(root.glob("*.py"))
    texts = [f.read_bytes() for f in files]
    n = size.get("val_docs") or next(i for i in range(1, len(texts) + 1) if sum(map(len, texts[:i])) >= 20_000)
    got = {}
    for name, t in (("gpt2", None), ("own", tok)):
        out = str(tmp_path / name)
        prepare(str(root / "*.py"), out, tokenizer=t, shard_tokens=3000, workers=1, progress=False, **size)
        got[name] = _val_documents(out)
        m = json.loads(Path(out, "manifest.json").read_text())
        assert m["settings"]["val_split"] == "documents" and m["splits"]["val"]["documents"] == n
        assert m["splits"]["train"]["documents"] == len(files) - n  # no document in both
    (docs_a, bytes_a), (docs_b, bytes_b) = got["gpt2"], got["own"]
    assert docs_a == docs_b == texts[:n]  # the files themselves, read independently of prepare
    assert bytes_a == bytes_b == sum(map(len, texts[:n]))


def test_a_val_split_in_tokens_holds_other_text_per_tokenizer(code, tmp_path):
    """What --val-docs/--val-bytes fix: the same --val-tokens is other text with another tokenizer (and a warning)."""
    from gpt2lab.data.prepare import prepare

    root, tok = code
    prepare(str(root / "*.py"), str(tmp_path / "gpt2"), val_tokens=5000, workers=1, progress=False)
    with pytest.warns(UserWarning, match="sized in this tokenizer's tokens.*--val-docs N or --val-bytes B"):
        prepare(str(root / "*.py"), str(tmp_path / "own"), val_tokens=5000, tokenizer=tok, workers=1, progress=False)
    assert _val_documents(str(tmp_path / "gpt2"))[1] != _val_documents(str(tmp_path / "own"))[1]


def test_val_docs_resumes_byte_identically_and_refuses_mixed_sizes(code, tmp_path, monkeypatch):
    import gpt2lab.data.manifest as writer
    from gpt2lab.data.prepare import prepare
    from gpt2lab.data.shards import ShardError
    from gpt2lab.system.errors import UsageError

    root, tok = code
    kw = dict(tokenizer=tok, shard_tokens=2000, val_docs=4, workers=1, progress=False)
    prepare(str(root / "*.py"), str(tmp_path / "ref"), **kw)
    real, calls = writer.write_shard, []

    def crash_on_third(path, tokens):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(path)
        real(path, tokens)

    monkeypatch.setattr(writer, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(root / "*.py"), str(tmp_path / "out"), **kw)
    monkeypatch.setattr(writer, "write_shard", real)
    prepare(str(root / "*.py"), str(tmp_path / "out"), **kw)
    ref = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert ref == sorted(p.name for p in (tmp_path / "out").iterdir())
    assert all((tmp_path / "ref" / n).read_bytes() == (tmp_path / "out" / n).read_bytes() for n in ref)
    with pytest.raises(ShardError, match="prepared with --val-docs 4, not --val-docs 5"):
        prepare(str(root / "*.py"), str(tmp_path / "out"), **{**kw, "val_docs": 5})
    with pytest.raises(UsageError, match="--val-tokens and --val-docs: give one size"):
        prepare(str(root / "*.py"), str(tmp_path / "x"), val_tokens=10, val_docs=1, progress=False)
    with pytest.raises(UsageError, match="--val-bytes with --val-split tokens"):
        prepare(str(root / "*.py"), str(tmp_path / "x"), val_bytes=10, val_split="tokens", progress=False)


def test_cli_val_docs_and_its_refusals(code, tmp_path, capsys):
    from gpt2lab import cli

    root, _ = code
    args = ["prepare", "--source", str(root / "*.py"), "--out", str(tmp_path / "d"), "--quiet", "--workers", "1"]
    assert cli.main([*args, "--val-docs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["splits"]["val"]["documents"] == 2 and out["documents"] == len(list(root.glob("*.py")))
    for extra, msg in (
        (["--val-docs", "2", "--val-split", "tokens"], "--val-docs with --val-split tokens"),
        (["--val-bytes", "9", "--val-tokens", "9"], "--val-tokens and --val-bytes: give one size"),
        (["--val-tokens", "-1"], "--val-tokens -1: must be 0 or more"),  # the flag given, no other
        (["--val-bytes", "-3"], "--val-bytes -3: must be 0 or more"),
        (["--limit-docs", "-2"], "--limit-docs -2: must be 0 or more"),
    ):
        assert cli.main([*args[:4], str(tmp_path / "x"), *args[5:], *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err and "val_docs" not in err and not (tmp_path / "x").exists()


def test_a_val_split_that_takes_everything_is_said_on_every_run_and_by_train(code, tmp_path, capsys):
    """--val-docs past the source's documents: all of it is val. prepare says so each time it runs
    (a warning line, exit 0), and train on it names the split and the flag, exit 2, one line."""
    from gpt2lab import cli

    root, _ = code
    out = tmp_path / "all"
    args = ["prepare", "--source", str(root / "*.py"), "--out", str(out), "--quiet", "--workers", "1"]
    for _ in range(2):  # the rerun only checks the finished directory, and says it again
        with pytest.warns(UserWarning) as said:
            assert cli.main([*args, "--val-docs", "100000"]) == 0
        tokens, docs = json.loads(capsys.readouterr().out)["tokens"], len(list(root.glob("*.py")))
        assert [str(w.message) for w in said] == [
            f"{out}: all {tokens} tokens ({docs} documents) went to val (--val-docs 100000); pass a smaller one "
            "to get a train split"
        ]
    assert tokens == sum(len(open_shard(p)) for p in out.glob("val_*.bin")) and not list(out.glob("train_*"))
    train = ["train", "--preset", "shakespeare-cpu", "--data", str(out), "--out", str(tmp_path / "run")]
    assert cli.main([*train, "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        f"gpt2lab train: --data {out}: no train split: prepared with --val-docs 100000, all its {tokens:,} "
        "tokens are in val; prepare it again with another size\n"
    )

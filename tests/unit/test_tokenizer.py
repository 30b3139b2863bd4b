"""The offline GPT-2 BPE: reference ids, <|endoftext|>, checksums, and agreement with HF's tokenizer."""

from __future__ import annotations

import shutil

import pytest

from gpt2lab import get_tokenizer
from gpt2lab.data import tokenizer
from gpt2lab.model.config import GPTConfig


def test_reference_ids_and_eot():
    enc = get_tokenizer()
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [tokenizer.EOT_ID] == [50256]
    assert enc.eot_token == 50256
    assert enc.n_vocab == 50257
    # the chat variant: the two turn tokens after GPT-2's, as many as a chat model's config counts
    chat = tokenizer.gpt2_tokenizer(chat=True)
    assert (chat.im_start_id, chat.im_end_id, chat.n_vocab) == (50257, 50258, 50259)
    assert chat.n_vocab == GPTConfig(chat_template="chatml").template_vocab


def test_roundtrip_unicode_and_whitespace():
    enc = get_tokenizer()
    text = "naïve café 日本語 🙂\n\n  tabs\tand  spaces  "
    assert enc.decode(enc.encode(text)) == text


def test_matches_transformers_tokenizer_on_real_text(tmp_path):
    """HF's own GPT-2 tokenizer, built from the same shipped files, gives the same ids."""
    import transformers

    shutil.copyfile(tokenizer.asset_path("encoder.json"), tmp_path / "vocab.json")
    shutil.copyfile(tokenizer.asset_path("vocab.bpe"), tmp_path / "merges.txt")
    hf = transformers.GPT2Tokenizer.from_pretrained(str(tmp_path))
    with open(tokenizer.asset_path("tinyshakespeare.txt"), encoding="utf-8") as f:
        text = f.read()[:20000] + " Ünïcödé — “quotes” 1234567 it's we'll I've\n"
    ids = hf(text)["input_ids"]
    assert len(ids) > 5000
    assert get_tokenizer().encode(text) == ids


def test_damaged_asset_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "vocab.bpe"
    bad.write_bytes(open(tokenizer.asset_path("vocab.bpe"), "rb").read()[:-10])
    monkeypatch.setattr(tokenizer, "asset_path", lambda name: str(tmp_path / name))
    with pytest.raises(RuntimeError, match="sha256.*reinstall"):
        tokenizer._checked("vocab.bpe")

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

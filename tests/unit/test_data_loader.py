"""TokenLoader: coverage across ranks, shuffling per epoch, exact resume, world-size invariance, val.

The shards hold synthetic documents whose tokens are unique and count up inside each
document, so every check can name exactly which tokens a batch holds.
"""

import json

import numpy as np
import pytest
import torch

from gpt2lab.data import TokenLoader
from gpt2lab.data.shards import write_shard
from gpt2lab.data.tokenizer import EOT_ID

T, B = 16, 4


def _make_shards(root, split, n_shards=3, seqs_per_shard=8, seed=0):
    """Shards of exactly seqs*T + 1 tokens (no waste), documents EOT-first, unique ids."""
    rng = np.random.default_rng(seed)
    next_id = 1 if split == "train" else 30000
    streams = []
    for k in range(n_shards):
        n = seqs_per_shard * T + 1
        toks = []
        while len(toks) < n:
            length = int(rng.integers(3, 2 * T))
            toks += [EOT_ID] + list(range(next_id, next_id + length))
            next_id += length
        toks = np.array(toks[:n], dtype=np.uint16)
        write_shard(root / f"{split}_{k:06d}.bin", toks)
        streams.append(toks)
    return streams


@pytest.fixture
def data(tmp_path):
    train = _make_shards(tmp_path, "train")
    val = _make_shards(tmp_path, "val", n_shards=2, seqs_per_shard=4, seed=1)
    return tmp_path, train, val


def _batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def _targets(batches):
    return np.concatenate([y.numpy().ravel() for _, y in batches])


def test_batches_are_shifted_int64_and_documents_stay_whole(data):
    root, _, _ = data
    loader = TokenLoader(root, "train", B, T)
    for x, y in _batches(loader, 6):
        assert x.dtype == torch.int64 and x.shape == (B, T) and y.shape == (B, T)
        assert torch.equal(x[:, 1:], y[:, :-1])
        # inside a document ids count up; a step may only jump at a document start
        ok = (y == x + 1) | (y == EOT_ID) | (x == EOT_ID)
        assert bool(ok.all())


def test_two_ranks_disjoint_and_cover_the_epoch(data):
    root, train, _ = data
    ranks = [TokenLoader(root, "train", B, T, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].sequences_per_epoch == 24  # 3 steps of B=4 on each of 2 ranks
    seen = [_targets(_batches(ld, 3)) for ld in ranks]
    ids = [s[s != EOT_ID] for s in seen]
    assert len(np.intersect1d(ids[0], ids[1])) == 0
    both = np.concatenate(ids)
    expected = np.concatenate([s[1:] for s in train])  # every token but each shard's first is a target
    expected = expected[expected != EOT_ID]
    assert len(both) == len(np.unique(both)) == len(expected)
    assert np.array_equal(np.sort(both), np.sort(expected))


def _doc_order(targets):
    """Document ids (their first token) in the order the loader produced them."""
    firsts = targets[1:][targets[:-1] == EOT_ID]
    return [int(v) for v in firsts]


def test_epoch_two_has_a_new_document_order_and_same_tokens(data):
    root, _, _ = data
    loader = TokenLoader(root, "train", B, T)
    n = loader.sequences_per_epoch // B
    e1, e2 = _targets(_batches(loader, n)), _targets(_batches(loader, n))
    assert loader.position == 2 * loader.sequences_per_epoch
    assert np.array_equal(np.sort(e1), np.sort(e2))
    d1, d2 = _doc_order(e1), _doc_order(e2)
    assert d1 != d2
    pairs1, pairs2 = set(zip(d1, d1[1:])), set(zip(d2, d2[1:]))
    assert len(pairs1 & pairs2) < len(pairs1) // 4  # documents are glued to new neighbours


def test_seed_changes_order_and_same_seed_repeats_it(data):
    root, _, _ = data
    a, b, c = (TokenLoader(root, "train", B, T, seed=s) for s in (0, 0, 1))
    ta, tb, tc = (_targets(_batches(ld, 4)) for ld in (a, b, c))
    assert np.array_equal(ta, tb) and not np.array_equal(ta, tc)


def test_world_size_invariance_across_epochs(data):
    root, _, _ = data
    single = TokenLoader(root, "train", B, T, seed=3)
    pair = [TokenLoader(root, "train", B, T, rank=r, world_size=2, seed=3) for r in range(2)]
    for _ in range(8):  # 8 steps of 2 ranks = 64 sequences, past the 24-sequence epochs
        for r in range(2):
            xs, ys = single.next_batch()
            xr, yr = pair[r].next_batch()
            assert torch.equal(xs, xr) and torch.equal(ys, yr)


def test_state_dict_resume_equals_uninterrupted(data, tmp_path):
    root, _, _ = data
    ref = TokenLoader(root, "train", B, T, seed=7)
    expected = _batches(ref, 12)
    first = TokenLoader(root, "train", B, T, seed=7)
    _batches(first, 5)
    state = first.state_dict()
    torch.save({"loader": state}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    state = json.loads(json.dumps(state))  # plain python: JSON round trip too
    resumed = TokenLoader(root, "train", B, T, seed=7)
    resumed.load_state_dict(state)
    for (xe, ye), (xr, yr) in zip(expected[5:], _batches(resumed, 7)):  # crosses epoch 1 -> 2
        assert torch.equal(xe, xr) and torch.equal(ye, yr)


def test_resume_on_another_world_size(data):
    root, _, _ = data
    ref = TokenLoader(root, "train", B, T)
    expected = _batches(ref, 10)
    first = TokenLoader(root, "train", B, T)
    _batches(first, 4)
    pair = [TokenLoader(root, "train", B, T, rank=r, world_size=2) for r in range(2)]
    for ld in pair:
        ld.load_state_dict(first.state_dict())
    got = [pair[i % 2].next_batch() for i in range(6)]
    assert all(torch.equal(e[0], g[0]) for e, g in zip(expected[4:], got))


def test_state_from_other_data_is_refused(data):
    root, _, _ = data
    state = TokenLoader(root, "train", B, T, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        TokenLoader(root, "train", B, T, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        TokenLoader(root, "train", B, T // 2, seed=1).load_state_dict(state)


def test_val_reads_in_order_same_every_time_for_any_world_size(data):
    root, _, val = data
    loader = TokenLoader(root, "val", 2, T)
    assert loader.shuffle is False and TokenLoader(root, "train", 2, T).shuffle is True
    first = _batches(loader, 4)
    # in order: row i is tokens [i*T, i*T+T+1) of the shards read one after the other
    rows = [s[i * T : i * T + T + 1] for s in val for i in range((len(s) - 1) // T)]
    for k, (x, y) in enumerate(first):
        for j in range(2):
            row = rows[2 * k + j].astype(np.int64)
            assert np.array_equal(x[j].numpy(), row[:-1]) and np.array_equal(y[j].numpy(), row[1:])
    again = _batches(TokenLoader(root, "val", 2, T), 4)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    pair = [TokenLoader(root, "val", 2, T, rank=r, world_size=2) for r in range(2)]
    got = [pair[i % 2].next_batch() for i in range(4)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, got))


def test_shard_ends_waste_less_than_one_sequence(tmp_path):
    # shards of 50 and 21 tokens, T=16: 3 + 1 sequences; batches cross the shard boundary
    toks = np.arange(1, 72, dtype=np.uint16)
    write_shard(tmp_path / "val_000000.bin", toks[:50])
    write_shard(tmp_path / "val_000001.bin", toks[50:])
    loader = TokenLoader(tmp_path, "val", 2, T)
    assert loader.sequences_per_epoch == 4 and loader.T == T
    (x0, _), (x1, _) = _batches(loader, 2)
    assert x1[1, 0].item() == 51 and x1[0, 0].item() == 33

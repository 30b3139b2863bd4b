"""TokenLoader: (x, y) batches for rank r of w, shuffled per epoch, resumable exactly.

The index math, in one place. Each epoch is a sequence stream: shards in an order (a
seeded permutation per epoch when shuffling, name order otherwise), and inside each
shard its documents (split at ``<|endoftext|>``) in an order (again a seeded permutation
per epoch when shuffling). Sequence ``s`` of a shard is tokens ``[s*T, s*T + T + 1)`` of
that shard's ordered stream, so a shard of N tokens gives ``(N - 1) // T`` sequences and
wastes fewer than T tokens; sequences never cross shards but batches may. Epochs follow
each other without a gap, so the whole run is one infinite stream of sequences indexed
by a global counter ``position``.

Every call to ``next_batch`` on every rank takes the same step: rank r reads sequences
``position + r*B ... position + r*B + B - 1`` and all ranks advance ``position`` by
``w*B``. So the ranks are disjoint, together cover every sequence of an epoch, and the
batches of ranks 0..w-1 at one step are the batches one rank reads over w micro-steps.
``position`` is the whole state: a checkpoint may even resume on another world size.

A shorter length L (``next_batch(seq_len=L)``, L dividing T: the trainer's sequence-length ramp) reads
the same B sequences and cuts each into T/L rows of L: row j of a sequence is its inputs
``[j*L, (j+1)*L)`` and their targets, one token on. The batch holds the same tokens and targets, and
``position`` moves as it always does, so a run resumed in the middle of the ramp reads what it would have.

Conversations (shards ``prepare`` wrote with a loss mask, data/chat.py) come in the same
sequences, packed end to end as text is; each target whose mask is 0 (the template, the system
and user turns) is -1, which the loss ignores, so the loss is the mean over the assistant's tokens.
"""

from __future__ import annotations

import functools
import reprlib
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from gpt2lab.data.shards import PathLike, ShardError, check_vocab, list_shards, open_mask, open_shard, read_manifest
from gpt2lab.data.tokenizer import EOT_ID
from gpt2lab.model.config import GPT2_VOCAB_SIZE

STATE_VERSION = 1


class SplitTooSmall(ShardError):
    """A split without one whole sequence (``tokens`` is what it holds)."""

    def __init__(self, message: str, tokens: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens


class _ShardView:
    """One shard's tokens with its documents in one epoch's order."""

    def __init__(self, tokens: np.ndarray, rng: Optional[np.random.Generator], mask: Optional[np.ndarray], eot_id: int):
        self.tokens, self.mask = tokens, mask
        # stored order (no ``rng``): one "document" covering the shard
        starts = np.flatnonzero(tokens == eot_id).astype(np.int64) if rng is not None else np.zeros(1, dtype=np.int64)
        if len(starts) == 0 or starts[0] != 0:
            # a shard that begins mid-document (build-nanogpt shards do): the head is a document too
            starts = np.concatenate([[0], starts])
        lengths = np.diff(np.append(starts, len(tokens)))
        perm = np.arange(len(starts)) if rng is None else rng.permutation(len(starts))
        self.starts = starts[perm]
        self.cum = np.concatenate([[0], np.cumsum(lengths[perm])])

    def sequence(self, s: int, seq_len: int) -> np.ndarray:
        """Tokens ``[s*T, s*T + T + 1)`` of the ordered stream, as int64; with a mask, a second row:
        the mask of those tokens (the loader turns masked targets into -1)."""
        p0, p1 = s * seq_len, s * seq_len + seq_len + 1
        d0 = int(np.searchsorted(self.cum, p0, side="right")) - 1
        d1 = int(np.searchsorted(self.cum, p1 - 1, side="right")) - 1
        spans = []
        for d in range(d0, d1 + 1):  # document d's part, from its place in the stream to its place in the shard
            shift = int(self.starts[d]) - int(self.cum[d])
            spans.append((max(p0, int(self.cum[d])) + shift, min(p1, int(self.cum[d + 1])) + shift))
        tokens = np.concatenate([self.tokens[a:b] for a, b in spans]).astype(np.int64)
        if self.mask is None:
            return tokens
        return np.stack([tokens, np.concatenate([self.mask[a:b] for a, b in spans]).astype(np.int64)])


class TokenLoader:
    """Batches ``(x, y)`` of int64 CPU tensors (B, T) from a directory of token shards.

    ``shuffle=None`` means on for ``train`` and off for every other split. Val (no
    shuffle) reads in order: the first N sequences are the same for any world size.
    """

    def __init__(
        self,
        data_dir: PathLike,
        split: str,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: Optional[bool] = None,
        seed: int = 0,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size {batch_size} and seq_len {seq_len} must both be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        if seed < 0:
            raise ValueError(f"seed {seed} must be >= 0")
        self.data_dir, self.split = Path(data_dir), split
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.shuffle = (split == "train") if shuffle is None else bool(shuffle)
        manifest = read_manifest(self.data_dir)  # an unfinished prepare is refused there
        self.masked = "chat_template" in manifest  # conversations: shards with masks
        # the bound every token is checked against: the vocabulary of the tokenizer the manifest names
        self.seed, self.vocab_size = seed, int(manifest.get("vocab_size", GPT2_VOCAB_SIZE))
        self.eot_id = int(manifest.get("eot_id", EOT_ID))  # where documents start (the tokenizer's)
        self.paths = list_shards(self.data_dir, split)
        self.counts = [len(open_shard(p)) for p in self.paths]
        self.seqs = np.array([max(0, (n - 1) // seq_len) for n in self.counts], dtype=np.int64)
        if self.seqs.sum() == 0:
            raise SplitTooSmall(
                f"{self.data_dir}: split '{split}' has {sum(self.counts)} tokens, "
                f"too few for one sequence of seq_len {seq_len} + 1 in any shard; "
                "use a smaller seq_len or prepare more data",
                sum(self.counts),
            )
        self.position = 0
        # the last epoch's shard order, and the last two shards' views: a batch touches at most a few shards
        self._layout = functools.lru_cache(maxsize=1)(self._epoch_layout)
        self._view = functools.lru_cache(maxsize=2)(self._shard_view)
        self._vocab_checked: set = set()

    # -- sizes -------------------------------------------------------------------------
    @property
    def sequences_per_epoch(self) -> int:
        return int(self.seqs.sum())

    # -- batches -----------------------------------------------------------------------
    def next_batch(self, seq_len: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y), each (B, T); with ``seq_len`` L (dividing T), the same tokens as (B*T/L, L)."""
        seq_len = self.T if seq_len is None else seq_len
        if seq_len < 1 or self.T % seq_len:
            raise ValueError(f"seq_len {seq_len} must divide the loader's sequence length {self.T}")
        first = self.position + self.rank * self.B
        rows = np.stack([self._sequence(first + i) for i in range(self.B)])  # (B, T+1), masked: (B, 2, T+1)
        self.position += self.B * self.world_size
        if self.masked:  # targets the loss skips: -1
            tokens, mask = rows[:, 0], rows[:, 1]
            x = torch.from_numpy(np.ascontiguousarray(tokens[:, :-1]))
            y = torch.from_numpy(np.where(mask[:, 1:] == 1, tokens[:, 1:], -1))
        else:
            buf = torch.from_numpy(rows)
            x, y = buf[:, :-1].contiguous(), buf[:, 1:].contiguous()
        return x.view(-1, seq_len), y.view(-1, seq_len)

    def _sequence(self, g: int) -> np.ndarray:
        epoch, i = divmod(g, self.sequences_per_epoch)
        order, cum = self._layout(epoch)
        k = int(np.searchsorted(cum, i, side="right")) - 1
        return self._view(epoch, int(order[k])).sequence(i - int(cum[k]), self.T)

    def _epoch_layout(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """Shard order of ``epoch`` and the first sequence index of each shard in it."""
        n = len(self.paths)
        order = self._rng(epoch, 0).permutation(n) if self.shuffle else np.arange(n)
        return order, np.concatenate([[0], np.cumsum(self.seqs[order])])

    def _shard_view(self, epoch: int, shard: int) -> _ShardView:
        tokens = open_shard(self.paths[shard])
        if shard not in self._vocab_checked:
            check_vocab(self.paths[shard], tokens, self.vocab_size)
            self._vocab_checked.add(shard)
        rng = self._rng(epoch, 1 + shard) if self.shuffle else None
        mask = open_mask(self.paths[shard], len(tokens)) if self.masked else None
        return _ShardView(tokens, rng, mask, self.eot_id)

    def _rng(self, epoch: int, stream: int) -> np.random.Generator:
        # independent of everything but (seed, epoch, stream): the state is just `position`
        return np.random.default_rng([self.seed, epoch, stream])

    # -- resume ------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        """Plain python values only (JSON and ``torch.load(weights_only=True)`` safe)."""
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "seq_len": self.T,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "position": int(self.position),
            "shards": [[p.name, int(n)] for p, n in zip(self.paths, self.counts)],
        }

    def load_state_dict(self, state: Dict) -> None:
        """Continue exactly where the saved loader stopped (batch size and world size may differ)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"loader state version {state.get('version')!r} is not "
                f"{STATE_VERSION}; it was saved by another gpt2lab version"
            )
        mine = self.state_dict()
        for key in ("split", "seq_len", "shuffle", "seed", "shards"):
            saved = [list(s) for s in state[key]] if key == "shards" else state[key]
            if saved != mine[key]:
                raise ValueError(
                    f"loader state does not match this loader: {key} was "
                    f"{reprlib.repr(saved)}, now {reprlib.repr(mine[key])} (data dir "
                    f"{self.data_dir}); resume with the same data and settings"
                )
        self.position = int(state["position"])

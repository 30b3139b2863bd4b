"""The keys and values of a batch's rows, each row at its own length (serve/batch.py's cache)."""

from __future__ import annotations

from typing import Optional

import torch

from gpt2lab.model.gpt import KVCache


class RowsCache:
    """Keys and values of the rows of a batch, each row at its own length.

    Buffers are (slots, heads, positions, head size) per layer, grown on demand (positions
    doubling up to the model's block) and freed when no row is left. Between ``view(rows)``
    and the forward's ``advance``, the model sees slots 0..rows-1 through the KVCache
    interface: ``pos`` is the longest row (for the block check), ``positions`` and ``mask``
    are per row.
    """

    def __init__(self, n_layer: int, max_len: int) -> None:
        self.n_layer, self.max_len = n_layer, max_len
        self.k: list[Optional[torch.Tensor]] = [None] * n_layer
        self.v: list[Optional[torch.Tensor]] = [None] * n_layer
        self.lengths: list[int] = []  # positions filled, per slot in use
        self.rows = 0
        self.pos = 0
        self._lengths: Optional[torch.Tensor] = None  # lengths of the viewed rows, on the device

    def reserve(self, slots: int, positions: int, heads: int, head_size: int) -> None:
        """Make the buffers hold at least ``slots`` rows of ``positions`` each (fp32 on the CPU where none
        exist yet: the fused step's cache)."""
        self._room(slots, positions, self.k[0] if self.k[0] is not None else torch.empty(0, heads, 0, head_size))

    def _room(self, slots: int, positions: int, like: torch.Tensor) -> None:
        """Make the buffers hold at least ``slots`` rows of ``positions`` each."""
        have = self.k[0]
        if have is not None and have.shape[0] >= slots and have.shape[2] >= positions:
            return
        S = max(slots, have.shape[0] if have is not None else 0)
        L = min(self.max_len, max(positions, 2 * (have.shape[2] if have is not None else 32)))
        for bufs in (self.k, self.v):
            for layer, old in enumerate(bufs):
                new = like.new_zeros(S, like.shape[1], L, like.shape[3])
                if old is not None:
                    new[: old.shape[0], :, : old.shape[2]] = old
                bufs[layer] = new

    def put(self, slot: int, cache: KVCache, capacity: int, row: int, n: int) -> None:
        """Copy the first ``n`` positions of row ``row`` of ``cache`` into ``slot`` (the next free one), with
        room for ``capacity`` slots."""
        assert slot == len(self.lengths), "rows join at the end"
        self._room(capacity, n + 1, cache.k[0])
        for mine, theirs in ((self.k, cache.k), (self.v, cache.v)):
            for layer in range(self.n_layer):
                mine[layer][slot, :, :n] = theirs[layer][row, :, :n]
        self.lengths.append(n)

    def remove(self, slot: int) -> None:
        """Free ``slot``: the last row moves into it."""
        last = len(self.lengths) - 1
        if slot != last:
            n = self.lengths[last]
            for bufs in (self.k, self.v):
                for buf in bufs:
                    buf[slot, :, :n] = buf[last, :, :n]
            self.lengths[slot] = n
        self.lengths.pop()
        if not self.lengths:  # idle: give the memory back
            self.k, self.v = [None] * self.n_layer, [None] * self.n_layer

    def view(self, device: torch.device) -> "RowsCache":
        """Ready a forward over every row in use (one new token each)."""
        self.rows, self.pos = len(self.lengths), max(self.lengths)
        self._room(self.rows, self.pos + 1, self.k[0])
        self._lengths = torch.tensor(self.lengths, dtype=torch.long, device=device)
        return self

    # The KVCache interface the model calls (one token per row).
    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        assert T == 1, "rows decode one token per step"
        return self._lengths[:, None]  # (rows, 1)

    def mask(self, T: int, device: torch.device) -> Optional[torch.Tensor]:
        """(rows, 1, 1, longest + 1): row i sees its own positions 0..lengths[i] only (None when
        every row has the same length: then every key is its own)."""
        if min(self.lengths) == self.pos:
            return None
        keys = torch.arange(self.pos + 1, device=device)
        return (keys[None, :] <= self._lengths[:, None])[:, None, None, :]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(self.rows, device=k.device)
        self.k[layer][rows, :, self._lengths] = k[:, :, 0]  # (rows, heads, head size) at each row's position
        self.v[layer][rows, :, self._lengths] = v[:, :, 0]
        return self.k[layer][: self.rows, :, : self.pos + 1], self.v[layer][: self.rows, :, : self.pos + 1]

    def advance(self, T: int) -> None:
        self.lengths = [n + T for n in self.lengths]

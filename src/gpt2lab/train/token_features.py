"""Features of the tokens shared across the vocabulary (``--token-features``), a training-only lever.

A vocabulary of 50K tokens meets a short run's tokens rarely: after 147K Wikipedia tokens a
third of the held-out tokens have been seen ten times or fewer, and they carry most of the loss.
Many of them share a feature with tokens seen more often: their spelling (``" Paris"`` and
``"Paris"``, ``" the"`` and ``" The"``, ``" running"`` and ``" jumping"`` by their ending, every
capitalised word after a space by its shape) or their place in the tokenizer's merge order (a
BPE tokenizer numbers its tokens in the order it merged them, most frequent first, so tokens of
nearby ids were about as frequent in its training text). Here each such feature gets a learned
vector of its own per table, and a token's row in the token embedding and in the untied head
moves, besides its own update, by the updates of its features' vectors: what the run learns
about ``" The"`` reaches ``"The"``, and every token of the same shape or rank, at once.

It is the parametrisation W = W0 + F V (F the fixed token-by-feature matrix, V the learned
feature vectors, 0 at the start) trained with Adam, written as an optimizer: V's gradient is
F^T dW (dW the table's gradient, already clipped and all-reduced), Adam's update of V is
added to W through F, and W0 never exists apart from W. So the model stays a plain GPT, its
checkpoints, averages, evaluations and exports hold the summed rows, and only the optimizer's
state (Adam's two moments of V, one per table) is new.

The features of a token (``feature_index``), from its bytes read as UTF-8 (``token_features``):
``word`` (its text lower-cased, surrounding white space dropped), ``shape`` (a leading space or
not; lower-case, Capitalised or UPPER; letters, digits, punctuation, space or mixed; its length up
to 8), the last two and three letters of a word longer than three; and from its id, ``rank``: the
id's block when the tokenizer's ids are cut into ``RANK_BLOCKS`` equal blocks. A feature shared by
fewer than two tokens is left out (it would only repeat the token's own row). A token's row moves
by the sum of its features' updates (each weighing 1: measured against 1/sqrt(k) and 1/k for k
features, and against sqrt(k) and k^(1/4), docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import unicodedata
from collections import Counter
from typing import Optional

import torch
import torch.nn.functional as F

from gpt2lab.system.errors import ConfigError

# The merge-order blocks: a fixed count, so any vocabulary gets the same resolution (GPT-2's 50,257
# ids: blocks of 1,006; a 4,096-token tokenizer's: of 82). 50 blocks and blocks of 1,024 ids gave the
# same losses to 0.003 (docs/benchmarks.md, "Token features").
RANK_BLOCKS = 50


def token_features(text: str) -> list[str]:
    """The spelling features of one token's text (see the module docstring)."""
    core = text.strip()
    low = core.lower()
    space = int(text[:1] == " ")
    if core.isalpha():
        case = "U" if core.isupper() and len(core) > 1 else "C" if core[:1].isupper() else "l"
        kind = "a"
    elif core.isdigit():
        case, kind = "-", "d"
    elif core and all(unicodedata.category(c).startswith("P") for c in core):
        case, kind = "-", "p"
    else:
        case, kind = "-", "w" if not core else "m"
    out = [f"shape:{space}{case}{kind}{min(len(core), 8)}"]
    if low:
        out.append("word:" + low)
    if kind == "a" and len(low) > 3:
        out += ["end3:" + low[-3:], "end2:" + low[-2:]]
    return out


def feature_index(tokenizer, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(index, weight, n_features) for a table of ``rows`` rows: row t's features are
    index[t, :] weighted by weight[t, :] (0 where a row has fewer, or none: ids past the
    tokenizer's, the padding of vocab_size). Deterministic: the same tokenizer gives the same
    index, so a resumed run rebuilds it."""
    feats: list[list[str]] = []
    n = min(rows, tokenizer.n_vocab)
    block = -(-tokenizer.n_vocab // RANK_BLOCKS)
    for t in range(n):
        try:
            text = tokenizer.decode_single_token_bytes(t).decode("utf-8", "replace")
        except (KeyError, ValueError):  # an id the tokenizer does not decode alone
            text = ""
        feats.append((token_features(text) if text else []) + [f"rank:{t // block}"])
    count = Counter(f for fs in feats for f in fs)
    names = sorted(f for f, c in count.items() if c >= 2)
    number = {f: i for i, f in enumerate(names)}
    kept = [[number[f] for f in fs if f in number] for fs in feats]
    k = max([len(ids) for ids in kept] + [1])
    index = torch.zeros(rows, k, dtype=torch.long)
    weight = torch.zeros(rows, k)
    for t, ids in enumerate(kept):
        if ids:
            index[t, : len(ids)] = torch.tensor(ids)
            weight[t, : len(ids)] = 1.0
    return index, weight, len(names)


@functools.lru_cache(maxsize=8)
def feature_count(data_dir: Optional[str], rows: int) -> int:
    """The number of features of the tokenizer of ``data_dir``'s tokens (None: GPT-2's), for a table of
    ``rows`` rows: what the run's plan counts before the optimizer exists."""
    from gpt2lab.data.tokenizer import for_data, gpt2_tokenizer

    return feature_index(for_data(data_dir) if data_dir else gpt2_tokenizer(), rows)[2]


class FeatureShare(torch.optim.Optimizer):
    """Adam on each table's feature vectors V, its update added to the table through F.

    ``groups``: one per table ({"params": [W], "lr": ..., "lr_name": ...}: the table's own
    group's rate, so the schedule scales both alike). No weight decay (the table's own
    optimizer decays W). Steps after the table's optimizer, reading the same gradient; a step
    whose gradient is not finite or that ``skip`` marks (train.optim) leaves every table and
    moment as it was, decided on the device (no host sync).

    Both products are ``embedding_bag`` sums: F^T g gathers each feature's tokens' gradient rows
    (the index transposed, each feature's tokens in order), F u each token's features' rows. Neither
    scatters: for GPT-2's 50K x 192 table on one core of a 2-core Zen 4 (the other busy), F^T g took
    13 ms this way, 42 as a sparse CSR matmul and 73 as an ``index_add_`` per feature slot."""

    def __init__(
        self,
        groups: list[dict],
        index: torch.Tensor,
        weight: torch.Tensor,
        n_features: int,
        betas: tuple[float, float],
        eps: float,
    ) -> None:
        super().__init__(groups, dict(lr=1e-3, betas=betas, eps=eps))
        self.index, self.weight, self.n_features = index, weight, n_features
        rows = torch.arange(index.size(0)).repeat_interleave(index.size(1))
        cols, vals = index.flatten(), weight.flatten()
        live = vals != 0
        rows, cols, vals = rows[live], cols[live], vals[live]
        order = torch.argsort(cols * index.size(0) + rows)  # by feature, then token
        counts = torch.bincount(cols, minlength=n_features)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
        self._transposed = (rows[order], vals[order], offsets)
        self._on: dict = {}  # device -> the index tensors there

    def _tensors(self, device: torch.device) -> tuple:
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in (self.index, self.weight, *self._transposed))
        return self._on[device]

    skips_on_device = True

    @torch.no_grad()
    def step(self, closure=None, skip=None):
        if skip is True:
            return
        work = []  # (group, table, its feature gradient): every table's first, so one test skips them all
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    index, weight, tokens, token_weight, offsets = self._tensors(p.device)
                    g = F.embedding_bag(tokens, p.grad.float(), offsets, mode="sum", per_sample_weights=token_weight)
                    work.append((group, p, g, index, weight))
        if not work:
            return
        keep = torch.isfinite(torch.stack([g.sum() for _, _, g, _, _ in work]).sum())  # an inf or nan sums to one
        if isinstance(skip, torch.Tensor):
            keep = keep & (skip.to(keep.device) == 0)
        kept = keep.float()
        for group, p, g, index, weight in work:
            beta1, beta2 = group["betas"]
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros(self.n_features, p.size(1), dtype=torch.float32, device=p.device)
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
            m, v, n = state["exp_avg"], state["exp_avg_sq"], state["step"]
            g = torch.where(keep, g, torch.zeros((), device=g.device))  # a skipped step adds nothing
            m.mul_(1 - kept * (1 - beta1)).add_(g, alpha=1 - beta1)
            v.mul_(1 - kept * (1 - beta2)).addcmul_(g, g, value=1 - beta2)
            n.add_(kept)
            t = n.clamp(min=1)
            update = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
            update = torch.div(m, update, out=update).mul_(kept * group["lr"] / (1 - beta1**t))
            p.sub_(F.embedding_bag(index, update, per_sample_weights=weight, mode="sum").to(p.dtype))


def make_feature_share(
    model: torch.nn.Module, tokenizer, optimizer, betas: tuple[float, float], eps: float
) -> FeatureShare:
    """The FeatureShare for ``model``'s tables, each at the rate of the group that holds it in
    ``optimizer`` (its parts' param groups)."""
    # the tables that share features: the token embedding and an untied head, where trained (a tied head's
    # weight appears once, as the embedding's: one table)
    named = dict(model.named_parameters())
    found = [named[n] for n in ("transformer.wte.weight", "lm_head.weight") if n in named and named[n].requires_grad]
    if not found:
        raise ConfigError(
            "--token-features: the model trains no token embedding or head (LoRA freezes them); "
            "use --token-features false"
        )
    # every trainable parameter is in one of the optimizer's groups
    homes = [next(g for g in optimizer.param_groups if any(q is p for q in g["params"])) for p in found]
    groups = [{"params": [p], "lr": h["lr"], "lr_name": h.get("lr_name", "max_lr")} for p, h in zip(found, homes)]
    index, weight, n = feature_index(tokenizer, found[0].size(0))
    return FeatureShare(groups, index, weight, n, betas, eps)

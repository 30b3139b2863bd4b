"""Validation loss: the mean next-token loss over the first N tokens of a split, all ranks together
(of conversations: over the assistant's tokens among them, data/loader.py's mask), and its bits per byte.

Bits per byte compares models whose tokenizers differ (nats per token cannot): the summed loss of the
evaluated target tokens, in bits, over the UTF-8 bytes those tokens decode to, special tokens counting
0 bytes: ``bpb = mean loss x targets / (ln 2 x bytes)``. It is counted on the very targets the loss is
taken on (a per-token byte-length table of the data's tokenizer), so conversations count the
assistant's tokens only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from gpt2lab.distributed.dist import all_reduce_sum, autocast, rank, world

# A model held for inference (inference/form.py) has no chunked loss: its loss is taken from
# whole logits. Its batches run this many logits at a time at most (the chunked loss's own bound,
# model/loss.py: 512 MB of fp32 logits), a few sequences per forward.
LOGITS_PER_FORWARD = 2**27


@dataclass(frozen=True)
class LossResult:
    loss: float  # mean loss per target token, nats
    targets: int  # target tokens the loss is the mean over, all ranks
    bytes: int  # UTF-8 bytes those targets decode to
    tokens: int  # tokens read: the whole batches of the tokens asked for, all ranks

    @property
    def bpb(self) -> Optional[float]:
        """Bits per byte (module docstring); None where the targets hold no text (special tokens only)."""
        return self.loss * self.targets / (math.log(2) * self.bytes) if self.bytes else None


def tokens_within(tokens: int, sequences: int, batch_size: int, seq_len: int, world_size: int = 1) -> int:
    """The tokens an evaluation of ``tokens`` takes from a split of ``sequences`` sequences of ``seq_len``:
    ``tokens`` where the split holds them (``evaluate`` reads them in whole batches of ``batch_size`` x
    ``world_size`` sequences), else all the whole batches the split holds (at least one: a split
    smaller than one batch is ``evaluate``'s refusal). The rule ``train`` follows for --eval-tokens.
    """
    per_step = batch_size * seq_len * world_size
    steps = max(1, tokens // per_step)
    whole = max(1, sequences // (batch_size * world_size))
    return tokens if steps <= whole else whole * per_step


def fit_to_split(
    data_dir: str, split: str, tokens: int, batch_size: int, seq_len: int, world_size: int
) -> tuple[int, Optional[str]]:
    """``tokens_within`` for ``split`` of prepared data, and the note to print where it takes all the
    split holds (``eval loss --tokens``)."""
    from gpt2lab.data import TokenLoader  # lazy: the model side never needs the data package

    sequences = TokenLoader(data_dir, split, 1, seq_len, shuffle=False).sequences_per_epoch
    fit = tokens_within(tokens, sequences, batch_size, seq_len, world_size)
    if fit >= tokens or sequences < batch_size * world_size:  # the latter: not one batch, evaluate refuses
        return fit, None
    per = f"{batch_size}" + (f" x {world_size} processes" if world_size > 1 else "")
    return fit, (
        f"note: --tokens {tokens:,} is more than the {split} split of {data_dir} holds; the evaluation takes all "
        f"it holds in whole batches: {fit:,} tokens ({fit // (batch_size * seq_len * world_size)} of {per} x {seq_len})"
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data_dir: str,
    *,
    tokens: int,
    batch_size: int,
    seq_len: int,
    device: torch.device | str,
    dtype: str = "float32",
    split: str = "val",
    flags: tuple[str, str] = ("--eval-tokens", "--micro-batch-size"),
    stop: Callable[[], bool] = bool,
) -> Optional[LossResult]:
    """Mean loss over the first ``tokens`` target tokens of ``split`` (at least one batch per rank), with
    the targets counted and their bytes (bits per byte); None when ``stop()`` (looked at before each batch;
    default: never) said to stop on any rank (each rank stops at its next batch, then all meet at the sums).

    The tokens are read in order and split over ranks, so every world size that divides
    the batches evenly sees the same tokens; the result is averaged across ranks.
    Works on a plain, compiled or DDP-wrapped GPT; restores the model's train/eval mode. Too few
    tokens is a UsageError naming ``flags`` (the caller's flags for ``tokens`` and ``batch_size``).
    """
    from gpt2lab.data import TokenLoader  # lazy: the model side never needs the data package
    from gpt2lab.data.tokenizer import byte_lengths, for_data

    device = torch.device(device)
    loader = TokenLoader(data_dir, split, batch_size, seq_len, rank=rank(), world_size=world(), shuffle=False)
    table = torch.from_numpy(byte_lengths(for_data(data_dir)))
    per_step = batch_size * seq_len * world()
    steps = max(1, tokens // per_step)
    available = loader.sequences_per_epoch * seq_len
    if steps * per_step > available:  # ``flags``: the caller's names for tokens and batch_size
        from gpt2lab.system.errors import UsageError

        lower = f"lower {flags[1]}" if steps == 1 else f"lower {flags[0]} (or {flags[1]})"
        raise UsageError(
            f"{data_dir}: split '{split}' has {available} tokens in sequences of {seq_len}, "
            f"fewer than the {steps * per_step} requested; {lower} or prepare a larger split"
        )
    was_training = model.training
    model.eval()
    # the summed loss, and the targets it is taken on
    total, kept = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
    n_targets, n_bytes = 0, 0  # this rank's targets and the bytes they decode to
    rows = batch_size
    if getattr(model, "decode", None) is not None:  # prepared: whole logits, so a few sequences at a time
        rows = max(1, LOGITS_PER_FORWARD // (seq_len * model.config.vocab_size))
    for _ in range(steps):
        if stop():
            break
        x, y = loader.next_batch()
        scored = y[y != -1]
        n_targets, n_bytes = n_targets + scored.numel(), n_bytes + int(table[scored].sum())
        for xs, ys in zip(x.split(rows), y.split(rows)):  # each forward's mean, weighted by its scored targets
            with autocast(device, dtype):
                _, loss = model(xs.to(device), ys.to(device), return_logits=False)
            n = float((ys != -1).sum())
            total += loss.float() * n
            kept += n
    model.train(was_training)
    counted = all_reduce_sum(torch.tensor([n_targets, n_bytes, stop()], dtype=torch.long, device=device))
    targets, n_bytes, stopped = (int(v) for v in counted.tolist())
    if stopped:
        return None
    loss = (all_reduce_sum(total) / all_reduce_sum(kept).clamp(min=1)).item()
    return LossResult(loss, targets, n_bytes, steps * per_step)

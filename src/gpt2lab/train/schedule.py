"""The schedule: every setting that moves with the step, each a pure function of the step.

The learning rate of each parameter group (linear warmup, then cosine or warmup-stable-decay), the
batch ramp's micro-steps, the sequence-length ramp's length and the multi-token prediction loss's
weight. Pure functions of the step, so a resumed run, whose loader continues from the position its
checkpoint saved, takes the same steps the uninterrupted one took.
"""

from __future__ import annotations

import math


def lr_at(
    step: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    decay_frac: float = 0.2,
) -> float:
    """The learning rate of step ``step``: linear warmup to max_lr over ``warmup_steps``, then

    * ``cosine``: cosine decay to min_lr at ``max_steps`` (TrainConfig allows no other);
    * ``wsd`` (warmup-stable-decay): max_lr until the last ``decay_frac`` of ``max_steps``,
      then a straight line down to min_lr at ``max_steps`` (the decay never starts before
      the warmup ends).

    Step 0 gets max_lr / warmup_steps (never 0, which would waste a step); past max_steps
    the rate stays at min_lr. Every rate is linear in (max_lr, min_lr): groups whose two
    rates have the same ratio are scaled by the same factor at every step.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    if schedule == "wsd":
        start = max(warmup_steps, max_steps - round(decay_frac * max_steps))
        if step < start:
            return max_lr
        return max_lr + (min_lr - max_lr) * (step - start) / (max_steps - start)
    ratio = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


def peak_lr(opt, name: str) -> float:
    """The peak rate of a group's ``lr_name`` (a field of the optim section ``opt``); embed_lr and
    head_lr default to max_lr."""
    value = getattr(opt, name)
    return opt.max_lr if value is None else value


def scheduled_lr(step: int, opt, name: str = "max_lr") -> float:
    """Group ``name``'s rate at ``step``: the schedule with its own peak, its floor min_lr scaled
    by the same ratio (min_lr / max_lr), so every group moves by the same factor."""
    peak = peak_lr(opt, name)
    floor = opt.min_lr if peak == opt.max_lr else peak * (opt.min_lr / opt.max_lr)
    return lr_at(
        step,
        max_lr=peak,
        min_lr=floor,
        warmup_steps=opt.warmup_steps,
        max_steps=opt.max_steps,
        schedule=opt.lr_schedule,
        decay_frac=opt.decay_frac,
    )


def set_lrs(optimizer, step: int, opt) -> float:
    """Give every param group its scheduled rate (groups without ``lr_name`` follow max_lr); returns
    max_lr's, the rate a step's record shows.

    The peaks come from ``opt`` (the optim section) on every step, never from the checkpoint:
    a resumed run with another --muon-lr uses the new one, as --max-lr always has."""
    for group in optimizer.param_groups:
        group["lr"] = scheduled_lr(step, opt, group.get("lr_name", "max_lr"))
    return scheduled_lr(step, opt)


def accum_at(cfg, step: int, world_size: int) -> int:
    """Micro-steps of step ``step`` of the run ``cfg``: ``cfg.grad_accum_steps``, but on the batch ramp
    (step < N = batch_ramp_steps) those of batch_ramp_start S times 1 + floor((total_batch_tokens / S
    - 1) * step / N): the step's tokens go from S up in multiples of S, the same for any world size."""
    end, b = cfg.grad_accum_steps(world_size), cfg.batch
    if step >= b.batch_ramp_steps:
        return end
    units = 1 + (b.total_batch_tokens // b.batch_ramp_start - 1) * step // b.batch_ramp_steps
    return units * cfg.grad_accum_steps(world_size, "batch_ramp_start")


def seq_len_at(batch, step: int) -> int:
    """The sequence length of step ``step`` (``batch``: the batch section): seq_len, but on the
    sequence-length ramp (step < N = seq_len_ramp_steps) seq_len_start S times 2^floor(k * step / N),
    k = log2(seq_len / S): S doubling at even intervals, seq_len from step N. A step's micro-batches
    hold the same tokens at any length (micro_batch_size x seq_len / length rows), so accumulation,
    tokens and the loader's position are the ramp's own business nowhere else."""
    if step >= batch.seq_len_ramp_steps:
        return batch.seq_len
    k = (batch.seq_len // batch.seq_len_start).bit_length() - 1
    return batch.seq_len_start << (k * step // batch.seq_len_ramp_steps)


def mtp_weight_at(cfg, step: int) -> float:
    """The multi-token prediction loss's weight at ``step``: mtp_weight at step 0, moving linearly to
    mtp_weight_final at the last step (max_steps - 1) and staying there; mtp_weight throughout when
    mtp_weight_final is none."""
    start, end, last = cfg.model.mtp_weight, cfg.model.mtp_weight_final, cfg.optim.max_steps - 1
    if end is None:
        return start
    return end if last <= 0 else start + (end - start) * min(1.0, step / last)

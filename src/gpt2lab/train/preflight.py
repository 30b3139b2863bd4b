"""The checks ``train`` runs on its data before building anything, a ``--dry-run`` too: ``--data``
there with shards of both splits, each holding a sequence of ``--seq-len``; with evaluations on, a
val split of at least one micro-batch, and ``--eval-tokens`` trimmed to what it holds; HellaSwag's
data at hand (a dry run never downloads it); the tensorboard package where asked for. A problem is
one line naming the flag that fixes it (ConfigError, exit 2: the data is too small for these
settings); what a start only says (a warning, a trim) comes back as lines to print. (What a resumed
checkpoint cannot take is the run plan's: plan.check_resume_settings.)"""

from __future__ import annotations

import importlib.util
import os

from gpt2lab.system.errors import ConfigError
from gpt2lab.train.config import TrainConfig


def check_present(data: str, faked: bool = False) -> list[str]:
    """--data is a directory (checked first: the plan's own checks mean little without data);
    ``faked``: a dry run planning for another machine (GPT2LAB_FAKE_FACTS), whose --data may be there."""
    if os.path.isdir(data):
        return []
    if faked:
        return [f"note: --data {data} is not on this machine, so its splits are not checked here"]
    raise ConfigError(
        f"--data {data}: no such directory; make it with `gpt2lab prepare --source SRC "
        f"--out {data}` or pass --data DIR (a directory of token shards)"
    )


def check_data(cfg: TrainConfig, world_size: int, dry_run: bool = False) -> list[str]:
    """Every data check of a start (after check_present), and the tensorboard package --tensorboard needs;
    the lines it prints (``warning: ...``, ``note: ...``)."""
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard true needs the tensorboard package: pip install 'gpt2lab[tensorboard]'")
    lines = check_splits(cfg, world_size) if os.path.isdir(cfg.data) else []
    return lines + check_hellaswag(cfg, download=not dry_run)


def check_splits(cfg: TrainConfig, world_size: int) -> list[str]:
    """A train split smaller than one micro-batch (each batch repeats sequences) is a warning; a val
    split smaller than one, with evaluations on, is refused; more --eval-tokens than val holds, a note."""
    batch = cfg.batch.micro_batch_size * world_size
    per = f"{cfg.batch.micro_batch_size}" + (f" x {world_size} processes" if world_size > 1 else "")
    lines = []
    train = split_loader(cfg, "train", world_size)
    if train.sequences_per_epoch < batch:
        lines.append(
            f"warning: the train split of {cfg.data} holds {train.sequences_per_epoch} sequences of seq_len "
            f"{cfg.batch.seq_len}, fewer than one micro-batch of {per}; every batch repeats sequences "
            "(lower --micro-batch-size or prepare more data)"
        )
    if not cfg.eval.eval_interval:
        return lines
    val = split_loader(cfg, "val", world_size)
    if val.sequences_per_epoch < batch:
        fits = max(1, val.sequences_per_epoch // world_size)
        raise ConfigError(
            f"the val split of {cfg.data} holds {val.sequences_per_epoch} sequences of seq_len {cfg.batch.seq_len}, "
            f"fewer than one micro-batch of {per}, so it cannot give a validation loss; lower --micro-batch-size "
            f"to {fits}, prepare a larger val split (gpt2lab prepare --val-tokens), or set --eval-interval 0"
        )
    tokens = eval_tokens(cfg, world_size, val)
    if tokens < cfg.eval.eval_tokens:
        steps = tokens // (batch * cfg.batch.seq_len)
        lines.append(
            f"note: --eval-tokens {cfg.eval.eval_tokens:,} is more than the val split of {cfg.data} holds; "
            f"each evaluation takes all it holds in whole micro-batches: {tokens:,} tokens ({steps} of "
            f"{per} x {cfg.batch.seq_len})"
        )
    return lines


def split_loader(cfg: TrainConfig, split: str, world_size: int):
    """The split's loader (rank 0's view); a split missing, or too short for one sequence, names its flags."""
    from gpt2lab.data import ShardError
    from gpt2lab.data.loader import SplitTooSmall, TokenLoader
    from gpt2lab.data.shards import list_shards

    try:
        list_shards(cfg.data, split)
    except ShardError as e:  # the message starts with the directory
        raise ConfigError(f"--data {e}") from None
    try:
        return TokenLoader(cfg.data, split, cfg.batch.micro_batch_size, cfg.batch.seq_len, world_size=world_size)
    except SplitTooSmall as e:
        val = "prepare a larger val split (gpt2lab prepare --val-tokens) or set --eval-interval 0"
        more = val if split == "val" else "prepare more text"
        raise ConfigError(
            f"the {split} split of {cfg.data} holds {e.tokens} tokens, too few for one sequence of "
            f"--seq-len {cfg.batch.seq_len} (and the token after it); {more}, or lower --seq-len"
        ) from None


def eval_tokens(cfg: TrainConfig, world_size: int, val=None) -> int:
    """The tokens each evaluation takes: --eval-tokens, or, when the val split holds fewer, all the
    whole micro-batches it holds (at least one: check_splits refuses a smaller val split)."""
    from gpt2lab.evals.loss import tokens_within  # the one rule, `eval loss`'s too

    val = val if val is not None else split_loader(cfg, "val", world_size)
    b = cfg.batch
    return tokens_within(cfg.eval.eval_tokens, val.sequences_per_epoch, b.micro_batch_size, b.seq_len, world_size)


def check_hellaswag(cfg: TrainConfig, download: bool = True) -> list[str]:
    """HellaSwag asked for but unable to run fails before training, not at its first evaluation.
    Without ``download`` (a dry run) the official set not yet cached is a note, unless the machine
    is offline (then a real start would fail too)."""
    n = cfg.eval.hellaswag_interval
    if not n:
        return []
    from gpt2lab.evals.hellaswag import load_examples, official
    from gpt2lab.system.env import offline

    if cfg.eval.hellaswag_data is None and not download and not os.path.isfile(official().cached()):
        if not offline():
            return [
                f"note: HellaSwag's official validation set is not in the cache yet; a real start downloads it "
                f"into {official().cached()} (or pass --hellaswag-data FILE)"
            ]
        raise ConfigError(
            f"--hellaswag-interval {n}: the official HellaSwag validation set is not in the cache "
            f"({official().cached()}) and {' and '.join(offline())} is set; pass --hellaswag-data FILE or set "
            "--hellaswag-interval 0"
        )
    try:
        load_examples(cfg.eval.hellaswag_data, limit=1, flag="--hellaswag-data")
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--hellaswag-interval {n}: {e}; or set --hellaswag-interval 0") from e
    return []

"""The check ``train`` runs on the data before building anything: splits too small for one
micro-batch, one line naming the flag to change. (What a resumed checkpoint cannot take is
the run plan's: plan.check_resume_settings.)"""
from __future__ import annotations

import sys

from gpt2lab.system.errors import ConfigError
from gpt2lab.train.config import TrainConfig

def check_splits(cfg: TrainConfig, world_size: int, is_main: bool) -> None:
    """A train split smaller than one micro-batch (each batch repeats sequences) is said in one
    line; a val split smaller than one, with evaluations on, is refused before any work."""
    from gpt2lab.data import TokenLoader

    batch = cfg.batch.micro_batch_size * world_size
    per = f"{cfg.batch.micro_batch_size}" + (f" x {world_size} processes" if world_size > 1 else "")
    train = TokenLoader(cfg.data, "train", cfg.batch.micro_batch_size, cfg.batch.seq_len, world_size=world_size)
    if train.sequences_per_epoch < batch and is_main:
        print(f"gpt2lab train: warning: the train split of {cfg.data} holds {train.sequences_per_epoch} sequences "
              f"of seq_len {cfg.batch.seq_len}, fewer than one micro-batch of {per}; every batch repeats sequences "
              "(lower --micro-batch-size or prepare more data)", file=sys.stderr, flush=True)
    if not cfg.eval.eval_interval:
        return
    val = TokenLoader(cfg.data, "val", cfg.batch.micro_batch_size, cfg.batch.seq_len, world_size=world_size)
    if val.sequences_per_epoch < batch:
        fits = max(1, val.sequences_per_epoch // world_size)
        raise ConfigError(f"the val split of {cfg.data} holds {val.sequences_per_epoch} sequences of seq_len "
                          f"{cfg.batch.seq_len}, fewer than one micro-batch of {per}, so it cannot give a validation "
                          f"loss; lower --micro-batch-size to {fits}, prepare a larger val split (gpt2lab "
                          "prepare --val-tokens), or set --eval-interval 0")

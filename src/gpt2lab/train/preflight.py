"""Checks ``train`` runs before building anything: settings a resumed checkpoint cannot take, and
splits too small for one micro-batch. Each problem is one line naming the flag to change."""
from __future__ import annotations

import sys
from typing import Optional

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.system.errors import ConfigError
from gpt2lab.train.config import TrainConfig, config_value

# Settings that decide which tensors a checkpoint holds, besides the architecture (checked on load).
RESUME_FIELDS = ("lora_rank", "lora_targets")


def check_resume(cfg: TrainConfig, resume: Optional[str]) -> None:
    """A resume whose LoRA settings differ from the checkpoint's: name the flag, not the tensors."""
    if not resume:
        return
    saved, mine = ckpt.read_config(ckpt.resolve(resume)), cfg.to_dict()  # either form (config_value)
    for name in RESUME_FIELDS:
        theirs, ours = config_value(saved, name), config_value(mine, name)
        if theirs is None:
            continue
        if name == "lora_targets" and not (config_value(saved, "lora_rank") and cfg.finetune.lora_rank):
            continue  # the targets matter only to a LoRA run
        if theirs != ours:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {ours}: the checkpoint {ckpt.resolve(resume)} was trained with {name} "
                              f"{theirs}; resume with {flag} {theirs}, or start a new run in another --out")


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

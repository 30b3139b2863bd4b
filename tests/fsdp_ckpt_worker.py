"""Run under torchrun (2 ranks, gloo) by tests/test_sharded_checkpoint.py: a tiny GPT sharded
with FSDP2's ``fully_shard`` trains 4 steps, checkpointing through gpt2lab.checkpoint after
steps 2 and 4; then fresh objects (as after a restart) resume from step 2 and train steps 2-3
again. Rank 0 writes the per-step losses and the live model's logits on a fixed input.

The helpers also serve the test's one-process side (same data, same step).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from gpt2lab import checkpoint as ckpt
from gpt2lab.data import TokenLoader
from gpt2lab.dist import all_reduce_mean
from gpt2lab.model import GPT
from gpt2lab.optim import make_optimizer

CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=50304)  # as config.json has it
B, T, GLOBAL_SEQS = 2, 32, 4  # 4 sequences per step: 2 ranks x 1 micro-step, or 1 process x 2


class Trainer:
    """The trainer's part of a checkpoint: its step counter."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.step * GLOBAL_SEQS * T}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def build(data: str, seed: int) -> dict:
    """The checkpoint parts of a fresh run (weights from ``seed``); sharded under a process group."""
    torch.manual_seed(seed)
    model = GPT(ckpt.model_config(CONFIG))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    opt = make_optimizer(model, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                         device=torch.device("cpu"))
    loader = TokenLoader(data, "train", B, T, rank=rank, world_size=world, seed=1)
    return {"model": model, "optimizer": opt, "loader": loader, "rng": ckpt.RNG(), "scaler": None,
            "trainer": Trainer()}


def train_step(parts: dict) -> float:
    """One optimizer step over GLOBAL_SEQS sequences; the mean loss over micro-steps and ranks."""
    model, opt, loader = parts["model"], parts["optimizer"], parts["loader"]
    accum = GLOBAL_SEQS // (B * loader.world_size)
    total = torch.zeros(())
    for _ in range(accum):
        x, y = loader.next_batch()
        _, loss = model(x, y)
        (loss / accum).backward()
        total += loss.detach() / accum
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    parts["trainer"].step += 1
    return all_reduce_mean(total).item()


def probe() -> torch.Tensor:
    return torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(7))


def main(data: str, out: str) -> None:
    dist.init_process_group("gloo")
    parts, losses = build(data, seed=0), []
    for _ in range(4):
        losses.append(train_step(parts))
        if parts["trainer"].step in (2, 4):
            ckpt.save(out, parts["trainer"].step, parts, CONFIG, keep=0)
    with torch.no_grad():
        logits, _ = parts["model"].eval()(probe())
    again = build(data, seed=1)  # other weights: everything must come from the checkpoint
    ckpt.load(ckpt.checkpoint_dir(out, 2), again)
    resumed = [train_step(again) for _ in range(2)]  # steps 2 and 3 again
    if dist.get_rank() == 0:
        torch.save(logits, os.path.join(out, "logits.pt"))
        with open(os.path.join(out, "losses.json"), "w") as fh:
            json.dump({"losses": losses, "resumed": resumed}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""Time checkpoint.save and checkpoint.verify for GPT-2 124M (weights + AdamW state) on this machine:

    PYTHONPATH=src python benchmarks/checkpoint_cost.py [--rounds 3] [--dir /tmp]

The full layout (model.safetensors, optimizer.pt, state.pt, sha256 checksums), as a
one-process or DDP run writes it; each round saves a new step and keeps one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from gpt2lab.checkpoint import store as checkpoint
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system.files import sha256_file
from gpt2lab.train.optim import make_optimizer


class Counters:
    """The trainer part of a checkpoint: its counters."""

    def state_dict(self) -> dict:
        return {"step": 1, "tokens": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the run directory goes (default: the temp dir)")
    args = p.parse_args()
    model = GPT(GPTConfig(vocab_size=50304))
    opt = make_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device=torch.device("cpu"))
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()  # AdamW's moments exist, as in any checkpoint after step 0
    parts = {
        "model": model,
        "optimizer": opt,
        "trainer": Counters(),
        "loader": None,
        "rng": checkpoint.RNG(),
        "scaler": None,
    }
    run = tempfile.mkdtemp(dir=args.dir)
    try:
        for step in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            path = checkpoint.save(run, step, parts, {"note": "benchmarks/checkpoint_cost.py"}, keep=1)
            t1 = time.perf_counter()
            checkpoint.verify(path)
            t2 = time.perf_counter()
            files = [os.path.join(path, f) for f in os.listdir(path)]
            for f in files:
                sha256_file(f)
            t3 = time.perf_counter()
            size = sum(os.path.getsize(f) for f in files)
            print(
                f"save {t1 - t0:.2f} s, verify {t2 - t1:.2f} s (hashing alone {t3 - t2:.2f} s), {size / 2**30:.2f} GiB"
            )
    finally:
        shutil.rmtree(run)  # the run directory this script made


if __name__ == "__main__":
    main()

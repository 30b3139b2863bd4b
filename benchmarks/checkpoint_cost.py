"""Time a GPT-2 124M run's checkpoint save and checkpoint.verify (weights + AdamW state) on this machine:

    PYTHONPATH=src python benchmarks/checkpoint_cost.py [--rounds 3] [--dir /tmp]

The checkpoint a one-process run writes (``Trainer.save``: model.safetensors, optimizer.pt,
state.pt, config.json, sha256 checksums) after one step of the gpt2-124m preset on random tokens;
each round saves a new step and keeps one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from gpt2lab.benchmarks import timed
from gpt2lab.benchmarks.loader import synthetic_shards
from gpt2lab.checkpoint import store as checkpoint
from gpt2lab.distributed.dist import DistInfo
from gpt2lab.system.files import sha256_file
from gpt2lab.train.settings import load_preset
from gpt2lab.train.trainer import Trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", help="where the run directory goes (default: the temp dir)")
    args = p.parse_args()
    run = tempfile.mkdtemp(dir=args.dir)
    try:
        synthetic_shards(run, 4096)
        short = dict(seq_len=64, micro_batch_size=1, total_batch_tokens=64, dtype="float32", compile=False)
        cfg = load_preset("gpt2-124m", data=run, out=f"{run}/run", device="cpu", keep_checkpoints=1, **short)
        trainer = Trainer.from_config(cfg, DistInfo())
        trainer.train_step()  # AdamW's moments exist, as in any checkpoint after step 0
        for _ in range(args.rounds):
            save, path = timed(trainer.save)
            verify, _ = timed(lambda: checkpoint.verify(path))
            files = [os.path.join(path, f) for f in os.listdir(path)]
            hashing, _ = timed(lambda: [sha256_file(f) for f in files])
            size = sum(os.path.getsize(f) for f in files)
            print(f"save {save:.2f} s, verify {verify:.2f} s (hashing alone {hashing:.2f} s), {size / 2**30:.2f} GiB")
            trainer.step += 1  # the next round's checkpoint is a new step
    finally:
        shutil.rmtree(run)  # the run directory this script made


if __name__ == "__main__":
    main()

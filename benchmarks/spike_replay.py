"""Replay the spike guard (default thresholds) over finished runs' metrics.jsonl: would it have fired?

Exact for runs in which it never fires: the guard only reads each step's loss and grad
norm before the update, so an unguarded run's trajectory is the guarded run's.
"""

import json
import sys

import torch

from gpt2lab.train.config import TrainConfig
from gpt2lab.train.spikes import VALUES, SpikeGuard

d = TrainConfig().spike
for path in sys.argv[1:]:
    g = SpikeGuard(TrainConfig())
    recs = [r for r in (json.loads(line) for line in open(path) if line.strip()) if "train_loss" in r]
    fired, zl, zn = [], -99.0, -99.0
    for r in recs:
        active = int(g.count) >= d.spike_window > 0
        v = dict(zip(VALUES, g.judge(torch.tensor(r["train_loss"]), torch.tensor(r["grad_norm"])).tolist()))
        if active:
            zl, zn = max(zl, v["loss_z"]), max(zn, v["norm_z"])
        if v["skip"]:
            fired.append((r["step"], round(v["loss_z"], 2), round(v["norm_z"], 2)))
    print(
        f"{path}: {len(recs)} steps, guard active for {max(0, len(recs) - d.spike_window)}, "
        f"max loss z {zl:.2f}, max grad-norm z {zn:.2f}, spikes: {fired}"
    )

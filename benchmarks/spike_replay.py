"""Replay the spike guard (default thresholds) over finished runs' metrics.jsonl: would it have fired?

Exact for runs in which it never fires: the guard only reads each step's loss and grad
norm before the update, so an unguarded run's trajectory is the guarded run's.
"""

import json
import math
import sys

from gpt2lab.train.config import TrainConfig
from gpt2lab.train.spikes import LOG_NORM_STD_FLOOR, LOSS_STD_FLOOR, SpikeGuard, zscore

d = TrainConfig().spike
for path in sys.argv[1:]:
    g = SpikeGuard(d.spike_window, d.spike_loss_z, d.spike_norm_z, d.spike_rollback)
    recs = [r for r in (json.loads(line) for line in open(path) if line.strip()) if "train_loss" in r]
    fired, zl, zn = [], -99.0, -99.0
    for r in recs:
        if g.active:
            mean = sum(g.losses) / len(g.losses)
            zl = max(zl, zscore(r["train_loss"], list(g.losses), LOSS_STD_FLOOR * mean))
            zn = max(zn, zscore(math.log(r["grad_norm"]), list(g.log_norms), LOG_NORM_STD_FLOOR))
        hit = g.check(r["step"], 0, r["train_loss"], r["grad_norm"])
        if hit:
            fired.append((r["step"], hit))
    print(
        f"{path}: {len(recs)} steps, guard active for {max(0, len(recs) - d.spike_window)}, "
        f"max loss z {zl:.2f}, max grad-norm z {zn:.2f}, spikes: {fired}"
    )

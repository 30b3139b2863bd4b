"""Where the time of one gpt2lab training step goes: torch.profiler over a few steps.

    python benchmarks/profile_step.py --data DIR [--batch-size 64] [--seq-len 1024] [--out DIR]

Builds the step exactly as `gpt2lab bench ladder`'s gpt2lab rung does (gpt2-124m preset,
bf16, compiled, one micro-step of B x T tokens), warms up (compilation), profiles
``--steps`` steps and prints the operators by total device time (CPU time on a CPU),
the top of the table last. With --out it also writes the table and a Chrome trace.
"""

from __future__ import annotations

import argparse
import os

from torch.profiler import ProfilerActivity, profile

from gpt2lab.benchmarks.ladder import SHAPES, _gpt2lab_step
from gpt2lab.distributed.dist import pick_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="token shards (gpt2lab prepare output)")
    p.add_argument("--size", default="124M", choices=sorted(SHAPES))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--device")
    p.add_argument("--out", help="folder for profile.txt and trace.json")
    args = p.parse_args()
    device = pick_device(args.device)
    step, _ = _gpt2lab_step(SHAPES[args.size], args.batch_size, args.seq_len, device, args.data)
    for _ in range(args.warmup):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=args.rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile.txt"), "w") as fh:
            fh.write(table)
        prof.export_chrome_trace(os.path.join(args.out, "trace.json"))
    print(table)


if __name__ == "__main__":
    main()

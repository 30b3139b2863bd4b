"""Where the batching server's time goes: `gpt2lab bench serve` with the engine's parts timed.

    PYTHONPATH=src python benchmarks/serve_step_parts.py --device cpu --streams 8 --seconds 20 --new-tokens 64

Runs `gpt2lab bench serve` with the given flags, each of the batch worker's parts wrapped in a wall-clock
timer, and prints to stderr, after bench serve's own table, each part's total seconds, calls and ms a
call: the worker's iterations, the model's fused step, the decode step (with the prompts that join it as
rows), prompts' prefill run on their own, top-k, the draws, the text and events of each token (`sampled`), and the
hand-over of a step's events to the event loop (`deliver`, which includes waiting for the GIL
while the HTTP thread takes them). Timers nest: a part's time includes the parts it calls.
"""

from __future__ import annotations

import atexit
import collections
import sys
import time

from gpt2lab.inference import fused
from gpt2lab.serve import batch

TOTAL: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTAL[label] += time.perf_counter() - start
            CALLS[label] += 1

    setattr(owner, name, call)


PARTS = [
    (fused.HeldGPT, "step_rows", "fused step"),
    (batch.Worker, "_decode", "decode step (prompts joining it)"),
    (batch.Worker, "_prefill", "prompts' own prefill"),
    (batch, "top_k_rows", "top-k"),
    (batch, "sample_next", "draws (sample_next)"),
    (batch.Worker, "_sampled", "sampled (text, events)"),
    (batch.Worker, "deliver", "deliver (events to the event loop)"),
]


def _iterations() -> None:
    steps = batch.Worker._steps

    def timed_steps(self):  # an iteration: from asking for the next step to getting it
        start = time.perf_counter()
        for busy in steps(self):
            if busy:
                TOTAL["iteration"] += time.perf_counter() - start
                CALLS["iteration"] += 1
            yield busy
            start = time.perf_counter()

    batch.Worker._steps = timed_steps


def _report() -> None:
    for label in ["iteration", *(p[2] for p in PARTS)]:
        if CALLS[label]:
            ms = 1e3 * TOTAL[label] / CALLS[label]
            print(f"{label}: {TOTAL[label]:.2f} s, {CALLS[label]} calls, {ms:.2f} ms each", file=sys.stderr)


if __name__ == "__main__":  # bench serve's clients run in a spawned process that imports this module
    for owner, name, label in PARTS:
        _timed(owner, name, label)
    _iterations()
    atexit.register(_report)
    from gpt2lab.cli import main

    sys.exit(main(["bench", "serve", *sys.argv[1:]]))

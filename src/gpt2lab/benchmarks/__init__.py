"""Benchmarks behind `gpt2lab bench NAME` (see commands/bench.py), and their shared timer."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def timed(fn: Callable[[], T], device) -> tuple[float, T]:
    """(seconds, result) of ``fn()``, the GPU's queued work included on CUDA."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out

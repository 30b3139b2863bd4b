"""Benchmarks behind `gpt2lab bench NAME` (see commands/bench.py), and their shared timer."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def timed(fn: Callable[[], T], device) -> tuple[float, T]:
    """(seconds, result) of ``fn()``, the device's queued work included."""
    from gpt2lab.system.runtime import sync

    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out

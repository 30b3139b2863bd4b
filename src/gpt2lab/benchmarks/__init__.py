"""Benchmarks behind `gpt2lab bench NAME` (see commands/bench.py), and their shared timer (system/runtime.py's)."""

from __future__ import annotations

from gpt2lab.system.runtime import timed

__all__ = ["timed"]

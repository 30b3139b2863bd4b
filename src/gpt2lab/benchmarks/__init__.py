"""Benchmarks behind `gpt2lab bench NAME` (see commands/bench.py)."""

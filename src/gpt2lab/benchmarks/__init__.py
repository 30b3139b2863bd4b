"""Benchmarks behind `gpt2lab bench NAME` (see commands/bench.py), and what they share: the timer
(system/runtime.py's), the rounds every way takes in turn, the model shape flags and the machine's header."""

from __future__ import annotations

import resource

import torch

from gpt2lab.model.config import GPT2_VOCAB_SIZE
from gpt2lab.system.runtime import timed

DEFAULT_SHAPE = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}  # GPT-2 124M's


def rounds(ways: dict, repeats: int, device=None, after=None) -> tuple[dict, dict]:
    """``repeats`` rounds, each running every way of ``ways`` (name: function) once in turn, so that a busy
    machine slows each alike, then ``after()`` if given: (each way's seconds, each way's last result)."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    last: dict = {}
    for _ in range(repeats):
        for name, fn in ways.items():
            t, last[name] = timed(fn, device)
            times[name].append(t)
        if after:
            after()
    return times, last


def add_shape_flags(p, vocab: bool = False) -> None:
    """The random model's shape: GPT-2 124M's by default."""
    for key, default in DEFAULT_SHAPE.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=default)
    if vocab:
        p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE)


def shape_config(args):
    """The GPTConfig of ``add_shape_flags``' values."""
    from gpt2lab.model.gpt import GPTConfig

    vocab = getattr(args, "vocab_size", GPT2_VOCAB_SIZE)
    return GPTConfig(**{k: getattr(args, k) for k in DEFAULT_SHAPE}, vocab_size=vocab)


def machine(device, args, decision) -> dict:
    """What every inference figure is read beside: the device, torch, its threads; the shape asked; the
    inference flags asked and their decision (inference/choice.py)."""
    asked = {k: getattr(args, k) for k in ("dtype", "quantize", "cpu_linear")}
    out = {"device": str(device), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    # the shape asked (GPT-2's vocabulary where the bench has no --vocab-size)
    config = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd")}
    config["vocab_size"] = getattr(args, "vocab_size", GPT2_VOCAB_SIZE)
    return {**out, "config": config, "asked": asked, "inference": decision.record()}


def peak_rss_bytes() -> int:
    """This process's peak resident size so far (getrusage: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0

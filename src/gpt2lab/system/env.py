"""Every environment variable gpt2lab reads, each read here and nowhere else.

gpt2lab's own: ``GPT2LAB_DEBUG`` (tracebacks), ``GPT2LAB_PROBE`` (``0`` never measures, ``fresh``
measures again), ``GPT2LAB_CACHE`` (the cache directory), ``GPT2LAB_FAKE_FACTS`` (a dry run's made-up
machine). Others': torchrun's ranks, Hugging Face's offline switches, ``XDG_CACHE_HOME``, ``CXX``
the instruction-set caps of the CPU kernels and
OpenMP's thread count and wait policy.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

FAKE_FACTS = "GPT2LAB_FAKE_FACTS"
# Hugging Face's switches that forbid downloads (huggingface_hub reads the first, datasets the second).
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# Caps on the instruction sets of the kernels (oneDNN, ATen's own, MKL): a figure measured under one cap
# says nothing of the others.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
_TRUE = ("1", "ON", "YES", "TRUE")
# OpenMP's: how waiting threads wait (the user's own stand; else system/runtime.py's choose_wait decides).
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _get(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def debug() -> bool:
    return _get("GPT2LAB_DEBUG") not in ("", "0")


def probe_mode() -> str:
    """``GPT2LAB_PROBE``: "1" (measure once, then use the cache), "0" (never measure) or "fresh"."""
    return _get("GPT2LAB_PROBE", "1")


def cache_dir() -> str:
    """gpt2lab's cache: $GPT2LAB_CACHE, else $XDG_CACHE_HOME/gpt2lab, else ~/.cache/gpt2lab."""
    base = _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _get("GPT2LAB_CACHE") or os.path.join(base, "gpt2lab")


def fake_facts() -> Optional[str]:
    return _get(FAKE_FACTS) or None


def offline() -> list[str]:
    """Hugging Face's offline switches that are set."""
    return [v for v in OFFLINE if _get(v).upper() in _TRUE]


def hub_offline() -> bool:
    return OFFLINE[0] in offline()


@contextlib.contextmanager
def hub_offline_set() -> Iterator[bool]:
    """HF_HUB_OFFLINE=1 for the block (as it was after); yields whether the user had set it."""
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield saved is not None
    finally:
        os.environ.pop("HF_HUB_OFFLINE", None)
        if saved is not None:
            os.environ["HF_HUB_OFFLINE"] = saved


@dataclass(frozen=True)
class Launch:
    """What torchrun says of this process (one process without it)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: Optional[int] = None  # this node's processes (None: not said)
    nodes: int = 1
    elastic: bool = False  # started by torchrun


def launch() -> Launch:
    return Launch(
        world_size=int(_get("WORLD_SIZE", "1") or 1),
        rank=int(_get("RANK", "0") or 0),
        local_rank=int(_get("LOCAL_RANK", "0") or 0),
        local_world_size=int(_get("LOCAL_WORLD_SIZE")) if _get("LOCAL_WORLD_SIZE") else None,
        nodes=int(_get("GROUP_WORLD_SIZE", "1") or 1),
        elastic=_get("TORCHELASTIC_RUN_ID", None) is not None,
    )


def openmp() -> dict[str, str]:
    """OpenMP's thread count and wait settings that are set, by name."""
    return {v: _get(v) for v in ("OMP_NUM_THREADS", *WAIT_SETTINGS) if _get(v)}


def put_wait_policy(value: str) -> None:
    """OMP_WAIT_POLICY for this process, for OpenMP to read as torch loads it."""
    os.environ["OMP_WAIT_POLICY"] = value


def cxx() -> str:
    return _get("CXX")


def isa_caps() -> dict[str, str]:
    """The instruction-set caps that are set, by name."""
    return {v: _get(v) for v in ISA_CAPS if _get(v)}

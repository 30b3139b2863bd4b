"""Held weights on huge pages (Linux): the memory a decode step streams, laid out so the CPU's address
translation keeps up with it.

A decode step reads every weight once (the 124M in bf16: 248 MB a token) and little else. On 4 KiB
pages that is a new page every 4 KiB, about 60,000 a token for the 124M, each one a TLB miss and a
page-table walk, far more pages than any CPU's TLB holds; on 2 MiB pages there are 512 times fewer.
Linux gives a private anonymous mapping huge pages where its transparent huge pages are "always" or
"madvise" and the mapping is advised ``MADV_HUGEPAGE``: ``place`` copies the weights a hold made (its
bf16 and int8 copies, never a tensor the model it came from still holds) into one such mapping. The
values are the same bytes, so every result is unchanged; on an AVX2 EPYC the 124M's one-row decode
step took 6-15% less time (docs/benchmarks.md). Where Linux says "never", on another system, or where
the kernel refuses the advice, the weights stay where they are, and the placement says why.

The mapping costs at most two huge pages beyond the weights (its start aligned to a huge page, its end
rounded up to one) and lives as long as the tensors in it; weights smaller than one huge page stay.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Iterable, Optional

import torch
import torch.nn as nn

THP_DIR = "/sys/kernel/mm/transparent_hugepage"
ALIGN = 64  # each tensor's start: the alignment PyTorch's own CPU allocator gives (c10's gAlignment)
ATTRIBUTES = ("weight", "qweight", "panels")  # the decode linears' (inference/kernels.py) matmul weights


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a hold put its weights: ``moved`` bytes copied into the mapping, ``huge`` bytes of it the
    kernel backs with huge pages (read from /proc/self/smaps; None where it could not be read), and why
    nothing moved where nothing did."""

    moved: int = 0
    huge: Optional[int] = None
    why_not: Optional[str] = None

    def describe(self) -> str:
        if self.why_not:
            return f"4 KiB pages ({self.why_not})"
        huge = "unknown" if self.huge is None else f"{self.huge / 2**20:.0f} MiB"
        return f"huge pages: {huge} of {self.moved / 2**20:.0f} MiB of held weights"


@dataclasses.dataclass(frozen=True)
class PageFacts:
    """What the system offers: the huge page size (None: no transparent huge pages) and Linux's mode."""

    size: Optional[int]
    mode: Optional[str]

    def why_not(self) -> Optional[str]:
        if self.size is None or not hasattr(mmap, "MADV_HUGEPAGE"):
            return "no transparent huge pages on this system"
        if self.mode == "never":
            return f"transparent huge pages set to never ({THP_DIR}/enabled)"
        return None


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def page_facts(thp_dir: str = THP_DIR) -> PageFacts:
    """The system's huge page size and transparent-huge-page mode (the bracketed word of ``enabled``)."""
    size, enabled = _read(f"{thp_dir}/hpage_pmd_size"), _read(f"{thp_dir}/enabled")
    mode = enabled.split("[", 1)[1].split("]", 1)[0] if enabled and "[" in enabled else None
    return PageFacts(int(size) if size and size.isdigit() else None, mode)


def huge_bytes(address: int, smaps: str = "/proc/self/smaps") -> Optional[int]:
    """The AnonHugePages of the mapping holding ``address`` in ``smaps`` (bytes), None where not found."""
    inside = False
    for line in (_read(smaps) or "").splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms offset ..."
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None


def _made(t, keep: set[int]) -> bool:
    """Whether ``t`` is a weight a hold made: a CPU tensor, dense, not a parameter, no storage in ``keep``."""
    if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter) or t.requires_grad:
        return False
    dense = t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and t.is_contiguous()
    return dense and t.untyped_storage().data_ptr() not in keep


def place(model: nn.Module, keep: Iterable[torch.Tensor] = (), facts: Optional[PageFacts] = None) -> Placement:
    """Copy the weights ``model``'s decode linears hold (not sharing storage with a tensor of ``keep``,
    the parameters of the model they came from) into one mapping advised to use huge pages, in place."""
    facts = facts or page_facts()
    if why := facts.why_not():
        return Placement(why_not=why)
    kept = {t.untyped_storage().data_ptr() for t in keep}
    tensors = [(m, n, m.__dict__[n]) for m in model.modules() for n in ATTRIBUTES if _made(m.__dict__.get(n), kept)]
    if not tensors:
        return Placement(why_not="no weights of its own to place")
    offsets, total = {}, 0  # id(tensor) -> its offset: a tensor two modules hold is placed once
    for _, _, t in tensors:
        if id(t) not in offsets:
            offsets[id(t)] = total
            total += -(-t.nbytes // ALIGN) * ALIGN
    if total < facts.size:  # a few 4 KiB pages: nothing to gain, and a whole huge page to lose
        return Placement(why_not=f"held weights ({total} bytes) smaller than one huge page")
    size = -(-total // facts.size) * facts.size + facts.size  # room to start on a huge page
    try:
        area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the page faults then take huge pages
    except (OSError, ValueError) as e:
        return Placement(why_not=f"the kernel refused the mapping or its advice ({e})")
    raw = torch.frombuffer(area, dtype=torch.uint8)  # holds ``area`` as long as a view of it lives
    start = -raw.data_ptr() % facts.size
    homes: dict[int, torch.Tensor] = {}
    for module, name, t in tensors:
        if id(t) not in homes:
            at = start + offsets[id(t)]
            homes[id(t)] = raw[at : at + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        setattr(module, name, homes[id(t)])
    return Placement(moved=total, huge=huge_bytes(raw.data_ptr() + start))

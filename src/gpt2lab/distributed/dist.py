"""One place for devices and torch.distributed: the torchrun environment -> DistInfo.

Serves a plain ``python`` run (one process, any device), ``torchrun`` on one node or many
(NCCL on CUDA, gloo on CPU), CPU and Apple MPS alike.
"""

from __future__ import annotations

import contextlib
import gc
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from gpt2lab.system import env
from gpt2lab.system.errors import ConfigError


def pick_device(name: Optional[str] = None) -> torch.device:
    """``name`` if given ('cpu', 'cuda', 'cuda:1', 'mps'), else the best available: cuda > mps > cpu.
    A name that is no device of this machine is a ConfigError (exit 2), the same for every command."""
    if name and name != "auto":
        if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
            raise ConfigError(f"--device {name}: not a device; use cpu, cuda, cuda:N, mps or auto")
        dev = torch.device(name)
        there = {"cpu": 1, "cuda": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}[dev.type]
        if (dev.index or 0) >= there:
            raise ConfigError(f"--device {name}: this machine has {there} {dev.type} device(s); use --device auto")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu")


def autocast(device: torch.device, dtype: str | torch.dtype = "float32"):
    """Mixed-precision context for ``device`` (its own device type: MPS is not CPU).

    float32 means no autocast at all.
    """
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return contextlib.nullcontext() if dt == torch.float32 else torch.autocast(device_type=device.type, dtype=dt)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: Optional[str] = None) -> DistInfo:
    """Read torchrun's RANK/LOCAL_RANK/WORLD_SIZE; start the process group if there are several.

    Without torchrun this is a single process on ``pick_device(device)``. Under torchrun
    each process takes cuda:LOCAL_RANK on GPU machines (NCCL) or the CPU (gloo).
    """
    launch, dev = env.launch(), pick_device(device)
    if launch.world_size > 1:
        if dev.type == "cuda":
            dev = torch.device("cuda", launch.local_rank)
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=launch.rank, world_size=launch.world_size, device=dev)


def _grouped() -> bool:
    """Whether a process group is up (torchrun with several processes)."""
    return dist.is_available() and dist.is_initialized()


def cleanup() -> None:
    if _grouped():
        gc.collect()  # a DDP module left in a reference cycle holds the group: released now, not at exit
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place); a no-op in a single process."""
    if _grouped():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def rank() -> int:
    return dist.get_rank() if _grouped() else 0


def world() -> int:
    return dist.get_world_size() if _grouped() else 1


def broadcast(value):
    """Rank 0's ``value`` (any picklable object) on every rank."""
    return from_every_rank(value)[0]


def from_every_rank(value) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    if world() == 1:
        return [value]
    values: list = [None] * world()
    dist.all_gather_object(values, value)
    return values


def agree(failed: bool) -> bool:
    """True on every rank if any rank failed (so that all raise together and none waits).

    An object collective: it works on gloo and NCCL alike, whatever device holds the model.
    """
    return any(from_every_rank(bool(failed)))


def decided_on_rank_0(decide):
    """``decide()`` run on rank 0 alone and its result handed to every rank; an exception it
    raises is raised on every rank (none is left waiting at the broadcast)."""
    result = None
    if rank() == 0:
        try:
            result = (decide(), None)
        except Exception as e:  # pickled to the others; a traceback object would not be
            result = (None, e)
    value, error = broadcast(result)
    if error is not None:
        raise error
    return value

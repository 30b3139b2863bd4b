"""The loss-spike guard: skip steps whose loss or gradient norm jumps far above their recent past.

llm.c's outlier check, plus what it planned: a step is a *spike* when its loss, or the
log of its gradient norm, is more than a threshold of standard deviations above the mean
of the last ``spike_window`` healthy steps; its update is skipped. ``spike_rollback``
spikes within ``spike_window`` steps mean the data there is bad (or the model was pushed
somewhere bad): the trainer rolls back to the newest checkpoint before the first of them
and skips the loader positions of the spiking steps. The guard's whole state is plain
lists, saved in each checkpoint, so a resumed run makes the same decisions.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import torch

# Floors for the standard deviations: a loss that stays flat for a while must not turn a
# routine wiggle into a huge z-score. 2% of the mean loss; 0.1 in log grad norm (10%).
LOSS_STD_FLOOR = 0.02
LOG_NORM_STD_FLOOR = 0.1


def zscore(value: float, history: list[float], floor: float) -> float:
    mean = sum(history) / len(history)
    var = sum((h - mean) ** 2 for h in history) / len(history)
    return (value - mean) / max(math.sqrt(var), floor)


class SpikeGuard:
    """Decides, step by step, whether a finite step is a spike; remembers recent spikes."""

    def __init__(self, window: int, loss_z: float, norm_z: float, rollback_after: int) -> None:
        self.window, self.loss_z, self.norm_z, self.rollback_after = window, loss_z, norm_z, rollback_after
        self.losses: deque = deque(maxlen=max(window, 1))
        self.log_norms: deque = deque(maxlen=max(window, 1))
        self.spikes: list[list[int]] = []  # [step, loader position at the step's start]

    @property
    def active(self) -> bool:
        return self.window > 0 and len(self.losses) >= self.window

    def check(self, step: int, position: int, loss: float, norm: float) -> Optional[dict]:
        """The z-scores of a spike (and remember it), or None for a healthy step (then learn from it)."""
        log_norm = math.log(max(norm, 1e-12))
        if self.active:
            z_loss = zscore(loss, list(self.losses), LOSS_STD_FLOOR * abs(sum(self.losses) / len(self.losses)))
            z_norm = zscore(log_norm, list(self.log_norms), LOG_NORM_STD_FLOOR)
            if (self.loss_z > 0 and z_loss > self.loss_z) or (self.norm_z > 0 and z_norm > self.norm_z):
                self.spikes.append([step, position])
                return {"loss_z": round(z_loss, 2), "norm_z": round(z_norm, 2)}
        self.losses.append(loss)
        self.log_norms.append(log_norm)
        return None

    def record(self, step: int, position: int, loss: float, norm: float, spiked: bool) -> None:
        """Remember a finite step the device's guard (``DeviceGuard``) already judged, as ``check`` would."""
        if spiked:
            self.spikes.append([step, position])
        else:
            self.losses.append(loss)
            self.log_norms.append(math.log(max(norm, 1e-12)))

    def rollback_due(self, step: int) -> bool:
        """Whether ``rollback_after`` spikes fell within the last ``window`` steps up to ``step``."""
        self.spikes = [s for s in self.spikes if s[0] > step - self.window]
        return self.rollback_after > 0 and len(self.spikes) >= self.rollback_after

    def first_spike(self) -> tuple[int, int]:
        """(step, loader position) of the oldest spike still in the window."""
        return self.spikes[0][0], self.spikes[0][1]

    def state_dict(self) -> dict:
        return {
            "losses": list(self.losses),
            "log_norms": list(self.log_norms),
            "spikes": [list(s) for s in self.spikes],
        }

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.losses.extend(state["losses"])
        self.log_norms.clear()
        self.log_norms.extend(state["log_norms"])
        self.spikes = [list(s) for s in state["spikes"]]


class DeviceGuard:
    """``SpikeGuard.check`` computed on the device, so a step can be judged and its update skipped
    with no host sync (the trainer reads the verdicts back every few steps and hands them to the
    host guard with ``SpikeGuard.record``). Built from the host guard's state, which stays the one
    saved in checkpoints: its last ``window`` healthy losses and log norms in a ring buffer (the
    mean and deviation of a full window do not depend on the order). float64 where the device has it."""

    def __init__(self, guard: SpikeGuard, device: torch.device) -> None:
        self.window, self.loss_z, self.norm_z = guard.window, guard.loss_z, guard.norm_z
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        w, n = max(guard.window, 1), len(guard.losses)
        self.losses = torch.zeros(w, dtype=self.dtype, device=device)
        self.log_norms = torch.zeros(w, dtype=self.dtype, device=device)
        if n:
            self.losses[:n] = torch.tensor(list(guard.losses), dtype=self.dtype)
            self.log_norms[:n] = torch.tensor(list(guard.log_norms), dtype=self.dtype)
        self.count = torch.tensor(n, device=device)  # healthy steps held (at most w)
        self.index = torch.tensor(n % w, device=device)  # where the next one goes (over the oldest)
        self.slots = torch.arange(w, device=device)

    def check(self, loss: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bad, loss_z, norm_z) as 0-d device tensors: bad is 1.0 for a non-finite or spiking step
        (its update must be skipped), 0.0 for a healthy one, which joins the window."""
        w = self.losses.numel()
        loss, norm = loss.detach().to(self.dtype), norm.detach().to(self.dtype)
        log_norm = torch.log(norm.clamp(min=1e-12))
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        z_loss = _zscore(loss, self.losses, LOSS_STD_FLOOR * self.losses.mean().abs())
        z_norm = _zscore(
            log_norm, self.log_norms, torch.tensor(LOG_NORM_STD_FLOOR, dtype=self.dtype, device=loss.device)
        )
        spike = torch.zeros_like(finite)
        if self.loss_z > 0:
            spike = spike | (z_loss > self.loss_z)
        if self.norm_z > 0:
            spike = spike | (z_norm > self.norm_z)
        active = (self.count >= w) if self.window > 0 else torch.zeros_like(finite)
        spike = spike & finite & active
        healthy = finite & ~spike
        here = (self.slots == self.index) & healthy
        self.losses.copy_(torch.where(here, loss, self.losses))
        self.log_norms.copy_(torch.where(here, log_norm, self.log_norms))
        self.index.copy_((self.index + healthy.long()) % w)
        self.count.copy_(torch.clamp(self.count + healthy.long(), max=w))
        return (~healthy).float(), z_loss, z_norm


def _zscore(value: torch.Tensor, history: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    mean = history.mean()
    std = ((history - mean) ** 2).mean().sqrt()
    return (value - mean) / torch.maximum(std, floor)

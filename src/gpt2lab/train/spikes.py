"""The loss-spike guard: skip steps whose loss or gradient norm is not finite or jumps far above their recent past.

llm.c's outlier check, plus what it planned: a step is a *spike* when its loss, or the log of its
gradient norm, is more than a threshold of standard deviations above the mean of the last
``spike_window`` healthy steps; its update is skipped, as a NaN or inf step's is. ``spike_rollback``
spikes within ``spike_window`` steps mean the data there is bad (or the model was pushed somewhere
bad): the trainer rolls back to the newest checkpoint before the first of them and skips the loader
positions of the spiking steps (train/rollback.py).

One rule on every device: ``judge`` runs on the device where the step ran, as tensors, so a step is
judged and its update skipped with no host sync; the trainer reads the verdicts back at once on a
CPU, every few steps on a GPU, and tells the guard which steps spiked (``spikes``, kept on the host
for the rollback). The guard's whole state is plain lists in each checkpoint, so a resumed run makes
the same decisions.
"""

from __future__ import annotations

import torch

# Floors for the standard deviations: a loss that stays flat for a while must not turn a
# routine wiggle into a huge z-score. 2% of the mean loss; 0.1 in log grad norm (10%).
LOSS_STD_FLOOR = 0.02
LOG_NORM_STD_FLOOR = 0.1
# What ``judge`` returns, in this order, as one tensor (read back with one sync for many steps).
VALUES = ("loss", "grad_norm", "skip", "loss_z", "norm_z")


class SpikeGuard:
    """Judges each step (``judge``) and remembers the spikes read back (``spikes``).

    Its memory on the device: the last ``window`` healthy losses and log gradient norms in a ring
    buffer (the mean and deviation of a full window do not depend on the order), float64 where the
    device has it, and how many healthy steps it has seen."""

    def __init__(
        self, window: int, loss_z: float, norm_z: float, rollback_after: int, device: torch.device = torch.device("cpu")
    ) -> None:
        self.window, self.loss_z, self.norm_z, self.rollback_after = window, loss_z, norm_z, rollback_after
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        w = max(window, 1)
        self.losses = torch.zeros(w, dtype=self.dtype, device=device)
        self.log_norms = torch.zeros(w, dtype=self.dtype, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)  # healthy steps seen; the next goes to count % w
        self.spikes: list[list[int]] = []  # [step, loader position at the step's start], as read back

    def judge(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """``VALUES`` of a step as one tensor on its device: skip is 1.0 for a non-finite step or, once the
        window is full, a spiking one (its update must be skipped), 0.0 for a healthy one, which joins
        the window. The z-scores are against the window before this step."""
        w = self.losses.numel()
        loss, norm = loss.detach().to(self.dtype), norm.detach().to(self.dtype)
        log_norm = norm.clamp(min=1e-12).log()
        z_loss = _zscore(loss, self.losses, LOSS_STD_FLOOR * self.losses.mean().abs())
        z_norm = _zscore(
            log_norm, self.log_norms, torch.tensor(LOG_NORM_STD_FLOOR, dtype=self.dtype, device=loss.device)
        )
        finite = loss.isfinite() & norm.isfinite()
        spike = ((z_loss > self.loss_z) & (self.loss_z > 0)) | ((z_norm > self.norm_z) & (self.norm_z > 0))  # 0: off
        healthy = finite & ~(spike & (self.count >= w)) if self.window > 0 else finite
        here = (torch.arange(w, device=loss.device) == self.count % w) & healthy
        self.losses.copy_(torch.where(here, loss, self.losses))
        self.log_norms.copy_(torch.where(here, log_norm, self.log_norms))
        self.count += healthy.long()
        return torch.stack([loss, norm, (~healthy).to(self.dtype), z_loss, z_norm])

    def rollback_due(self, step: int) -> bool:
        """Whether ``rollback_after`` spikes fell within the last ``window`` steps up to ``step``."""
        self.spikes = [s for s in self.spikes if s[0] > step - self.window]
        return self.rollback_after > 0 and len(self.spikes) >= self.rollback_after

    def state_dict(self) -> dict:
        """The window's healthy losses and log norms oldest first, and the spikes: plain lists."""
        n, w = int(self.count), self.losses.numel()
        oldest = n % w if n >= w else 0
        return {
            "losses": self.losses.roll(-oldest)[: min(n, w)].tolist(),
            "log_norms": self.log_norms.roll(-oldest)[: min(n, w)].tolist(),
            "spikes": [list(s) for s in self.spikes],
        }

    def load_state_dict(self, state: dict) -> None:
        w = self.losses.numel()
        losses, log_norms = state["losses"][-w:], state["log_norms"][-w:]
        for buffer, values in ((self.losses, losses), (self.log_norms, log_norms)):
            buffer.zero_()
            buffer[: len(values)] = torch.tensor(values, dtype=self.dtype)
        self.count.fill_(len(losses))
        self.spikes = [list(s) for s in state["spikes"]]


def _zscore(value: torch.Tensor, history: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    mean = history.mean()
    std = ((history - mean) ** 2).mean().sqrt()
    return (value - mean) / torch.maximum(std, floor)

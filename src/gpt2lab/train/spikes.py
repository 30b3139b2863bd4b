"""The loss-spike guard: skip steps whose loss or gradient norm is not finite or jumps far above their recent past.

llm.c's outlier check, plus what it planned: a step is a *spike* when its loss, or the log of its
gradient norm, is more than a threshold of standard deviations above the mean of the last
``spike_window`` healthy steps; its update is skipped, as a NaN or inf step's is. ``spike_rollback``
spikes within ``spike_window`` steps mean the data there is bad (or the model was pushed somewhere
bad): the guard rolls back to the newest checkpoint before the first of them (``decide``) and skips the
loader positions of the spiking steps whenever the loader reaches them, also after a resume (``skips``,
saved in each checkpoint). It gives up after ``MAX_ROLLBACKS`` rollbacks to the same checkpoint (then
the data is not the cause), and the run stops after ``max_bad_steps`` skipped steps in a row
(``check_bad``); a run that must stop raises ``TrainingError``.

One rule on every device: ``judge`` runs on the device where the step ran, as tensors, so a step is
judged and its update skipped with no host sync; the trainer reads the verdicts back at once on a
CPU, every few steps on a GPU, and tells the guard which steps spiked (``spikes``, kept on the host
for the rollback). The guard's whole state is plain lists in each checkpoint, so a resumed run makes
the same decisions.
"""

from __future__ import annotations

from typing import Callable

import torch

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.system.errors import RunDiverged
from gpt2lab.train.config import TrainConfig

# Floors for the standard deviations: a loss that stays flat for a while must not turn a
# routine wiggle into a huge z-score. 2% of the mean loss; 0.1 in log grad norm (10%).
LOSS_STD_FLOOR = 0.02
LOG_NORM_STD_FLOOR = 0.1
# What ``judge`` returns, in this order, as one tensor (read back with one sync for many steps).
VALUES = ("loss", "grad_norm", "skip", "loss_z", "norm_z")
# Rollbacks to the same checkpoint before the run gives up (the spikes are not the data's fault).
MAX_ROLLBACKS = 5


class TrainingError(RunDiverged):
    """The run cannot continue (e.g. repeated NaN losses); the message says what to do."""


class SpikeGuard:
    """Judges each step (``judge``), takes in the records read back (``read``) and decides the rollbacks
    (``decide``) of the run ``cfg`` (its spike settings, checkpoints, seq_len and max_bad_steps).

    Its memory on the device: the last ``window`` healthy losses and log gradient norms in a ring
    buffer (the mean and deviation of a full window do not depend on the order), float64 where the
    device has it, and how many healthy steps it has seen. On the host: the spikes read back, the
    loader ranges never trained on, the rollbacks since the last save and the bad steps in a row."""

    def __init__(self, cfg: TrainConfig, device: torch.device = torch.device("cpu")) -> None:
        s = cfg.spike
        self.window, self.loss_z, self.norm_z = s.spike_window, s.spike_loss_z, s.spike_norm_z
        self.rollback_after, self.cfg = s.spike_rollback, cfg
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        w = max(self.window, 1)
        self.losses = torch.zeros(w, dtype=self.dtype, device=device)
        self.log_norms = torch.zeros(w, dtype=self.dtype, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)  # healthy steps seen; the next goes to count % w
        self.spikes: list[list[int]] = []  # [step, loader position at the step's start], as read back
        self.skips: list[list[int]] = []  # [start, end) loader positions never trained on
        self.rollbacks = self.bad_steps = 0  # since the last checkpoint was saved; skipped steps in a row

    def judge(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """``VALUES`` of a step as one tensor on its device: skip is 1.0 for a non-finite step or, once the
        window is full, a spiking one (its update must be skipped), 0.0 for a healthy one, which joins
        the window. The z-scores are against the window before this step."""
        w = self.losses.numel()
        loss, norm = loss.detach().to(self.dtype), norm.detach().to(self.dtype)
        log_norm = norm.clamp(min=1e-12).log()
        z_loss = _zscore(loss, self.losses, LOSS_STD_FLOOR * self.losses.mean().abs())
        z_norm = _zscore(log_norm, self.log_norms, LOG_NORM_STD_FLOOR)
        finite = loss.isfinite() & norm.isfinite()
        spike = ((z_loss > self.loss_z) & (self.loss_z > 0)) | ((z_norm > self.norm_z) & (self.norm_z > 0))  # 0: off
        healthy = finite & ~(spike & (self.count >= w)) if self.window > 0 else finite
        here = (torch.arange(w, device=loss.device) == self.count % w) & healthy
        self.losses.copy_(torch.where(here, loss, self.losses))
        self.log_norms.copy_(torch.where(here, log_norm, self.log_norms))
        self.count += healthy.long()
        return torch.stack([loss, norm, (~healthy).to(self.dtype), z_loss, z_norm])

    def check_bad(self, record: dict) -> None:
        """Count skipped steps in a row; stop the run after ``max_bad_steps`` of them.

        A step the fp16 grad scaler skipped while lowering its scale is routine, not counted.
        """
        if record.get("grad_scaler"):
            return
        self.bad_steps = self.bad_steps + 1 if "skipped" in record else 0
        if self.bad_steps >= self.cfg.system.max_bad_steps:
            last = ckpt.find_latest(self.cfg.out) or "none yet"
            raise TrainingError(
                f"{self.bad_steps} steps in a row had a non-finite or spiking loss or gradient norm (last at step "
                f"{record['step']}); stopping. The last good checkpoint is {last}: continue from it with "
                "--dtype bfloat16 or float32 (the same command with --resume auto), or start a new run from its "
                "weights with a lower --max-lr or more --warmup-steps (--init-from it, another --out); a resume "
                "keeps the learning rates"
            )

    def skip_bad_data(self, position: int) -> int:
        """The loader position a step starts at: ``position``, past any data a rollback marked bad."""
        for start, end in self.skips:
            if start <= position < end:
                position = end
        return position

    def read(self, record: dict, start: int) -> bool:
        """Take in a step's record as read back (``start``: the loader's position at the step's start):
        count it (``check_bad``), remember a spike; whether ``rollback_after`` spikes now fall within the
        last ``window`` steps (a rollback is due)."""
        self.check_bad(record)
        if record.get("skipped") != "spike":
            return False
        self.spikes = [s for s in self.spikes + [[record["step"], start]] if s[0] > record["step"] + 1 - self.window]
        return self.rollback_after > 0 and len(self.spikes) >= self.rollback_after

    def decide(self, end: int, step: int, restore: Callable[[str], None]) -> dict:
        """Roll back to the newest checkpoint before the first recent spike (``restore(checkpoint)``
        loads it, this guard's state with it, whose newer skips are kept); never train on the spiking
        steps' data again. ``end`` and ``step``: the loader position and step count after the step that
        called for the rollback (read back a few steps at a time on a GPU, so not always now). Returns
        the metrics line that says what was decided. Raises TrainingError after ``MAX_ROLLBACKS``
        rollbacks to the same checkpoint."""
        first_step, first_pos = self.spikes[0]
        target = next((p for p in reversed(ckpt.list_checkpoints(self.cfg.out)) if ckpt.step_of(p) <= first_step), None)
        skip, T = [first_pos, end], self.cfg.batch.seq_len
        self.skips.append(skip)
        record = {
            "step": step,
            "rollback_to": target,
            "skip_positions": skip,
            "skip_tokens": [skip[0] * T, skip[1] * T],
            "spike_steps": [s for s, _ in self.spikes],
        }
        if target is None:  # nothing saved before the spikes; their updates were skipped anyway: go on
            self.spikes = []
            return {**record, "note": "no checkpoint before the spikes; continuing without rolling back"}
        self.rollbacks += 1
        if self.rollbacks > MAX_ROLLBACKS:
            raise TrainingError(
                f"rolled back to {target} {MAX_ROLLBACKS} times and the loss still spikes; "
                "the data is not the cause: start a new run from its weights with a lower --max-lr or more "
                f"--warmup-steps (--init-from {target}, another --out), or continue with --spike-rollback 0 "
                "(the same command with --resume auto)"
            )
        skips = self.skips
        restore(target)
        self.skips, self.bad_steps = skips, 0
        return record

    def state_dict(self) -> dict:
        """The window's healthy losses and log norms oldest first, the spikes and the skips: plain lists."""
        n, w = int(self.count), self.losses.numel()
        oldest = n % w if n >= w else 0
        guard = {
            "losses": self.losses.roll(-oldest)[: min(n, w)].tolist(),
            "log_norms": self.log_norms.roll(-oldest)[: min(n, w)].tolist(),
            "spikes": [list(s) for s in self.spikes],
        }
        return {"guard": guard, "skips": self.skips}

    def load_state_dict(self, state: dict) -> None:
        w, guard = self.losses.numel(), state.get("guard")
        if guard:
            losses, log_norms = guard["losses"][-w:], guard["log_norms"][-w:]
            for buffer, values in ((self.losses, losses), (self.log_norms, log_norms)):
                buffer.zero_()
                buffer[: len(values)] = torch.tensor(values, dtype=self.dtype)
            self.count.fill_(len(losses))
            self.spikes = [list(s) for s in guard["spikes"]]
        self.skips = [list(r) for r in state.get("skips", [])]


def _zscore(value: torch.Tensor, history: torch.Tensor, floor) -> torch.Tensor:
    mean = history.mean()
    return (value - mean) / ((history - mean) ** 2).mean().sqrt().clamp(min=floor)

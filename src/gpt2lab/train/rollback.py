"""The spike guard's rollback, decided here and carried out by the trainer: back to the checkpoint
before the spikes, never their data again; and the stop after ``max_bad_steps`` skipped steps in a row.

``SpikeGuard`` (train/spikes.py) decides which steps spike; ``Rollback`` owns what follows: the
loader positions marked bad (skipped whenever the loader reaches them, also after a resume: they
are saved in each checkpoint), the rollbacks since the last save (the run gives up after
``MAX_ROLLBACKS`` to the same checkpoint: then the data is not the cause) and the count of bad
steps in a row. ``decide`` returns a ``RollbackDecision``; the trainer restores the checkpoint it
names and hands it back (``rolled_back``). A run that must stop raises ``TrainingError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.system.errors import RunDiverged
from gpt2lab.train.config import TrainConfig
from gpt2lab.train.spikes import SpikeGuard

# Rollbacks to the same checkpoint before the run gives up (the spikes are not the data's fault).
MAX_ROLLBACKS = 5


class TrainingError(RunDiverged):
    """The run cannot continue (e.g. repeated NaN losses); the message says what to do."""


@dataclass(frozen=True)
class RollbackDecision:
    """What the trainer does after spikes called for a rollback."""

    record: dict  # the metrics line that says what was decided
    target: Optional[str]  # the checkpoint to restore; None: none before the spikes, train on from here
    skips: list[list[int]]  # every [start, end) loader range never trained on, the new one included:
    # newer than the target checkpoint's own, so they stay after it is restored (``Rollback.rolled_back``)


class Rollback:
    def __init__(self, cfg: TrainConfig, device: torch.device = torch.device("cpu")) -> None:
        self.cfg = cfg
        s = cfg.spike
        self.guard = SpikeGuard(s.spike_window, s.spike_loss_z, s.spike_norm_z, s.spike_rollback, device)
        self.skips: list[list[int]] = []  # [start, end) loader positions never trained on
        self.rollbacks = 0  # since the last checkpoint was saved
        self.bad_steps = 0  # skipped steps in a row (non-finite or spiking)

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
        count it (``check_bad``), remember a spike; whether the spikes now call for a rollback."""
        self.check_bad(record)
        if record.get("skipped") != "spike":
            return False
        self.guard.spikes.append([record["step"], start])
        return self.guard.rollback_due(record["step"] + 1)

    def saved(self) -> None:
        self.rollbacks = 0

    def state_dict(self) -> dict:
        return {"guard": self.guard.state_dict(), "skips": self.skips}

    def load_state_dict(self, state: dict) -> None:
        if state.get("guard"):
            self.guard.load_state_dict(state["guard"])
        self.skips = [list(r) for r in state.get("skips", [])]

    def decide(self, end: int, step: int) -> RollbackDecision:
        """Back to the newest checkpoint before the first recent spike; never train on the spiking steps'
        data. ``end`` and ``step``: the loader position and step count after the step that called for
        the rollback (the trainer's device checks read steps back a few at a time, so not always now).
        Raises TrainingError after ``MAX_ROLLBACKS`` rollbacks to the same checkpoint."""
        first_step, first_pos = self.guard.spikes[0]
        target = next((p for p in reversed(ckpt.list_checkpoints(self.cfg.out)) if ckpt.step_of(p) <= first_step), None)
        skip = [first_pos, end]
        self.skips.append(skip)
        T = self.cfg.batch.seq_len
        record = {
            "step": step,
            "rollback_to": target,
            "skip_positions": skip,
            "skip_tokens": [skip[0] * T, skip[1] * T],
            "spike_steps": [s for s, _ in self.guard.spikes],
        }
        if target is None:  # nothing saved before the spikes; their updates were skipped anyway: go on
            self.guard.spikes = []
            return RollbackDecision(
                {**record, "note": "no checkpoint before the spikes; continuing without rolling back"}, None, self.skips
            )
        self.rollbacks += 1
        if self.rollbacks > MAX_ROLLBACKS:
            raise TrainingError(
                f"rolled back to {target} {MAX_ROLLBACKS} times and the loss still spikes; "
                "the data is not the cause: start a new run from its weights with a lower --max-lr or more "
                f"--warmup-steps (--init-from {target}, another --out), or continue with --spike-rollback 0 "
                "(the same command with --resume auto)"
            )
        return RollbackDecision(record, target, self.skips)

    def rolled_back(self, decision: RollbackDecision) -> None:
        """The trainer restored ``decision.target`` (this guard's state with it): keep the newer skips."""
        self.skips = decision.skips
        self.bad_steps = 0

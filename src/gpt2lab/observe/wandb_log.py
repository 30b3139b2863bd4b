"""Weights & Biases logging for MetricsLogger: the same records as metrics.jsonl.

Rank 0 only (MetricsLogger exists only there). The W&B run id lives in ``RUN/wandb_id``,
so a resumed training run continues the same W&B run. Every record is logged with its
``step`` as the x axis (``define_metric``), not as W&B's own step, so the steps a resumed
run repeats are logged again instead of being dropped as out of order. Samples go to a
table. Without the package, an API key or the network, one line says so and training goes
on with local logging only.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Any, Optional

from gpt2lab.system.files import atomic_write

ID_FILE = "wandb_id"


def _say(message: str) -> None:
    print(
        f"gpt2lab: W&B logging off: {message.rstrip('.')}; metrics.jsonl is written as always",
        file=sys.stderr,
        flush=True,
    )


def _run_id(run_dir: str) -> str:
    """The id this run dir's W&B run has had, or a new one (W&B accepts [a-z0-9])."""
    path = Path(run_dir, ID_FILE)
    return (path.read_text().strip() if path.is_file() else "") or secrets.token_hex(6)


class WandbLogger:
    """Mirrors each metrics record to W&B; ``run`` is None when W&B could not start. ``samples``: the
    [step, text] rows of the samples metrics.jsonl already holds (a resumed run's table goes on)."""

    def __init__(
        self, run_dir: str, project: str, name: Optional[str], config: Optional[dict], samples: list[list]
    ) -> None:
        self.run, self.samples = None, samples
        try:
            import wandb
        except ImportError:
            _say("the wandb package is not installed (pip install 'gpt2lab[wandb]')")
            return
        run_id = _run_id(run_dir)
        try:
            self.run = wandb.init(
                project=project,
                name=name or os.path.basename(os.path.abspath(run_dir)),
                id=run_id,
                resume="allow",
                config=config,
                dir=run_dir,
            )
        except Exception as e:  # no API key, no network, a bad project name: W&B's own message, one line
            _say(" ".join(str(e).split()) or type(e).__name__)
            return
        with atomic_write(os.path.join(run_dir, ID_FILE)) as fh:
            fh.write(run_id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self._table = wandb.Table

    def log(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        values = {k: v for k, v in record.items() if k != "sample" and v is not None}
        if isinstance(record.get("sample"), str):
            self.samples.append([record["step"], record["sample"]])
            values["samples"] = self._table(columns=["step", "sample"], data=list(self.samples))
        self.run.log(values)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

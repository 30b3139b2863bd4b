"""Run logging on rank 0: ``metrics.jsonl``, console lines, a progress bar, optional TensorBoard and W&B.

``metrics.jsonl`` holds one JSON object per line, always with ``step``:
  train lines   step, train_loss, lr, grad_norm, dt_ms, tok_per_s, mfu, tokens
  skipped steps step, skipped ("nan" or "inf"), loss and grad_norm as text, lr (and
                grad_scaler: true when the fp16 scaler skipped it while lowering its scale)
  spikes        step, skipped "spike", loss, grad_norm, lr, loss_z, norm_z (the update was skipped)
  rollbacks     step, rollback_to (checkpoint), skip_positions / skip_tokens ([start, end) of the
                loader's sequence / token stream never trained on), spike_steps
  eval lines    step, val_loss, val_bpb (bits per byte: evals/loss.py)
  HellaSwag     step, hellaswag_acc, hellaswag_acc_norm, hellaswag_n
  samples       step, sample (text)
With ``wandb_project`` each record also goes to Weights & Biases (``wandb_run``).
``run_info.json`` beside it records the code version, library versions and hardware.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from gpt2lab.system.errors import DataError, disk_full, is_disk_full
from gpt2lab.system.files import atomic_write, read_json_object
from gpt2lab.system.runtime import cpu_name


class MetricsLogger:
    """Writes on the main process only; every other rank gets a logger that does nothing."""

    def __init__(
        self,
        run_dir: str,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        log_interval: int = 1,
        tensorboard: bool = False,
        progress: bool = True,
        wandb_project: Optional[str] = None,
        wandb_run_name: Optional[str] = None,
        config: Optional[dict] = None,
    ) -> None:
        self.enabled, self.log_interval = enabled, log_interval
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._fh = self._tb = self._bar = self._wandb = None
        if not enabled:
            return
        kept = truncate_after(self.path, start_step)  # a resumed run rewrites the steps it repeats
        self._fh = open(self.path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise SystemExit(
                    "--tensorboard true needs the tensorboard package: pip install 'gpt2lab[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb_project:  # a resumed run's samples table goes on from the samples metrics.jsonl holds
            self._samples = [[r["step"], r["sample"]] for r in kept if isinstance(r.get("sample"), str)]
            self._wandb = wandb_run(run_dir, wandb_project, wandb_run_name, config)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        except OSError as e:  # a full disk: the cut line is dropped by the next run's truncate_after
            self._if_full(e)
            raise
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:  # the same record; a sample goes into the samples table
            values = {k: v for k, v in record.items() if k != "sample" and v is not None}
            if isinstance(record.get("sample"), str):
                import wandb

                self._samples.append([step, record["sample"]])
                values["samples"] = wandb.Table(columns=["step", "sample"], data=list(self._samples))
            self._wandb.log(values)
        if "train_loss" in record:
            if self._bar is not None:
                self._bar.update(1)
            if step % self.log_interval == 0:
                self.console(format_train(record))
        else:
            self.console(format_other(record))

    def rewind(self, step: int) -> None:
        """Forget the records of steps >= ``step`` (a spike rollback repeats them), except the
        guard's own: its spikes and rollbacks stay as the record of what was skipped."""
        if not self.enabled:
            return
        self._fh.close()
        truncate_after(self.path, step, keep=lambda rec: rec.get("skipped") == "spike" or "rollback_to" in rec)
        self._fh = open(self.path, "a")
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def console(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        fh = self._fh
        for thing in (self._bar, self._tb):
            if thing is not None:
                thing.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._fh = self._tb = self._bar = self._wandb = None
        failing = sys.exc_info()[0] is not None  # closed in a finally while an error goes up
        if fh is not None:
            try:
                fh.close()  # flushes what a failed write left in the buffer: a full disk fails again here
            except OSError as e:
                if failing:
                    return  # that error (a DiskFullError naming this file) is the one to report
                self._if_full(e)
                raise

    def _if_full(self, e: OSError) -> None:
        """Where ``e`` is a full disk, raise a DiskFullError naming metrics.jsonl and what to do."""
        if is_disk_full(e):
            raise disk_full(self.path, "free some space, then continue with --resume auto") from e


# -- Weights & Biases: the same records as metrics.jsonl ------------------------------------------
# Rank 0 only (MetricsLogger exists only there). The W&B run id lives in ``RUN/wandb_id``,
# so a resumed training run continues the same W&B run. Every record is logged with its
# ``step`` as the x axis (``define_metric``), not as W&B's own step, so the steps a resumed
# run repeats are logged again instead of being dropped as out of order. Samples go to a
# table. Without the package, an API key or the network, one line says so and training goes
# on with local logging only.
ID_FILE = "wandb_id"


def _say(message: str) -> None:
    """Say that W&B logging is off, and why."""
    line = f"gpt2lab: W&B logging off: {message.rstrip('.')}; metrics.jsonl is written as always"
    print(line, file=sys.stderr, flush=True)


def wandb_run(run_dir: str, project: str, name: Optional[str], config: Optional[dict]):
    """A W&B run for ``run_dir``'s records, or None when W&B could not start (one line says why)."""
    try:
        import wandb
    except ImportError:
        return _say("the wandb package is not installed (pip install 'gpt2lab[wandb]')")
    path = Path(run_dir, ID_FILE)  # the id this run dir's W&B run has had, or a new one (W&B accepts [a-z0-9])
    run_id = (path.read_text().strip() if path.is_file() else "") or secrets.token_hex(6)
    name = name or os.path.basename(os.path.abspath(run_dir))
    try:
        run = wandb.init(project=project, name=name, id=run_id, resume="allow", config=config, dir=run_dir)
    except Exception as e:  # no API key, no network, a bad project name: W&B's own message, one line
        return _say(" ".join(str(e).split()) or type(e).__name__)
    with atomic_write(str(path)) as fh:
        fh.write(run_id + "\n")
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


def format_train(r: dict) -> str:
    mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
    return (
        f"step {r['step']:6d} | loss {r['train_loss']:.4f} | lr {r['lr']:.2e} | norm {r['grad_norm']:.3f}"
        f" | {r['dt_ms']:.0f} ms | {r['tok_per_s']:,.0f} tok/s | mfu {mfu}"
    )


def format_other(r: dict) -> str:
    rest = {k: v for k, v in r.items() if k != "step"}
    if "sample" in rest:
        return f"step {r['step']:6d} | sample: {rest['sample']!r}"
    return f"step {r['step']:6d} | " + " | ".join(
        f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in rest.items()
    )


def read_metrics(path: str, lenient: bool = False) -> list[dict]:
    """Records of a metrics.jsonl. A missing file, or a line that is not a record (not UTF-8, not JSON, no
    integer ``step``), is an error naming it, except an unfinished last line (a run killed mid-write), left
    out with a warning. ``lenient``: a missing file holds none, and every bad line is left out with one
    warning naming them (a run rewriting the file must not be blocked by what a full disk or a kill cut)."""
    if not os.path.isfile(path):
        if lenient:
            return []
        raise FileNotFoundError(f"{path}: no such file; is this a gpt2lab run directory?")
    lines = Path(path).read_bytes().split(b"\n")
    records, bad = [], []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        why = "each line must be a JSON object with an integer 'step'"
        try:
            rec = json.loads(line.decode("utf-8"))
            why = None if isinstance(rec, dict) and isinstance(rec.get("step"), int) else why
        except UnicodeDecodeError as e:
            why = f"not UTF-8 text (byte {line[e.start]:#04x}); is this a gpt2lab metrics.jsonl? {why}"
        except json.JSONDecodeError as e:
            why = f"not valid JSON ({e.msg})"
        if why is None:
            records.append(rec)
        elif lenient:
            bad.append(lineno)
        elif lineno == len(lines) and why.startswith("not valid JSON"):  # no newline after it: cut short
            warnings.warn(f"{path}:{lineno}: unfinished last line left out")
        else:
            raise DataError(f"{path}:{lineno}: {why}")
    if bad:
        warnings.warn(
            f"{path}: dropped {len(bad)} unreadable line(s) (line {', '.join(map(str, bad[:5]))}), "
            "probably cut by a full disk or a killed run",
            stacklevel=3,
        )
    return records


def truncate_after(path: str, start_step: int, keep: Optional[Callable[[dict], bool]] = None) -> list[dict]:
    """Keep only the records of steps < ``start_step`` (rewritten atomically; returned); ``0`` empties the
    file. ``keep(record)`` true keeps a later one too. Lines that are not records (the last one cut by a
    full disk or a kill) are dropped with a warning naming the file (``read_metrics``'s ``lenient``)."""
    kept = [r for r in read_metrics(path, lenient=True) if r["step"] < start_step or (keep is not None and keep(r))]
    with atomic_write(path) as fh:
        fh.writelines(json.dumps(r) + "\n" for r in kept)
    return kept


def run_info(device: torch.device, world_size: int, run_dir: Optional[str] = None) -> dict:
    """Code version, library versions and hardware, so a number can be traced to its source; with
    ``run_dir``, its ``segments`` too (``segments``)."""
    import numpy

    info: dict[str, Any] = {
        "git_sha": _git_sha(),
        "command": list(sys.argv),  # as the process was started (gpt2lab report shows it)
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "world_size": world_size,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    if run_dir is not None:
        info["segments"] = segments(run_dir, info["command"])
    return info


def segments(run_dir: str, command: list) -> list[dict]:
    """The run's starts so far, this one (``command``, now) last: {"command", "started", "ended"}, read from
    its run_info.json before this start replaces it. A start's end is its last record's time: the
    metrics.jsonl's modification time when the next one begins (the newest's: when it is read)."""
    before = (read_json_object(os.path.join(run_dir, "run_info.json")) or {}).get("segments")
    before = [dict(s) for s in before if isinstance(s, dict)] if isinstance(before, list) else []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if before and "ended" not in before[-1] and os.path.exists(metrics):
        before[-1]["ended"] = round(os.path.getmtime(metrics), 3)
    return [*before, {"command": command, "started": round(time.time(), 3)}]


def _git_sha() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None

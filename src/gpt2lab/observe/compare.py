"""Compare runs: the tokens and seconds each took to reach a loss, and their curves on one plot.

Reads what the trainer writes (``RUN/metrics.jsonl``, ``RUN/config.json``). Runs whose tokenizers
differ compare on ``val_bpb`` (bits per byte: evals/loss.py), not on loss per token. A val loss
logged at step ``s`` is the model after ``s`` completed steps; its tokens are those the train
records of steps ``< s`` counted (``tokens``, cumulative; ``s * total_batch_tokens`` where
they are missing) and its seconds are the sum of their ``dt_ms``: training time, without
start-up or evaluations. A resumed run's repeated steps count once (the later record).
"Reached" is the first evaluation at or below the target, so its resolution is the run's
eval_interval.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from gpt2lab.model.config import config_value
from gpt2lab.observe.plot import new_figure, read_metrics, read_run_config, save_png
from gpt2lab.system.errors import DataError, UsageError


@dataclass
class Curve:
    """One run's loss curve with the tokens and training seconds behind each point."""

    name: str
    points: list[tuple[int, int, float, float]] = field(default_factory=list)  # (step, tokens, seconds, loss)
    tokens_per_step: Optional[int] = None

    @property
    def final(self) -> Optional[tuple[int, int, float, float]]:
        return self.points[-1] if self.points else None

    def reach(self, target: float) -> Optional[tuple[int, int, float, float]]:
        """The first point at or below ``target`` (None: never reached)."""
        return next((p for p in self.points if p[3] <= target), None)


def load_curve(run_dir: str, metric: str = "val_loss", name: Optional[str] = None) -> Curve:
    """``metric`` (val_loss, train_loss, or val_bpb: bits per byte, for runs with different tokenizers) of a
    run directory against tokens and seconds."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    tokens_per_step = _tokens_per_step(run_dir)
    train: dict[int, dict] = {}
    values: dict[int, float] = {}
    for rec in records:  # later records of a step win (a resumed run logs some steps again)
        if "train_loss" in rec:
            train[rec["step"]] = rec
        value = rec.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # train_loss of step s is measured before its update: the model after s steps, like val at s
            values[rec["step"]] = float(value)
    curve = Curve(name or os.path.basename(os.path.normpath(run_dir)), tokens_per_step=tokens_per_step)
    seconds, tokens, done = 0.0, 0, 0
    steps = sorted(train)
    for step in sorted(values):
        while done < len(steps) and steps[done] < step:
            rec = train[steps[done]]
            seconds += float(rec.get("dt_ms", 0.0)) / 1000
            tokens = int(rec["tokens"]) if "tokens" in rec else (steps[done] + 1) * (tokens_per_step or 0)
            done += 1
        if step and done == 0 and tokens_per_step:  # no train records before it (e.g. an eval-only log)
            tokens = step * tokens_per_step
        curve.points.append((step, tokens, seconds, values[step]))
    return curve


def _tokens_per_step(run_dir: str) -> Optional[int]:
    config = read_run_config(run_dir)
    value = config_value(config, "total_batch_tokens") if isinstance(config, dict) else None
    return value if isinstance(value, int) else None


def comparison_table(curves: list[Curve], target: float, metric: str = "val_loss") -> str:
    """Markdown: per run, its final loss, and the steps, tokens and seconds to reach ``target``
    (with their ratio to the first run's)."""
    first = curves[0].reach(target)
    lines = [
        f"{metric} target {target:.4f}; seconds = training steps' time (no start-up, no evaluations)",
        "",
        f"| run | final {metric} | final step | final tokens | final seconds | step reaching target | "
        "tokens to target | seconds to target | tokens vs first | seconds vs first |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in curves:
        if c.final is None:
            lines.append(f"| {c.name} | no {metric} logged | - | - | - | - | - | - | - | - |")
            continue
        step, tokens, seconds, loss = c.final
        hit = c.reach(target)
        if hit is None:
            reached = "not reached | - | - | - | -"
        else:

            def ratio(i):
                return f"{hit[i] / first[i]:.2f}x" if first is not None and first[i] else "-"

            reached = f"{hit[0]} | {hit[1]:,} | {hit[2]:.1f} | {ratio(1)} | {ratio(2)}"
        lines.append(f"| {c.name} | {loss:.4f} | {step} | {tokens:,} | {seconds:.1f} | {reached} |")
    return "\n".join(lines)


def compare_figure(curves: list[Curve], target: float, metric: str = "val_loss"):
    """Left: the loss against tokens; right: against training seconds; the target dashed."""
    fig = new_figure(figsize=(13, 5))
    by_tokens, by_seconds = fig.subplots(1, 2)
    for c in curves:
        if not c.points:
            continue
        _, tokens, seconds, losses = zip(*c.points)
        by_tokens.plot(tokens, losses, marker=".", label=c.name)
        by_seconds.plot(seconds, losses, marker=".", label=c.name)
    for ax, xlabel in ((by_tokens, "tokens"), (by_seconds, "training seconds")):
        ax.axhline(target, color="0.3", ls="--", lw=1, label=f"target {target:.4f}")
        ax.set(xlabel=xlabel, ylabel=metric.replace("_", " "), title=f"{metric.replace('_', ' ')} vs {xlabel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def compare_runs(
    run_dirs: list[str], out_png: Optional[str], target: Optional[float] = None, metric: str = "val_loss"
) -> str:
    """The comparison table of ``run_dirs`` (target: the first run's final loss unless given);
    with ``out_png``, the plot too (written atomically)."""
    if len(run_dirs) < 2:
        raise UsageError("compare needs two or more run directories (the first is the baseline)")
    curves = [load_curve(d, metric) for d in run_dirs]
    if target is None:
        if curves[0].final is None:
            raise DataError(f"{run_dirs[0]}: no {metric} logged; pass --loss X")
        target = curves[0].final[3]
    if out_png:
        save_png(compare_figure(curves, target, metric), out_png)
    return comparison_table(curves, target, metric)

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

from dataclasses import dataclass, field
from typing import Optional

from gpt2lab.model.config import config_value
from gpt2lab.observe.plot import draw, load_run, md_table, save_png
from gpt2lab.system.errors import DataError, UsageError


@dataclass
class Curve:
    """One run's loss curve with the tokens and training seconds behind each point."""

    name: str
    points: list[tuple[int, int, float, float]] = field(default_factory=list)  # (step, tokens, seconds, loss)

    @property
    def final(self) -> Optional[tuple[int, int, float, float]]:
        return self.points[-1] if self.points else None

    def reach(self, target: float) -> Optional[tuple[int, int, float, float]]:
        """The first point at or below ``target`` (None: never reached)."""
        return next((p for p in self.points if p[3] <= target), None)


def load_curve(run_dir: str, metric: str = "val_loss") -> Curve:
    """``metric`` (val_loss, train_loss, or val_bpb: bits per byte, for runs with different tokenizers) of a
    run directory against tokens and seconds."""
    run = load_run(run_dir)
    tokens_per_step = config_value(run.config or {}, "total_batch_tokens")
    tokens_per_step = tokens_per_step if isinstance(tokens_per_step, int) else None
    # the later record of a step wins (a resumed run logs some steps again); train_loss of step s is
    # measured before its update: the model after s steps, like val at s
    train = run.train
    curve = Curve(run.name)
    seconds, tokens, done = 0.0, 0, 0
    for step, value in run.series.get(metric, []):
        while done < len(train) and train[done]["step"] < step:
            rec = train[done]
            seconds += float(rec.get("dt_ms", 0.0)) / 1000
            tokens = int(rec["tokens"]) if "tokens" in rec else (rec["step"] + 1) * (tokens_per_step or 0)
            done += 1
        if step and done == 0 and tokens_per_step:  # no train records before it (e.g. an eval-only log)
            tokens = step * tokens_per_step
        curve.points.append((step, tokens, seconds, value))
    return curve


def comparison_table(curves: list[Curve], target: float, metric: str) -> str:
    """Markdown: per run, its final loss, and the steps, tokens and seconds to reach ``target``
    (with their ratio to the first run's)."""
    first = curves[0].reach(target)
    head = [f"final {metric}", "final step", "final tokens", "final seconds", "step reaching target"]
    head += ["tokens to target", "seconds to target", "tokens vs first", "seconds vs first"]
    rows = [["run", *head]]
    for c in curves:
        if c.final is None:
            rows.append([c.name, f"no {metric} logged", *["-"] * 8])
            continue
        step, tokens, seconds, loss = c.final
        hit = c.reach(target)
        ratios = [f"{hit[i] / first[i]:.2f}x" if hit and first and first[i] else "-" for i in (1, 2)]
        reached = [hit[0], f"{hit[1]:,}", f"{hit[2]:.1f}", *ratios] if hit else ["not reached", "-", "-", "-", "-"]
        rows.append([c.name, f"{loss:.4f}", step, f"{tokens:,}", f"{seconds:.1f}", *reached])
    note = f"{metric} target {target:.4f}; seconds = training steps' time (no start-up, no evaluations)"
    return "\n".join([note, "", *md_table(rows)])


def compare_figure(curves: list[Curve], target: float, metric: str):
    """Left: the loss against tokens; right: against training seconds; the target dashed."""
    name = metric.replace("_", " ")
    panels = [(dict(xlabel=x, ylabel=name, title=f"{name} vs {x}"), [], []) for x in ("tokens", "training seconds")]
    for c in (c for c in curves if c.points):
        _, tokens, seconds, losses = zip(*c.points)
        for (_, lines, _), x in zip(panels, (tokens, seconds)):
            lines.append((x, losses, c.name, dict(marker=".")))
    for _, _, hlines in panels:
        hlines.append((target, f"target {target:.4f}", dict(color="0.3", lw=1)))
    return draw(panels, (13, 5))


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

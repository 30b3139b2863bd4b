"""Plots of training runs against OpenAI GPT-2 and GPT-3, and a Markdown summary.

Reads what the trainer writes: ``RUN/metrics.jsonl`` (one JSON object per line, always
``step``) and ``RUN/config.json``. Uses matplotlib's Agg canvas directly (no pyplot), so
it is safe inside a training process and never needs a display.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

from gpt2lab.model.config import SIZES
from gpt2lab.system import formats, rundir
from gpt2lab.system.errors import DataError, UsageError
from gpt2lab.system.files import atomic_write

GPT2_124M_VAL_LOSS = 3.2924  # OpenAI GPT-2 124M on the FineWeb-Edu val shard (reference recipe)
# A curve of at most this many points is drawn with a marker on each: a line between two points is no curve.
MARKED_UP_TO = 20
# HellaSwag acc_norm by model size: (GPT-2, GPT-3) as published (model.config.SIZES).
HELLASWAG_BASELINES = {s.label: (s.hellaswag_gpt2, s.hellaswag_gpt3) for s in SIZES}
SIZE_BY_SHAPE = {(s.n_layer, s.n_embd): s.label for s in SIZES}
SIZE_BY_PARAMS = {s.label: s.params for s in SIZES}


@dataclass
class Run:
    name: str
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> [(step, value)]
    size: Optional[str] = None
    data: Optional[str] = None  # the data's source (data_source): FineWeb-Edu's val loss baseline needs it


def is_fineweb_edu(source: Optional[str]) -> bool:
    """Whether a run's data source names FineWeb-Edu (``prepare --source fineweb-edu``, the hub id, or a
    directory named for it, as build-nanogpt's edu_fineweb10B): the corpus GPT-2's val loss baseline is on."""
    text = (source or "").lower().replace("_", "-")
    return "fineweb-edu" in text or "edu-fineweb" in text


def data_source(run_dir: str, config: Optional[dict]) -> Optional[str]:
    """What a run trained on: the data's source its plan recorded (run_info.json), else the source in the
    manifest of its --data directory if that is still there, else that directory's path."""
    try:
        with open(os.path.join(run_dir, "run_info.json"), encoding="utf-8") as fh:
            info = json.load(fh)
        found = info.get("plan", {}).get("data_source")
        if isinstance(found, str):
            return found
    except (OSError, ValueError, AttributeError):
        pass
    data = (config or {}).get("data")
    if not isinstance(data, str):
        return None
    try:
        with open(os.path.join(data, "manifest.json"), encoding="utf-8") as fh:
            source = json.load(fh).get("source")
        return source if isinstance(source, str) else data
    except (OSError, ValueError, AttributeError):
        return data


def read_metrics(path: str) -> list[dict]:
    """Records of a metrics.jsonl; a bad line is an error naming it, except an unfinished
    last line (a run killed mid-write), which is left out with a warning."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; is this a gpt2lab run directory?")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{lineno}: not UTF-8 text (byte {data[e.start]:#04x}); is this a gpt2lab "
            "metrics.jsonl? It holds one JSON object per line"
        ) from None
    lines = text.split("\n")
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not text.endswith("\n"):
                warnings.warn(f"{path}:{lineno}: unfinished last line left out")
                continue
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise DataError(f"{path}:{lineno}: each line must be a JSON object with an integer 'step'")
        records.append(rec)
    return records


def detect_size(config: dict) -> Optional[str]:
    """The GPT-2 size a run config (nested: its "model" section) describes ('124M', ...), by its
    (n_layer, n_embd) or a parameter count there; None for other shapes."""
    model = config.get("model")
    model = model if isinstance(model, dict) else {}
    shape = (model.get("n_layer"), model.get("n_embd"))
    if shape in SIZE_BY_SHAPE:
        return SIZE_BY_SHAPE[shape]
    n = next((model[k] for k in ("num_params", "n_params", "params") if isinstance(model.get(k), int)), None)
    if n:
        for size, ref in SIZE_BY_PARAMS.items():
            if abs(n - ref) / ref < 0.01:  # vocab padding (50304) moves the count by 0.03%
                return size
    return None


def load_run(run_dir: str) -> Run:
    run = Run(name=os.path.basename(os.path.normpath(run_dir)))
    by_metric: dict[str, dict[int, float]] = {}
    for rec in read_metrics(os.path.join(run_dir, "metrics.jsonl")):
        for key, value in rec.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                # a resumed run logs some steps again: the later value wins
                by_metric.setdefault(key, {})[rec["step"]] = float(value)
    run.series = {k: sorted(v.items()) for k, v in by_metric.items()}
    config = read_run_config(run_dir)
    if config is not None:
        run.size = detect_size(config)
    run.data = data_source(run_dir, config)
    return run


def read_run_config(run_dir: str) -> Optional[dict]:
    """A run's config.json, nested, without its format_version; None where it has none (plot,
    compare and report read it for the size, the tokens per step and the settings). A file that
    is not a JSON object is a ValueError naming it; one of another format version (an older
    run's, flat or half-nested, has none) a ConfigError in one line (system/formats.py)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg})") from None
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text, so not JSON") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object (a run's config.json holds its settings by section)")
    return formats.unstamp(config, path, formats.RUN)


def _points(values: list) -> dict:
    """A marker on each point of a short series (``MARKED_UP_TO``), where a line alone would hide them."""
    return dict(marker="o", ms=4) if len(values) <= MARKED_UP_TO else {}


def new_figure(**kwargs):
    """A matplotlib Figure (its own canvas, no pyplot); without matplotlib, one line saying how to get it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise UsageError(f"plots need matplotlib ({e}); pip install 'gpt2lab[plot]'") from None
    return Figure(**kwargs)


def build_figure(runs: list[Run]):
    """Train and val loss (log y), with GPT-2 124M's val loss where a run trained on its corpus
    (FineWeb-Edu); beside it, where a run has HellaSwag results, their acc_norm against OpenAI's."""
    hellaswag = any(r.series.get("hellaswag_acc_norm") for r in runs)
    fig = new_figure(figsize=(14, 5) if hellaswag else (8, 5))
    ax_loss, ax_hs = fig.subplots(1, 2) if hellaswag else (fig.subplots(1, 1), None)
    for run in runs:
        for metric, style in (("train_loss", dict(alpha=0.6, lw=1)), ("val_loss", dict(lw=2))):
            if run.series.get(metric):
                steps, values = zip(*run.series[metric])
                ax_loss.plot(steps, values, label=f"{run.name} {metric.replace('_', ' ')}", **style, **_points(values))
        if ax_hs is not None and run.series.get("hellaswag_acc_norm"):
            steps, values = zip(*run.series["hellaswag_acc_norm"])
            ax_hs.plot(steps, values, marker=".", label=f"{run.name} acc_norm")
    if any(is_fineweb_edu(r.data) for r in runs):
        ax_loss.axhline(
            GPT2_124M_VAL_LOSS,
            color="r",
            ls="--",
            label=f"OpenAI GPT-2 (124M), FineWeb-Edu val shard: {GPT2_124M_VAL_LOSS}",
        )
    ax_loss.set_yscale("log")
    ax_loss.set(xlabel="step", ylabel="loss", title="Loss")
    if ax_hs is not None:
        for size in sorted({r.size for r in runs if r.size}, key=lambda s: SIZE_BY_PARAMS[s]):
            gpt2, gpt3 = HELLASWAG_BASELINES[size]
            ax_hs.axhline(gpt2, color="r", ls="--", label=f"OpenAI GPT-2 ({size}) {gpt2}")
            ax_hs.axhline(gpt3, color="g", ls="--", label=f"OpenAI GPT-3 ({size}) {gpt3}")
        ax_hs.set(xlabel="step", ylabel="accuracy (acc_norm)", title="HellaSwag")
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def summary_table(runs: list[Run]) -> str:
    """Markdown: per run, last step, best val loss and best HellaSwag acc_norm (with steps)."""

    def best(series, pick):
        if not series:
            return "-"
        step, value = pick(series, key=lambda sv: sv[1])
        return f"{value:.4f} (step {step})"

    lines = ["| run | size | last step | best val loss | best HellaSwag acc_norm |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        last = max((s for series in r.series.values() for s, _ in series), default="-")
        lines.append(
            f"| {r.name} | {r.size or '-'} | {last} | {best(r.series.get('val_loss'), min)} | "
            f"{best(r.series.get('hellaswag_acc_norm'), max)} |"
        )
    return "\n".join(lines)


def plot_runs(run_dirs: list[str], out_png: str, summary: bool = False) -> Optional[str]:
    """Write the plot of ``run_dirs`` to ``out_png`` (atomically); with ``summary`` also
    return the Markdown summary table."""
    runs = [load_run(d) for d in run_dirs]
    save_png(build_figure(runs), out_png)
    return summary_table(runs) if summary else None


def save_png(fig, out_png: str, flag: str = "--out") -> None:
    """A matplotlib figure as a PNG at ``out_png``, atomically, with gpt2lab's mark; a file there that
    gpt2lab did not write is refused (system/rundir.py's rule) and stays untouched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rundir.check(out_png, rundir.FILE, flag, "pick another path")
    FigureCanvasAgg(fig)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    with atomic_write(out_png, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100, metadata=rundir.PNG_MARK)

"""Plots of training runs against OpenAI GPT-2 and GPT-3, and a Markdown summary.

Reads what the trainer writes: ``RUN/metrics.jsonl`` (one JSON object per line, always
``step``) and ``RUN/config.json``. Uses matplotlib's Agg canvas directly (no pyplot), so
it is safe inside a training process and never needs a display.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gpt2lab.model.config import SIZES
from gpt2lab.observe.metrics import read_metrics
from gpt2lab.system import formats, rundir
from gpt2lab.system.errors import DataError, UsageError
from gpt2lab.system.files import atomic_write, read_json_object

GPT2_124M_VAL_LOSS = 3.2924  # OpenAI GPT-2 124M on the FineWeb-Edu val shard (reference recipe)
# A curve of at most this many points is drawn with a marker on each: a line between two points is no curve.
MARKED_UP_TO = 20
# HellaSwag acc_norm by model size: (GPT-2, GPT-3) as published (model.config.SIZES).
HELLASWAG_BASELINES = {s.label: (s.hellaswag_gpt2, s.hellaswag_gpt3) for s in SIZES}
SIZE_BY_SHAPE = {(s.n_layer, s.n_embd): s.label for s in SIZES}


@dataclass
class Run:
    """A run directory as its writers left it, read once (``load_run``) for plot, compare and report."""

    name: str
    records: list[dict] = field(default_factory=list)  # metrics.jsonl's
    config: Optional[dict] = None  # config.json, nested (read_run_config); None where it has none
    info: dict = field(default_factory=dict)  # run_info.json; {} where it has none

    @property
    def series(self) -> dict[str, list[tuple[int, float]]]:
        """metric -> [(step, value)]; a resumed run logs some steps again: the later value wins."""
        by_metric: dict[str, dict[int, float]] = {}
        for rec in self.records:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    by_metric.setdefault(key, {})[rec["step"]] = float(value)
        return {k: sorted(v.items()) for k, v in by_metric.items()}

    @property
    def train(self) -> list[dict]:
        """The train steps' records in step order; a step logged again (a resumed run): the later record."""
        by_step = {r["step"]: r for r in self.records if "train_loss" in r}
        return [by_step[s] for s in sorted(by_step)]

    @property
    def size(self) -> Optional[str]:
        return detect_size(self.config) if self.config else None

    @property
    def data(self) -> Optional[str]:
        """What the run trained on: the data's source its plan recorded (run_info.json), else the source in
        the manifest of its --data directory if that is still there, else that directory's path."""
        found = self.info.get("plan", {}).get("data_source") if isinstance(self.info.get("plan"), dict) else None
        if isinstance(found, str):
            return found
        data = (self.config or {}).get("data")
        if not isinstance(data, str):
            return None
        source = (read_json_object(os.path.join(data, "manifest.json")) or {}).get("source")
        return source if isinstance(source, str) else data


def is_fineweb_edu(source: Optional[str]) -> bool:
    """Whether a run's data source names FineWeb-Edu (``prepare --source fineweb-edu``, the hub id, or a
    directory named for it, as build-nanogpt's edu_fineweb10B): the corpus GPT-2's val loss baseline is on."""
    text = (source or "").lower().replace("_", "-")
    return "fineweb-edu" in text or "edu-fineweb" in text


def detect_size(config: dict) -> Optional[str]:
    """The GPT-2 size a run config (nested: its "model" section) describes ('124M', ...), by its
    (n_layer, n_embd); None for other shapes."""
    model = config.get("model")
    return SIZE_BY_SHAPE.get((model.get("n_layer"), model.get("n_embd"))) if isinstance(model, dict) else None


def read_json(path: str) -> Optional[object]:
    """The JSON value in ``path``; None where there is no such file; one line naming it where it is not JSON."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg})") from None
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text, so not JSON") from None


def load_run(run_dir: str) -> Run:
    """The run in ``run_dir``: its records (``read_metrics``), config.json and run_info.json."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))  # a cut last line: left out, with a warning
    info = read_json(os.path.join(run_dir, "run_info.json"))
    name = os.path.basename(os.path.normpath(run_dir))
    return Run(name, records, config=read_run_config(run_dir), info=info if isinstance(info, dict) else {})


def read_run_config(run_dir: str) -> Optional[dict]:
    """A run's config.json, nested, without its format_version; None where it has none. A file that
    is not a JSON object is a DataError naming it; one of another format version (an older run's,
    flat or half-nested, has none) a ConfigError in one line (system/formats.py)."""
    path = os.path.join(run_dir, "config.json")
    config = read_json(path)
    if config is None:
        return None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object (a run's config.json holds its settings by section)")
    return formats.unstamp(config, path, formats.RUN)


def draw(panels: list[tuple[dict, list, list]], figsize: tuple[float, float]):
    """A figure of ``panels`` side by side, each (``Axes.set``'s settings, its curves as (x, y, label,
    style), its dashed lines as (y, label, style)), with a legend where something is labelled and a grid: a
    matplotlib Figure (its own canvas, no pyplot); without matplotlib, one line saying how to get it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise UsageError(f"plots need matplotlib ({e}); pip install 'gpt2lab[plot]'") from None
    fig = Figure(figsize=figsize)
    for ax, (settings, curves, hlines) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for x, y, label, style in curves:
            ax.plot(x, y, label=label, **style)
        for y, label, style in hlines:
            ax.axhline(y, ls="--", label=label, **style)
        ax.set(**settings)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def build_figure(runs: list[Run]):
    """Train and val loss (log y), with GPT-2 124M's val loss where a run trained on its corpus
    (FineWeb-Edu); beside it, where a run has HellaSwag results, their acc_norm against OpenAI's."""
    loss: tuple[dict, list, list] = (dict(xlabel="step", ylabel="loss", title="Loss", yscale="log"), [], [])
    hellaswag: tuple[dict, list, list] = (dict(xlabel="step", ylabel="accuracy (acc_norm)", title="HellaSwag"), [], [])
    for run in runs:
        for metric, style in (("train_loss", dict(alpha=0.6, lw=1)), ("val_loss", dict(lw=2))):
            if run.series.get(metric):
                steps, values = zip(*run.series[metric])
                marked = dict(marker="o", ms=4) if len(values) <= MARKED_UP_TO else {}
                loss[1].append((steps, values, f"{run.name} {metric.replace('_', ' ')}", {**style, **marked}))
        if run.series.get("hellaswag_acc_norm"):
            steps, values = zip(*run.series["hellaswag_acc_norm"])
            hellaswag[1].append((steps, values, f"{run.name} acc_norm", dict(marker=".")))
    if any(is_fineweb_edu(r.data) for r in runs):
        label = f"OpenAI GPT-2 (124M), FineWeb-Edu val shard: {GPT2_124M_VAL_LOSS}"
        loss[2].append((GPT2_124M_VAL_LOSS, label, dict(color="r")))
    for size in sorted({r.size for r in runs if r.size}, key=list(HELLASWAG_BASELINES).index):
        gpt2, gpt3 = HELLASWAG_BASELINES[size]
        hellaswag[2].append((gpt2, f"OpenAI GPT-2 ({size}) {gpt2}", dict(color="r")))
        hellaswag[2].append((gpt3, f"OpenAI GPT-3 ({size}) {gpt3}", dict(color="g")))
    return draw([loss, hellaswag], (14, 5)) if hellaswag[1] else draw([loss], (8, 5))


def md_table(rows: list[list], cell: Callable[[Any], str] = str) -> list[str]:
    """The lines of a Markdown table of ``rows`` (the first: the header), each value written by ``cell``."""

    def text(v: Any) -> str:
        return cell(v).replace("|", "\\|").replace("\n", "<br>")

    head, *body = rows
    return ["| " + " | ".join(map(text, row)) + " |" for row in (head, ["---"] * len(head), *body)]


def at_step(point: Optional[tuple[int, float]]) -> str:
    """A (step, value) point as the tables write it ("-": none)."""
    return f"{point[1]:.4f} (step {point[0]})" if point else "-"


def summary_table(runs: list[Run]) -> str:
    """Markdown: per run, last step, best val loss and best HellaSwag acc_norm (with steps)."""
    value = lambda sv: sv[1]  # noqa: E731
    head = ["run", "size", "last step", "best val loss", "best HellaSwag acc_norm"]
    rows = [
        [
            r.name,
            r.size or "-",
            max((s for series in r.series.values() for s, _ in series), default="-"),
            at_step(min(r.series.get("val_loss", []), key=value, default=None)),
            at_step(max(r.series.get("hellaswag_acc_norm", []), key=value, default=None)),
        ]
        for r in runs
    ]
    return "\n".join(md_table([head, *rows]))


def plot_runs(run_dirs: list[str], out_png: str, summary: bool = False) -> Optional[str]:
    """Write the plot of ``run_dirs`` to ``out_png`` (atomically); with ``summary`` also
    return the Markdown summary table."""
    runs = [load_run(d) for d in run_dirs]
    save_png(build_figure(runs), out_png)
    return summary_table(runs) if summary else None


def png(fig, dpi: int = 100) -> bytes:
    """A matplotlib figure as PNG bytes with gpt2lab's mark (system/rundir.py)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata=rundir.PNG_MARK)
    return buf.getvalue()


def save_png(fig, out_png: str) -> None:
    """A matplotlib figure as a PNG at ``out_png``, atomically, with gpt2lab's mark; a file there that
    gpt2lab did not write is refused (system/rundir.py's rule) and stays untouched."""
    rundir.check(out_png, rundir.FILE, "--out", "pick another path")
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    with atomic_write(out_png, "wb") as fh:
        fh.write(png(fig))

"""A run's report card: one self-contained HTML page (plots embedded) and its Markdown twin.

Reads only what a run dir holds: ``config.json`` (nested, of this format version:
plot.read_run_config), ``run_info.json`` (rendered key by key,
so keys added later show up by themselves), ``metrics.jsonl`` (through metrics.read_metrics,
which leaves out a cut last line) and ``checkpoints/``. Works on a finished, a running
and a crashed run, and says which.
"""

from __future__ import annotations

import base64
import html
import json
import os
import shlex
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from gpt2lab.data.tokenizer import short
from gpt2lab.model.config import config_value
from gpt2lab.observe import plot
from gpt2lab.system import rundir
from gpt2lab.system.files import atomic_write

RUNNING_IF_WRITTEN_WITHIN_S = 600  # or 20 median steps, whichever is longer: evaluations pause the log
EVENT_KEYS = ("skipped", "spike", "rollback")  # records that mark a step out of the ordinary


@dataclass
class Section:
    title: str
    text: str = ""
    table: Optional[list[list[Any]]] = None  # first row: header
    image_png: Optional[bytes] = None


@dataclass
class Report:
    title: str
    status: str
    sections: list[Section] = field(default_factory=list)


def _checkpoints(run_dir: str) -> list[tuple[int, str, int]]:
    """(step, path, bytes) of each complete checkpoint, oldest first."""
    from gpt2lab.checkpoint.store import list_checkpoints, step_of

    size = lambda path: sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))  # noqa: E731
    return [(step_of(path), path, size(path)) for path in list_checkpoints(run_dir)]


def run_status(run_dir: str, config: dict, records: list[dict], cut: bool, ckpts: list, now: float, info: dict) -> str:
    max_steps = config_value(config, "max_steps")
    last = max((r["step"] for r in records if "train_loss" in r or any(k in r for k in EVENT_KEYS)), default=None)
    ckpt_steps = [s for s, _, _ in ckpts]
    if max_steps and max_steps in ckpt_steps:
        return f"finished: all {max_steps} steps, final checkpoint step_{max_steps:06d}"
    where = f"step {last} of {max_steps}" if last is not None else f"no step logged yet (of {max_steps})"
    metrics = os.path.join(run_dir, "metrics.jsonl")
    age = now - os.path.getmtime(metrics) if os.path.exists(metrics) else float("inf")
    dts = [r["dt_ms"] / 1000 for r in records if isinstance(r.get("dt_ms"), (int, float))]
    window = max(RUNNING_IF_WRITTEN_WITHIN_S, 20 * statistics.median(dts)) if dts else RUNNING_IF_WRITTEN_WITHIN_S
    who = rundir.holder(run_dir)
    if who is not None:  # the lock is the truth: the kernel drops it with its process, however it ends
        return f"running: at {where} (lock held by pid {who.get('pid')})"
    if not os.path.exists(os.path.join(run_dir, rundir.LOCK_FILE)) and age < window:  # a run of a version
        return f"running: at {where} (last record {age:.0f} s ago)"  # that kept no lock
    resume = continue_command(info)
    hint = f"{resume} continues from step {ckpt_steps[-1]}" if ckpt_steps else "no checkpoint was saved: start again"
    if cut:
        return f"crashed: metrics.jsonl ends in a cut line (killed mid-write) at {where}; {hint}"
    if last is not None and ckpt_steps and ckpt_steps[-1] == last + 1:
        return f"stopped at {where} with a checkpoint there; continue with {resume}"
    ago = f"{age:.0f} s" if age < 120 else f"{age / 60:.0f} min"
    return f"crashed or killed at {where} (last record {ago} ago); {hint}"


def continue_command(info: dict) -> str:
    """How to continue the run: the command its start recorded (run_info.json's ``resume_with``), else its
    ``gpt2lab train`` command line with ``--resume auto`` in place of any --resume, else the flag."""
    said = info.get("resume_with")
    if isinstance(said, str) and said:
        return said
    line = command_line(info)
    if not line or not line.startswith("gpt2lab train "):
        return "`--resume auto`"
    return f"`{rundir.resume_command(shlex.split(line)[1:], 'gpt2lab')}`"


def command_line(info: dict) -> Optional[str]:
    argv = info.get("command")
    if not isinstance(argv, list) or not argv:
        return argv if isinstance(argv, str) else None
    head = os.path.basename(str(argv[0]))
    if head in ("gpt2lab", "__main__.py"):  # the console script, or python -m gpt2lab
        return "gpt2lab " + shlex.join(map(str, argv[1:]))
    return shlex.join(map(str, argv))


def preset_of(info: dict) -> Optional[str]:
    argv = info.get("command")
    if isinstance(argv, list):
        for i, arg in enumerate(argv):
            if arg == "--preset" and i + 1 < len(argv):
                return str(argv[i + 1])
            if str(arg).startswith("--preset="):
                return str(arg).split("=", 1)[1]
    return info.get("preset")


def _flatten(d: dict, prefix: str = "") -> list[list[Any]]:
    rows = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            rows += _flatten(v, f"{prefix}{k}.")
        else:
            rows.append([f"{prefix}{k}", v])
    return rows


def _fmt_duration(s: float) -> str:
    h, rem = divmod(int(round(s)), 3600)
    return f"{h}h {rem // 60:02d}m {rem % 60:02d}s" if h else f"{rem // 60}m {rem % 60:02d}s"


def _speed(train: list[dict], config: dict, run_dir: str, info: dict) -> list[list[Any]]:
    if not train:
        return [["figure", "value"], ["train steps logged", 0]]
    step_time = sum(r["dt_ms"] for r in train) / 1000
    batch = config_value(config, "total_batch_tokens", 0)
    tokens = train[-1].get("tokens") or len(train) * batch
    recent = train[-50:]
    rows = [
        ["figure", "value"],
        ["train steps logged", len(train)],
        ["tokens seen", f"{tokens:,}"],
        ["time in training steps", _fmt_duration(step_time)],
        ["tok/s (all steps)", f"{len(train) * batch / step_time:,.0f}" if step_time and batch else "-"],
        [f"tok/s (median of last {len(recent)} steps)", f"{statistics.median(r['tok_per_s'] for r in recent):,.0f}"],
        [f"ms/step (median of last {len(recent)})", f"{statistics.median(r['dt_ms'] for r in recent):,.1f}"],
    ]
    mfus = [r["mfu"] for r in recent if isinstance(r.get("mfu"), (int, float))]
    no_peak = "n/a (no peak FLOP/s known for this device; see --peak-flops)"
    rows.append(["MFU (median of last steps)", f"{100 * statistics.median(mfus):.1f}%" if mfus else no_peak])
    last = os.path.join(run_dir, "metrics.jsonl")
    starts = _segments(info)
    if starts and os.path.exists(last):  # the newest start ends at its last record
        ends = [s.get("ended") for s in starts[:-1]] + [os.path.getmtime(last)]
        wall = sum(max(0.0, e - s["started"]) for s, e in zip(starts, ends) if isinstance(e, (int, float)))
        each = f"its {len(starts)} starts added up, each" if len(starts) > 1 else "start"
        rows.append([f"wall clock, {each} to its last record (includes evaluations, pauses)", _fmt_duration(wall)])
    elif os.path.exists(first := os.path.join(run_dir, "config.json")) and os.path.exists(last):  # older runs
        wall = max(0.0, os.path.getmtime(last) - os.path.getmtime(first))
        rows.append(["wall clock, config.json to last record (includes evaluations, pauses)", _fmt_duration(wall)])
    return rows


def _segments(info: dict) -> list[dict]:
    """run_info.json's starts of the run (observe/metrics.segments), each with a start time."""
    found = info.get("segments") if isinstance(info.get("segments"), list) else []
    return [s for s in found if isinstance(s, dict) and isinstance(s.get("started"), (int, float))]


def _results(series: dict, size: Optional[str], fineweb_edu: bool) -> Section:
    """The last of each metric the run logged, beside OpenAI's where they apply: GPT-2 124M's val loss on
    FineWeb-Edu for a run on that corpus, HellaSwag's published acc_norm for a run with HellaSwag results
    (its size's, else 124M's for scale). No baseline that applies: no baseline columns."""
    ref = size or "124M"
    gpt2_hs, gpt3_hs = plot.HELLASWAG_BASELINES[ref]
    val, hs, bpb = (series.get(key, [None])[-1] for key in ("val_loss", "hellaswag_acc_norm", "val_bpb"))
    gpt2_val = plot.GPT2_124M_VAL_LOSS if fineweb_edu and ref == "124M" and val else "-"
    which = "the run's val split" + ("; GPT-2's on FineWeb-Edu val" if gpt2_val != "-" else "")
    rows = [[f"val loss ({which})", plot.at_step(val), gpt2_val, "-"]]
    if hs:
        rows.append(["HellaSwag acc_norm", plot.at_step(hs), gpt2_hs, gpt3_hs])
    if bpb:  # bits per byte: comparable across tokenizers (runs written before it have none)
        rows.append(["val bits per byte (the loss over the text's UTF-8 bytes)", plot.at_step(bpb), "-", "-"])
    if all(row[2:] == ["-", "-"] for row in rows):
        return Section("Final metrics", table=[["metric", "this run"], *[row[:2] for row in rows]])
    head = ["metric", "this run", f"OpenAI GPT-2 {ref}", f"OpenAI GPT-3 {ref}"]
    scale = "" if size else "This run is not a GPT-2 size; the 124M baselines are shown for scale."
    return Section("Final metrics against OpenAI's models", text=scale, table=[head, *rows])


# run_info.json keys the report shows elsewhere: the plan's config is config.json's (its own section),
# the commands and the starts' times are "What was run" and the wall clock
_SHOWN_ELSEWHERE = ("plan.config", "command", "segments")


def _facts(info: dict) -> list[list[Any]]:
    """run_info.json key by key, each fact once: a later key holding what an earlier one showed (the
    plan's ``dtype.value`` after ``choices.dtype``, its ``facts.*`` after ``choices.*``) is left out.
    Facts are named by their last key, ``value`` by its owner and ``reason`` as ``OWNER_reason``."""
    rows, seen = [], set()
    for key, value in _flatten(info):
        if any(f"{key}.".startswith(f"{k}.") for k in _SHOWN_ELSEWHERE):
            continue
        *owner, name = key.split(".")
        if owner and name in ("value", "reason"):
            name = owner[-1] if name == "value" else f"{owner[-1]}_reason"
        fact = (name, json.dumps(value, sort_keys=True, default=str))
        if fact not in seen:
            seen.add(fact)
            rows.append([key, value])
    return rows


def _listed(title: str, head: list[str], rows: list[list[Any]], empty: str) -> Section:
    """A section of a table of ``rows``, or of the text ``empty`` where there are none."""
    return Section(title, table=[head, *rows], text="") if rows else Section(title, text=empty)


def build_report(run_dir: str, now: Optional[float] = None, curves: bool = True) -> Report:
    """Everything the card shows; ``curves=False`` leaves out the plot (the costly part)."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    with warnings.catch_warnings(record=True) as caught:  # a cut last line is reported in the status instead
        warnings.simplefilter("always")
        run = plot.load_run(run_dir)
    cut = any("unfinished last line" in str(w.message) for w in caught)
    config, info, records, size = run.config or {}, run.info, run.records, run.size
    ckpts = _checkpoints(run_dir)
    arch = config.get("model") if isinstance(config.get("model"), dict) else {}  # no table: the rest still shows
    status = run_status(run_dir, config, records, cut, ckpts, time.time() if now is None else now, info)
    fineweb_edu = plot.is_fineweb_edu(run.data)
    shape = f"{arch.get('n_layer')} layers, {arch.get('n_head')} heads, {arch.get('n_embd')} wide"
    vocab = arch.get("token_vocab_size")
    what = [
        ["item", "value"],
        ["run dir", os.path.abspath(run_dir)],
        ["preset", preset_of(info) or "-"],
        ["command", "\n".join(filter(None, map(command_line, _segments(info) or [info]))) or "-"],
        ["code version (git)", info.get("git_sha") or "-"],
        ["model", shape + (f" (GPT-2 {size} shape)" if size else "")],
        ["parameters", f"{info['params']:,}" if isinstance(info.get("params"), int) else "-"],
        ["tokenizer", short(arch.get("tokenizer")) + (f", {vocab:,} tokens" if isinstance(vocab, int) else "")],
    ]
    events = [[r["step"], _event_text(r)] for r in records if any(k in r for k in EVENT_KEYS)]
    samples = [[r["step"], r["sample"]] for r in records if isinstance(r.get("sample"), str)]
    saved = [[s, p, f"{b / 2**20:,.1f} MiB"] for s, p, b in ckpts]
    title = f"gpt2lab report: {os.path.basename(os.path.abspath(run_dir))}"
    sections = [
        Section("What was run", table=what),
        Section("How long and how fast", table=_speed(run.train, config, run_dir, info)),
        _results(run.series, size, fineweb_edu),
        Section(
            "Curves",
            image_png=plot.png(plot.build_figure([run]), dpi=90) if records and curves else None,
            text="" if records else "No metrics logged yet.",
        ),
        _listed("Samples", ["step", "sample"], samples, "No samples logged (train with --sample-interval N)."),
        _listed("Skipped and spike steps", ["step", "event"], events, "None: every step was applied."),
        _listed("Checkpoints", ["step", "path", "size"], saved, "No checkpoint saved yet."),
        _listed(
            "Environment and automatic choices (run_info.json)",
            ["key", "value"],
            _facts(info),
            "run_info.json is missing." if not info else "",
        ),
        _listed("Config (config.json)", ["field", "value"], _flatten(config), "config.json is missing."),
    ]
    return Report(title, status, sections)


def _event_text(r: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in r.items() if k != "step")


# -- rendering ---------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;color:#222}
h1{font-size:24px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;
vertical-align:top}th{background:#f3f3f3}td{white-space:pre-wrap}img{max-width:100%}
.status{padding:10px 14px;border-radius:6px;background:#eef5ee;font-weight:600}
.status.crashed,.status.stopped{background:#fbeaea}.status.running{background:#fff6dd}"""


def _cell(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(map(_cell, v)) or "none"
    return "none" if v is None else json.dumps(v) if isinstance(v, bool) else str(v)


def _walk(rep: Report, heading, text, image, table) -> list[str]:
    """The lines of each section as one renderer writes its title, text, image and table."""
    lines = []
    for s in rep.sections:
        lines += heading(s.title)
        lines += text(s.text) if s.text else []
        lines += image(s) if s.image_png else []
        lines += table(s.table) if s.table else []
    return lines


def to_html(rep: Report) -> str:
    esc, kind = html.escape, rep.status.split(":")[0].split()[0]

    def row(cells: list, tag: str) -> str:
        return "<tr>" + "".join(f"<{tag}>{esc(_cell(c))}</{tag}>" for c in cells) + "</tr>"

    def image(s: Section) -> list[str]:
        return [f"<img alt='{esc(s.title)}' src='data:image/png;base64,{base64.b64encode(s.image_png).decode()}'>"]

    body = _walk(
        rep,
        heading=lambda title: [f"<h2>{esc(title)}</h2>"],
        text=lambda text: [f"<p>{esc(text)}</p>"],
        image=image,
        table=lambda t: ["<table>" + row(t[0], "th"), *[row(r, "td") for r in t[1:]], "</table>"],
    )
    return "\n".join(
        [
            f"<!doctype html>{rundir.TEXT_MARK}<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{esc(rep.title)}</title><style>{_CSS}</style></head><body><h1>{esc(rep.title)}</h1>",
            f"<p class='status {esc(kind)}' id='status'>{esc(rep.status)}</p>",
            *body,
            "</body></html>\n",
        ]
    )


def to_markdown(rep: Report, image_name: Optional[str]) -> str:
    body = _walk(
        rep,
        heading=lambda title: [f"## {title}", ""],
        text=lambda text: [text, ""],
        image=lambda s: [f"![{s.title}]({image_name})", ""] if image_name else [],
        table=lambda t: [*plot.md_table(t, _cell), ""],
    )
    return "\n".join([rundir.TEXT_MARK, f"# {rep.title}", "", f"**Status:** {rep.status}", "", *body])


def write_report(run_dir: str, out_html: Optional[str] = None) -> tuple[str, str, Report]:
    """Write the HTML report (default RUN/report.html), its Markdown twin (.md) and the
    curves beside it (.png, which the Markdown shows); return (html path, md path, report).
    Each replaces only a file gpt2lab wrote (system/rundir.py's rule), checked before any is written."""
    out_html = out_html or os.path.join(run_dir, "report.html")
    base = out_html[:-5] if out_html.endswith(".html") else out_html
    for path in (out_html, base + ".md", base + ".png"):
        rundir.check(path, rundir.FILE, "--out", "pick another --out")
    rep = build_report(run_dir)
    os.makedirs(os.path.dirname(os.path.abspath(out_html)), exist_ok=True)
    png = next((s.image_png for s in rep.sections if s.image_png), None)
    files = {base + ".png": png} if png else {}  # the image first: the Markdown shows it
    files[out_html] = to_html(rep).encode()
    files[base + ".md"] = to_markdown(rep, os.path.basename(base) + ".png" if png else None).encode()
    for path, data in files.items():
        with atomic_write(path, "wb") as fh:
            fh.write(data)
    return out_html, base + ".md", rep

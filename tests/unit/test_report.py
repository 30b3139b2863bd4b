"""gpt2lab report on runs made here: a finished run (by the real CLI), then copies of it
made running, stopped and crashed (a metrics.jsonl whose last line is cut)."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from conftest import records

from gpt2lab import cli
from gpt2lab.observe.report import build_report, write_report
from gpt2lab.system import rundir

pytest.importorskip("matplotlib", reason="the report's curves need matplotlib (plot extra)")
HOUR_AGO = time.time() - 3600


def copy_run(src: Path, dst: Path, drop_checkpoints=(), mtime: float | None = HOUR_AGO) -> Path:
    shutil.copytree(src, dst)
    for step in drop_checkpoints:
        shutil.rmtree(dst / "checkpoints" / f"step_{step:06d}")
    if mtime is not None:
        os.utime(dst / "metrics.jsonl", (mtime, mtime))
    return dst


def section(rep, title: str):
    return next(s for s in rep.sections if s.title.startswith(title))


def test_finished_run_report_html_and_markdown(finished_run, tmp_path, capsys):
    finished_run = copy_run(finished_run, tmp_path / "run", mtime=None)
    assert cli.main(["report", str(finished_run)]) == 0
    assert capsys.readouterr().out.startswith("finished: all 4 steps, final checkpoint step_000004")
    page = (finished_run / "report.html").read_text()
    assert not re.findall(r"""(?:src|href)\s*=\s*['"](?!data:)""", page)  # nothing fetched from elsewhere
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page).group(1))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    recs = records(finished_run)
    val = [r for r in recs if "val_loss" in r][-1]
    hs = [r for r in recs if "hellaswag_acc_norm" in r][-1]
    train = [r for r in recs if "train_loss" in r]
    samples = [r for r in recs if "sample" in r]
    rep = build_report(str(finished_run))
    results = section(rep, "Final metrics").table
    # Tiny Shakespeare: no FineWeb-Edu val loss beside its own; HellaSwag against OpenAI's (124M for scale)
    assert results[1][1] == f"{val['val_loss']:.4f} (step 4)" and results[1][2] == "-"
    assert results[2][1] == f"{hs['hellaswag_acc_norm']:.4f} (step 4)" and results[2][2:] == [0.2955, 0.337]
    speed = dict(map(tuple, section(rep, "How long").table[1:]))
    assert speed["tokens seen"] == f"{train[-1]['tokens']:,}" == "512"
    assert speed["time in training steps"] == f"0m {round(sum(r['dt_ms'] for r in train) / 1000):02d}s"
    what = dict(map(tuple, section(rep, "What was run").table[1:]))
    assert what["preset"] == "shakespeare-cpu" and what["command"].startswith("gpt2lab train --preset shakespeare-cpu")
    assert [row[0] for row in section(rep, "Checkpoints").table[1:]] == [2, 4]
    assert section(rep, "Samples").table[1:] == [[r["step"], r["sample"]] for r in samples] and len(samples) == 3
    assert all(html.escape(r["sample"]) in page for r in samples)
    md = (finished_run / "report.md").read_text()
    assert "**Status:** finished: all 4 steps" in md and "![Curves](report.png)" in md
    assert f"| HellaSwag acc_norm | {hs['hellaswag_acc_norm']:.4f} (step 4) | 0.2955 | 0.337 |" in md
    assert (finished_run / "report.png").read_bytes() == png


def test_crashed_run_with_a_cut_last_line(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "crashed", drop_checkpoints=[4], mtime=None)
    (run / "report.html").unlink(missing_ok=True)
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text + '{"step": 4, "train_lo')  # killed mid-write
    os.utime(run / "metrics.jsonl", (HOUR_AGO, HOUR_AGO))
    out_html, out_md, rep = write_report(str(run), str(tmp_path / "out" / "card.html"))
    last_train = max(r["step"] for r in records(finished_run) if "train_loss" in r)
    resume = json.loads((run / "run_info.json").read_text())["resume_with"]
    assert resume.startswith("`") and f" --out {finished_run} " in resume and resume.endswith(" --resume auto`")
    assert rep.status == (
        f"crashed: metrics.jsonl ends in a cut line (killed mid-write) at step {last_train} of 4; "
        f"{resume} continues from step 2"
    )
    assert out_md == str(tmp_path / "out" / "card.md") and "![Curves](card.png)" in Path(out_md).read_text()
    assert "crashed" in Path(out_html).read_text()
    assert not (run / "report.html").exists()  # --out elsewhere writes nothing in the run dir


def test_running_stopped_and_killed_runs(finished_run, tmp_path):
    # killed (kill -9) three seconds ago: its metrics.jsonl is fresh but no process holds the lock
    just_killed = copy_run(finished_run, tmp_path / "just_killed", drop_checkpoints=[4], mtime=time.time() - 3)
    assert (just_killed / rundir.LOCK_FILE).is_file() and rundir.holder(str(just_killed)) is None
    status = build_report(str(just_killed), curves=False).status
    assert re.match(
        r"crashed or killed at step 3 of 4 \(last record \d s ago\); `[^`]* train [^`]* --resume auto` "
        r"continues from step 2$",
        status,
    ), status
    # a run of a version that kept no lock file: only its last record can say it is live
    old = copy_run(finished_run, tmp_path / "old", drop_checkpoints=[4], mtime=time.time())
    os.remove(old / rundir.LOCK_FILE)
    assert build_report(str(old), curves=False).status.startswith("running: at step 3 of 4 (last record")
    locked = copy_run(finished_run, tmp_path / "locked", drop_checkpoints=[4])
    with rundir.lock(str(locked)):  # the run lock (system.rundir), held as a live run holds it
        assert (
            build_report(str(locked), curves=False).status
            == f"running: at step 3 of 4 (lock held by pid {os.getpid()})"
        )
    # the lock file of a run that was killed: no process holds the lock, so the run is not live
    assert build_report(str(locked), curves=False).status.startswith("crashed or killed at step 3 of 4")
    killed = copy_run(finished_run, tmp_path / "killed", drop_checkpoints=[4])
    status = build_report(str(killed), curves=False).status
    assert status.startswith("crashed or killed at step 3 of 4") and status.endswith("continues from step 2")
    stopped = copy_run(finished_run, tmp_path / "stopped", drop_checkpoints=[4])
    lines = (stopped / "metrics.jsonl").read_text().splitlines(keepends=True)
    (stopped / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] < 2))
    shutil.rmtree(stopped / "checkpoints" / "step_000002")
    shutil.copytree(finished_run / "checkpoints" / "step_000002", stopped / "checkpoints" / "step_000002")
    os.utime(stopped / "metrics.jsonl", (HOUR_AGO, HOUR_AGO))
    assert build_report(str(stopped), curves=False).status.startswith("stopped at step 1 of 4 with a checkpoint there")


def test_events_and_new_run_info_keys_are_shown(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "events")
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 3, "skipped": "nan", "loss": "nan", "grad_norm": "nan", "lr": 0.001}) + "\n")
        fh.write(json.dumps({"step": 3, "spike": 7.5, "rollback": "step_000002"}) + "\n")
    info = json.loads((run / "run_info.json").read_text())
    info["autocast"] = {"chosen": "bfloat16", "reason": "CPU with AMX: bf16 matmuls are fastest"}
    (run / "run_info.json").write_text(json.dumps(info))
    rep = build_report(str(run), curves=False)
    assert section(rep, "Skipped").table[1:] == [
        [3, "skipped nan, loss nan, grad_norm nan, lr 0.001"],
        [3, "spike 7.5, rollback step_000002"],
    ]
    env = dict(map(tuple, section(rep, "Environment").table[1:]))
    assert env["autocast.chosen"] == "bfloat16" and env["autocast.reason"].startswith("CPU with AMX")


def test_report_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nothing")]) == 1
    assert capsys.readouterr().err == f"gpt2lab report: {tmp_path / 'nothing'}: no such run directory\n"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    assert cli.main(["report", str(tmp_path / "bad")]) == 1
    assert capsys.readouterr().err.startswith(f"gpt2lab report: {tmp_path / 'bad' / 'metrics.jsonl'}:2: not valid JSON")


# -- only what applies: a faked run directory ---------------------------------------------------
def fake_run(path: Path, *, source: str, val_steps=(0, 4), hellaswag=False, info: dict | None = None) -> Path:
    """A run directory as train writes it, made up: config.json, run_info.json (its plan naming the data's
    source), metrics.jsonl with train losses at steps 0-4 and validation at ``val_steps``."""
    path.mkdir(parents=True)
    config = {"format_version": 2, "data": "data/x", "model": {"n_layer": 2, "n_head": 2, "n_embd": 64}}
    config["optim"] = {"max_steps": 5}
    (path / "config.json").write_text(json.dumps(config))
    base = {"format": "gpt2lab-run", "command": ["/venv/bin/gpt2lab", "train", "--preset", "wiki-cpu"]}
    info = dict(info or {})
    plan = {"data_source": source, **info.pop("plan", {})}  # last, as train writes it
    (path / "run_info.json").write_text(json.dumps({**base, **info, "plan": plan}))
    lines = [
        {"step": s, "train_loss": 9.0 - s, "dt_ms": 10.0, "tok_per_s": 1e4, "tokens": 64 * (s + 1)} for s in range(5)
    ]
    lines += [{"step": s, "val_loss": 8.5 - s} for s in val_steps]
    if hellaswag:
        lines += [{"step": 4, "hellaswag_acc": 0.24, "hellaswag_acc_norm": 0.25, "hellaswag_n": 10}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_two_validation_points_are_drawn_as_points_and_no_baseline_of_another_corpus(tmp_path):
    from gpt2lab.observe import plot

    run = fake_run(tmp_path / "wiki", source="/data/wikipedia")
    fig = plot.build_figure([plot.load_run(str(run))])
    assert len(fig.axes) == 1  # no HellaSwag results: no HellaSwag panel
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    assert set(lines) == {"wiki train loss", "wiki val loss"}  # no FineWeb-Edu line on Wikipedia
    assert lines["wiki val loss"].get_marker() == "o" and list(lines["wiki val loss"].get_xdata()) == [0, 4]
    rep = build_report(str(run), curves=False)
    assert section(rep, "Final metrics").table == [
        ["metric", "this run"],
        ["val loss (the run's val split)", "4.5000 (step 4)"],
    ]
    many = fake_run(tmp_path / "long", source="x", val_steps=range(0, 5 * (plot.MARKED_UP_TO + 1), 5))
    val = next(x for x in plot.build_figure([plot.load_run(str(many))]).axes[0].lines if "val" in x.get_label())
    assert val.get_marker() in ("None", "", None)  # enough points to be a curve


@pytest.mark.parametrize("source", ["fineweb-edu", "HuggingFaceFW/fineweb-edu", "/data/edu_fineweb10B"])
def test_fineweb_edu_runs_get_gpt2s_val_loss_and_hellaswag_its_panel(tmp_path, source):
    from gpt2lab.observe import plot

    run = fake_run(tmp_path / "fw", source=source, hellaswag=True)
    ax_loss, ax_hs = plot.build_figure([plot.load_run(str(run))]).axes
    flat = {line.get_ydata()[0] for line in ax_loss.lines if len(set(line.get_ydata())) == 1}
    assert flat == {plot.GPT2_124M_VAL_LOSS} and ax_hs.get_title() == "HellaSwag"
    table = section(build_report(str(run), curves=False), "Final metrics against").table
    assert table[1][2] == plot.GPT2_124M_VAL_LOSS  # 2 x 64 is no GPT-2 size: 124M's, for scale, as the card says
    assert table[2] == ["HellaSwag acc_norm", "0.2500 (step 4)", 0.2955, 0.337]


def test_each_fact_of_run_info_is_shown_once(tmp_path):
    choices = {"dtype": "float32", "dtype_reason": "fp32 is faster here", "strategy": "ddp"}
    plan = {
        "data_source": "x",
        "facts": {"dtype": "float32", "dtype_reason": "fp32 is faster here", "world_size": 1},
        "dtype": {"value": "float32", "reason": "fp32 is faster here"},
        "strategy": {"value": "ddp", "reason": "one process"},
        "config": {"optim": {"max_lr": 0.001}},
    }
    run = fake_run(tmp_path / "r", source="x", info={"choices": choices, "plan": plan, "params": 5})
    env = section(build_report(str(run), curves=False), "Environment").table[1:]
    keys = [k for k, _ in env]
    assert "choices.dtype" in keys and "choices.dtype_reason" in keys and "choices.strategy" in keys
    assert "plan.facts.world_size" in keys and "plan.strategy.reason" in keys and "params" in keys
    for gone in (
        "plan.facts.dtype",
        "plan.facts.dtype_reason",
        "plan.dtype.value",
        "plan.dtype.reason",
        "plan.strategy.value",
        "plan.config.optim.max_lr",
    ):
        assert gone not in keys
    assert sum(v == "fp32 is faster here" for _, v in env) == 1


def test_a_stopped_runs_card_says_the_command_its_start_recorded(tmp_path):
    said = "`gpt2lab train --preset chat-cpu --init-from runs/base --out runs/chat --resume auto`"
    run = fake_run(tmp_path / "r", source="x", info={"resume_with": said})
    os.makedirs(run / "checkpoints" / "step_000005")  # not a complete checkpoint: none counted
    status = build_report(str(run), now=time.time() + 3600, curves=False).status
    assert status.endswith("no checkpoint was saved: start again")
    from gpt2lab.observe.report import continue_command

    assert continue_command({"resume_with": said}) == said
    typed = {"command": ["/v/bin/gpt2lab", "train", "--preset", "p", "--resume", "runs/a/checkpoints/step_000002"]}
    assert continue_command(typed) == "`gpt2lab train --preset p --resume auto`"
    assert continue_command({"command": ["/v/bin/gpt2lab", "demo"]}) == "`--resume auto`"

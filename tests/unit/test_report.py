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
    assert results[1][1] == f"{val['val_loss']:.4f} (step 4)" and results[1][2] == 3.2924
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
    assert rep.status == (
        f"crashed: metrics.jsonl ends in a cut line (killed mid-write) at step {last_train} of 4; "
        "`--resume auto` continues from step 2"
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
        r"crashed or killed at step 3 of 4 \(last record \d s ago\); `--resume auto` continues from "
        r"step 2$",
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


def test_report_errors_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no such run directory"):
        cli.main(["report", str(tmp_path / "nothing")])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2: not valid JSON"):
        cli.main(["report", str(tmp_path / "bad")])

"""A run directory belongs to one run (gpt2lab.system.rundir): train writes only into a missing,
empty or gpt2lab run directory; a live run holds an OS lock that a second train meets at once,
that report/plot/sample only mention, and that kill -9 of the holder never leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_args, env, train_cmd

from gpt2lab import cli
from gpt2lab.system import rundir

HOLD = """
import sys, time
from gpt2lab.system import rundir
with rundir.claim(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def _tree(root) -> dict:
    return {os.path.join(d, f): Path(d, f).read_bytes() for d, _, files in os.walk(root) for f in files}


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_train_refuses_someones_files_and_an_export(tiny_data, tmp_path, capsys, gpt2_vocab_export):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "settings"}')
    (mine / "metrics.jsonl").write_text("my numbers\n")
    _, export = gpt2_vocab_export
    before = _tree(tmp_path), _tree(export)
    assert cli.main(["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(mine))]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--out {mine}: holds files that gpt2lab did not write (2 entries: config.json, metrics.jsonl)" in line
    assert "choose a new or empty --out" in line
    assert cli.main(["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=export)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "holds a gpt2lab export (gpt2lab_export.json" in line and "nothing was written" in line
    assert (_tree(tmp_path), _tree(export)) == before  # not a byte changed
    assert rundir.inspect(export).kind == rundir.EXPORT


def test_prepare_and_export_refuse_a_run_directory(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(run), max_steps=1)]) == 0
    capsys.readouterr()
    before = _tree(run)
    assert cli.main(["prepare", "--source", "tinyshakespeare", "--out", str(run)]) != 0
    assert "holds a gpt2lab run (run_info.json); nothing was written there" in _one_line(capsys.readouterr().err)
    assert cli.main(["export", str(run), str(run)]) == 2
    assert "a gpt2lab run (run_info.json)" in _one_line(capsys.readouterr().err)
    assert _tree(run) == before


def test_failed_start_leaves_no_directory(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "run"
    assert (
        cli.main(
            [
                "train",
                "--preset",
                "shakespeare-cpu",
                "--out",
                str(out),
                "--data",
                str(tmp_path / "none"),
                "--hellaswag-interval",
                "0",
                "--init-from",
                str(tmp_path / "missing"),
            ]
        )
        == 2
    )
    capsys.readouterr()
    assert os.listdir(tmp_path) == []  # the run dir and the parents it made are gone again


def test_lock_is_held_by_a_live_process_and_freed_by_kill_9(tmp_path):
    """Two real processes: the holder (killed with -9) and this one."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        who = rundir.holder(str(run))
        assert who["pid"] == holder.pid and who["host"] == os.uname().nodename
        t0 = time.monotonic()
        with pytest.raises(rundir.DirectoryError) as err:
            with rundir.claim(str(run)):
                pass
        assert time.monotonic() - t0 < 5
        assert f"is in use by another run (pid {holder.pid} on {os.uname().nodename}, started " in str(err.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert rundir.holder(str(run)) is None  # the kernel dropped it with the process
    with rundir.claim(str(run)):
        assert rundir.holder(str(run))["pid"] == os.getpid()
    assert rundir.holder(str(run)) is None


@pytest.mark.slow
def test_second_train_refuses_readers_say_live_and_kill_9_then_resume(tiny_data, tmp_path, capsys):
    """A real `gpt2lab train` process holds the run; this process is the second train (refused at
    once, naming the first), report and sample (they read the live run); after kill -9 of the
    first, a new run on the directory starts and resumes from its last checkpoint."""
    run = tmp_path / "run"
    first = subprocess.Popen(
        train_cmd(data=tiny_data, out=str(run), max_steps=100000, ckpt_interval=2, keep_checkpoints=2),
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    argv = ["train", "--preset", "shakespeare-cpu"]
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints").is_dir() or not list((run / "checkpoints").glob("step_*")):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() else ""
            time.sleep(0.2)
        t0 = time.monotonic()
        assert cli.main([*argv, *cli_args(data=tiny_data, out=str(run), max_steps=3)]) == 2
        assert time.monotonic() - t0 < 10  # at once: no waiting for the holder
        assert f"is in use by another run (pid {first.pid} on " in _one_line(capsys.readouterr().err)
        assert cli.main(["report", str(run), "--out", str(tmp_path / "report.html")]) == 0
        assert f"lock held by pid {first.pid}" in capsys.readouterr().out
        assert (
            cli.main(["sample", "--model", str(run), "--max-new-tokens", "2", "--device", "cpu", "--dtype", "float32"])
            == 0
        )
        assert f"is a live run (pid {first.pid}" in capsys.readouterr().err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    assert cli.main([*argv, *cli_args(data=tiny_data, out=str(run), max_steps=steps[-1] + 1), "--resume", "auto"]) == 0
    info = json.loads((run / "run_info.json").read_text())
    assert info["plan"]["resume"].endswith(f"step_{steps[-1]:06d}") and rundir.holder(str(run)) is None

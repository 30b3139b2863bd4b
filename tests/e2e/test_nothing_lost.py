"""Nothing lost, ever: no command deletes what it did not write, a full disk or a cut log never
blocks the next run, damaged checkpoints are named (and skipped by --resume auto), every error is
one line with a documented exit code, Ctrl-C/SIGTERM stop cleanly, and loss spikes are skipped.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, cli_args, env, records, train_cmd, train_losses

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.cli import build_parser, main
from gpt2lab.distributed.dist import DistInfo
from gpt2lab.system import files
from gpt2lab.system.errors import EXIT_CODES, DiskFullError
from gpt2lab.train.run import train
from gpt2lab.train.settings import load_preset

CPU = torch.device("cpu")


def _cfg(data, out, **fields):
    return load_preset("shakespeare-cpu", **{**TINY, "data": data, "out": str(out), **fields})


def _argv(data, out, *extra, **fields) -> list[str]:
    return ["train", "--preset", "shakespeare-cpu", *cli_args(data=data, out=str(out), **fields), *extra]


def _one_line(err: str) -> str:
    """The error line (warnings printed before it are allowed); there must be no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("gpt2lab") and ": note: " not in line]
    assert len(lines) == 1, err
    return lines[0]


def _snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in Path(root).rglob("*")}


@pytest.fixture(scope="module")
def run_dir(tiny_data, tmp_path_factory) -> str:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("lost") / "run"
    train(_cfg(tiny_data, out, max_steps=4, ckpt_interval=2, keep_checkpoints=0), DistInfo(device=CPU))
    return str(out)


@pytest.fixture
def run_copy(run_dir, tmp_path) -> str:
    dst = tmp_path / "parent" / "run"
    shutil.copytree(run_dir, dst)
    return str(dst)


# -- 1. no command writes over or into what gpt2lab did not write ------------------------------
def test_every_writing_command_leaves_the_users_directory_and_file_as_they_were(run_copy, tiny_data, tmp_path, capsys):
    """Every command that writes (train, prepare, tokenizer train, export, report, plot, compare, eval
    gsm8k --samples), pointed at a directory of the user's and at a file of the user's: exit 2, one line
    naming the path and what to do, and not a byte of anything there changed (system/rundir.check)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text("my notes")  # a name prepare and tokenizer train write
    for name, text in (("mine.html", "<p>my page</p>"), ("card.md", "my card"), ("mine.png", "my picture")):
        (tmp_path / name).write_text(text)
    (tmp_path / "mine.jsonl").write_text('{"my": "rows"}\n')
    html, card, png, rows = (str(tmp_path / n) for n in ("mine.html", "card.md", "mine.png", "mine.jsonl"))
    commands = [  # (argv for a path, the user's file it is pointed at, the path the refusal names)
        (lambda p: _argv(tiny_data, p), html, html),
        (lambda p: ["prepare", "--source", "tinyshakespeare", "--out", p, "--quiet"], html, html),
        (
            lambda p: ["tokenizer", "train", "--source", "tinyshakespeare", "--vocab-size", "300", "--out", p],
            html,
            html,
        ),
        (lambda p: ["export", run_copy, p], html, html),
        (lambda p: ["report", run_copy, "--out", p], html, html),
        (lambda p: ["report", run_copy, "--out", p], str(tmp_path / "card.html"), card),  # its .md beside
        (lambda p: ["plot", run_copy, "--out", p], png, png),
        (lambda p: ["compare", run_copy, run_copy, "--metric", "train_loss", "--out", p], png, png),
        (lambda p: ["eval", "gsm8k", "--model", run_copy, "--data", rows, "--samples", p], rows, rows),
    ]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for argv, theirs, named in commands:
        for target, said in ((str(mine), str(mine)), (theirs, named)):
            assert main(argv(target)) == 2, argv(target)
            line = _one_line(capsys.readouterr().err)
            assert (
                f" {said}: " in line
                and "nothing was written there; " in line
                and ("choose a new or empty" in line or "pick another" in line)
            ), line
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_export_refuses_the_run_and_its_parent_and_replaces_its_own_export(run_copy, tmp_path, capsys):
    before = _snapshot(tmp_path)
    for out in (run_copy, os.path.dirname(run_copy)):
        assert main(["export", run_copy, out]) == 2
        line = _one_line(capsys.readouterr().err)
        assert f"{out}: holds " in line and "nothing was written there" in line
    assert _snapshot(tmp_path) == before  # not one file touched
    fresh = tmp_path / "hf"
    for _ in range(2):  # the second time it replaces its own earlier export
        assert main(["export", run_copy, str(fresh)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(fresh).st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp_")]


# -- 2. temporaries of killed runs are swept, only theirs and only under OUT ---------------------
def test_startup_sweeps_dead_processes_temporaries_only(run_copy, tiny_data, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ck = Path(run_copy, "checkpoints")
        (ck / f".tmp_step_000006_{dead.pid}").mkdir()
        (ck / f".tmp_step_000006_{dead.pid}" / "model.safetensors").write_bytes(b"x" * 1000)
        (ck / f".tmp_step_000008_{live.pid}").mkdir()  # a run writing right now
        Path(run_copy, f".tmp_config.json_{dead.pid}").write_text("{")
        elsewhere = tmp_path / f".tmp_step_000006_{dead.pid}"  # not under OUT
        elsewhere.mkdir()
        with pytest.warns(UserWarning, match="left by stopped runs"):
            train(_cfg(tiny_data, run_copy, max_steps=5, keep_checkpoints=0), DistInfo(device=CPU), "auto")
        assert sorted(os.listdir(ck)) == [f".tmp_step_000008_{live.pid}", "step_000002", "step_000004", "step_000005"]
        assert not os.path.exists(Path(run_copy, f".tmp_config.json_{dead.pid}")) and elsewhere.exists()
    finally:
        live.kill()
        live.wait()


# -- 3. a full disk while saving: one line, no temporary, --resume auto works --------------------
def _torch_style_failure(obj, path, *args, **kwargs):
    Path(path).write_bytes(b"PK partial")  # what a cut zip write leaves behind
    raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4480 vs 4374")


def _safetensors_failure(tensors, path, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", path)


@pytest.mark.parametrize("where", ["torch.save", "safetensors"])
def test_disk_full_during_checkpoint_then_resume_auto(where, tiny_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    fail = _torch_style_failure if where == "torch.save" else _safetensors_failure
    real = torch.save if where == "torch.save" else ckpt.save_file

    def failing_at_step_4(obj, path, *args, **kwargs):
        return (fail if "step_000004" in str(path) else real)(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_at_step_4) if where == "torch.save" else monkeypatch.setattr(
        ckpt, "save_file", failing_at_step_4
    )
    argv = _argv(tiny_data, out, max_steps=4, ckpt_interval=2)
    assert main(argv) == 4
    line = _one_line(capsys.readouterr().err)
    assert "disk full while writing" in line and "step_000004" in line and "--resume auto" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000002"]  # its temporary removed
    assert not [n for n in os.listdir(out) if n.startswith(".tmp_")]
    monkeypatch.undo()
    assert main(argv + ["--resume", "auto"]) == 0
    assert sorted(train_losses(out)) == [0, 1, 2, 3]


def test_atomic_write_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    files.write_json(str(path), {"old": 1})
    monkeypatch.setattr(files.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(DiskFullError, match=f"disk full while writing {path}"):
        files.write_json(str(path), {"new": 2})
    assert json.loads(path.read_text()) == {"old": 1} and os.listdir(tmp_path) == ["config.json"]


# -- 4. a metrics.jsonl whose last line was cut ------------------------------------------------
def test_cut_metrics_line_is_dropped_with_a_warning(run_copy, tiny_data, tmp_path):
    metrics = Path(run_copy, "metrics.jsonl")
    with open(metrics, "a") as fh:
        fh.write('{"step": 4, "train_lo')  # the disk filled mid-line
    with pytest.warns(UserWarning, match=f"{metrics}: dropped 1 unreadable line"):
        train(_cfg(tiny_data, run_copy, max_steps=5), DistInfo(device=CPU), "auto")
    assert sorted(train_losses(run_copy)) == [0, 1, 2, 3, 4]
    fresh = tmp_path / "fresh"
    fresh.mkdir()  # a run killed at its first steps: its mark (system.rundir), a cut metrics line, no checkpoint
    (fresh / "run_info.json").write_text('{"format": "gpt2lab-run", "version": 1}\n')
    (fresh / "metrics.jsonl").write_text('{"step": 0, "train_loss": 1.0}\n{"step": 1, "tr')
    with pytest.warns(UserWarning, match="metrics.jsonl: dropped 1"):
        train(_cfg(tiny_data, fresh, max_steps=1), DistInfo(device=CPU))
    assert sorted(train_losses(fresh)) == [0]


# -- damaged and mismatched checkpoints --------------------------------------------------------
def test_damaged_checkpoint_is_one_line_for_every_command(run_copy, tiny_data, tmp_path, capsys):
    newest = os.path.join(run_copy, "checkpoints", "step_000004")
    weights = Path(newest, "model.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    commands = [  # each named the damaged checkpoint itself: refused, the one before it in the command's own flag
        (["sample", "--model", newest, "--device", "cpu", "--max-new-tokens", "1"], "--model"),
        (["eval", "loss", "--model", newest, "--data", tiny_data, "--tokens", "64", "--device", "cpu"], "--model"),
        (["export", newest, str(tmp_path / "hf")], "SRC"),
        (_argv(tiny_data, run_copy, "--resume", newest, max_steps=6), "--resume"),
    ]
    for argv, flag in commands:
        assert main(argv) == 3, argv
        line = _one_line(capsys.readouterr().err)
        assert f"checkpoint {newest} is damaged: model.safetensors does not match its checksum" in line
        assert line.endswith(f"use an earlier one: {flag} " + os.path.join(run_copy, "checkpoints", "step_000002"))


@pytest.mark.parametrize("checksums", [None, "garbage", "[]", '{"state.pt": "00"}'])
def test_a_checkpoint_its_checksums_cannot_vouch_for_is_named_by_every_reader(run_copy, tiny_data, capsys, checksums):
    """A checksums.json missing, unreadable or leaving files out (here beside a garbage state.pt, which
    unpickles to nothing): one rule for every reader. train passes the checkpoint over, saying so and
    why; sample refuses it in one line naming the file; neither shows a traceback."""
    newest = Path(run_copy, "checkpoints", "step_000004")
    (newest / "state.pt").write_bytes(b"\xc9" * 3000)
    os.remove(newest / ckpt.CHECKSUMS)
    if checksums is not None:
        (newest / ckpt.CHECKSUMS).write_text(checksums)
    why = {None: "unreadable (No such file or directory)", "garbage": "unreadable (Expecting value"}
    said = f"checksums.json {why.get(checksums, 'leaves out ')}"
    assert main(["sample", "--model", str(newest), "--device", "cpu", "--max-new-tokens", "1"]) == 3
    assert f"checkpoint {newest} is damaged: {said}" in _one_line(capsys.readouterr().err)
    assert main(_argv(tiny_data, run_copy, "--resume", "auto", max_steps=5)) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged ({said}" in err and "trying the one before it" in err, err
    assert "Traceback" not in err and sorted(train_losses(run_copy)) == [0, 1, 2, 3, 4]


def test_garbage_state_pt_is_a_damaged_checkpoint_not_a_traceback(run_copy):
    """Its bytes unpickle to nothing (UnpicklingError, no OSError): the shared reader names the file."""
    newest = os.path.join(run_copy, "checkpoints", "step_000004")
    Path(newest, "state.pt").write_bytes(b"\xc9" * 3000)
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint {newest} is damaged: UnpicklingError"):
        ckpt.read_state(newest)


def test_every_reader_of_a_run_passes_over_its_damaged_newest_checkpoint_alike(run_copy, tiny_data, tmp_path):
    """One checkpoint rule (weights.load.checkpoint_of), in real processes: with a run's newest checkpoint
    damaged, sample, export, train --init-from and train --resume auto all read the one before it, and each
    names the damaged one on stderr."""
    from safetensors.torch import load_file, save_file

    from gpt2lab.weights.load import load_model

    newest, before = (os.path.join(run_copy, "checkpoints", f"step_00000{n}") for n in (4, 2))
    weights = os.path.join(newest, "model.safetensors")  # zeros: a model read from them would say "!!!..."
    save_file({k: torch.zeros_like(v) for k, v in load_file(weights).items()}, weights)
    greedy = ["sample", "--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0", "--device", "cpu"]
    commands = {
        "sample": [*greedy, "--model", run_copy],
        "reference": [*greedy, "--model", before],  # the checkpoint before it, named itself
        "export": ["export", run_copy, str(tmp_path / "hf")],
        "init": _argv(tiny_data, tmp_path / "new", "--init-from", run_copy, "--dry-run"),
        "resume": _argv(tiny_data, run_copy, "--resume", "auto", "--dry-run"),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "gpt2lab", *argv],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in commands.items()
    }
    out = {name: p.communicate(timeout=300) for name, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), out
    said = f"checkpoint {newest} is damaged (model.safetensors does not match its checksum"
    for name, (_, err) in out.items():
        assert (said in err and "trying the one before it" in err) == (name != "reference"), (name, err)
    assert out["sample"][0] == out["reference"][0] and "!!!!" not in out["sample"][0], out["sample"]
    x = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(str(tmp_path / "hf"))(x)[0], load_model(before)(x)[0][..., :50257])
    assert f"init from {run_copy} (checkpoint, step 2, sha256:" in out["init"][0], out["init"]
    assert f"(resume from {before})" in out["resume"][0], out["resume"]


def test_resume_auto_skips_a_corrupt_checkpoint_and_says_so(run_copy, tiny_data, capsys):
    weights = Path(run_copy, "checkpoints", "step_000004", "model.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensor data: loads fine, wrong weights
    weights.write_bytes(bytes(data))
    assert main(_argv(tiny_data, run_copy, "--resume", "auto", max_steps=5)) == 0
    cap = capsys.readouterr()
    assert "step_000004 is damaged (model.safetensors does not match its checksum" in cap.err
    assert "resumed from " + os.path.join(run_copy, "checkpoints", "step_000002") in cap.out
    assert sorted(train_losses(run_copy)) == [0, 1, 2, 3, 4]


# -- the command line ----------------------------------------------------------------------
def test_no_abbreviations_negative_values_and_documented_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "shakespeare-cpu", "--max-step", "5"])
    assert e.value.code == 2 and "unrecognized arguments: --max-step 5" in capsys.readouterr().err
    assert main(["train", "--preset", "shakespeare-cpu", "--max-lr", "-1e-3"]) == 2
    assert "max_lr -0.001" in _one_line(capsys.readouterr().err)  # the value reached validation
    helptext = build_parser().format_help()
    readme = (ROOT / "README.md").read_text()
    for code in EXIT_CODES:
        assert f"  {code:3d}  " in helptext and f"| {code} |" in readme


def test_ctrl_c_during_startup_is_one_line(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("gpt2lab.commands.train.request_from", interrupted)
    assert main(["train", "--preset", "shakespeare-cpu"]) == 130
    assert _one_line(capsys.readouterr().err) == "gpt2lab train: interrupted"


def _start(tiny_data, out, *extra):
    cmd = train_cmd(data=tiny_data, out=str(out), max_steps=100000, ckpt_interval=0) + list(extra)
    return subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_steps(proc, out, n: int) -> None:
    deadline = time.time() + 600  # generous: a shared machine can starve the child for minutes
    while not (out / "metrics.jsonl").exists() or len(train_losses(out)) < n:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"run ended (rc {proc.returncode}) or stalled before step {n}: {proc.communicate()}")
        time.sleep(0.01)


def test_ctrl_c_once_finishes_the_step_and_saves(tiny_data, tmp_path):
    out = tmp_path / "run"
    proc = _start(tiny_data, out)
    _wait_steps(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    stdout, err = proc.communicate(timeout=600)
    assert proc.returncode == 130 and "Ctrl-C: stopping after this step, saving" in err
    assert "Traceback" not in err and err.rstrip().endswith(" --resume auto`")
    saved = ckpt.find_latest(str(out))
    ckpt.verify(saved)
    assert int(saved.split("_")[-1]) == len(train_losses(out))  # every logged step is in the checkpoint


def test_sigterm_during_a_long_sample_saves_at_once_and_the_resume_goes_on_as_if_never_stopped(tiny_data, tmp_path):
    """A training-time sample of a million tokens (hours here) at step 6: SIGTERM during it stops it at its
    next token, unlogged; the 6 steps are saved and the run exits 143 at once. The resumed run samples
    step 6 again and trains on to the losses of a run never stopped (one thread each, as a subprocess)."""
    fields = dict(max_steps=8, min_lr=TINY["max_lr"], ckpt_interval=0, keep_checkpoints=0)  # max_steps moves no rate
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess (conftest.env: OMP_NUM_THREADS=1): the same sums
    try:
        train(_cfg(tiny_data, tmp_path / "straight", **fields), DistInfo(device=CPU))
        out = tmp_path / "run"
        train(_cfg(tiny_data, out, **{**fields, "max_steps": 4}), DistInfo(device=CPU))
        long = dict(data=tiny_data, out=str(out), sample_interval=6, sample_tokens=10**6, **fields)
        cmd = train_cmd(**long) + ["--resume", "auto"]
        proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_steps(proc, out, 6)  # steps 0-5 logged: the sample of step 6 is next
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=120)  # without a look at the flag per token: hours
        assert proc.returncode == 143 and "Traceback" not in err, err
        assert sorted(os.listdir(out / "checkpoints")) == ["step_000004", "step_000006"]
        assert not [r for r in records(out) if "sample" in r and r["step"] >= 6]  # cut short: not logged
        train(
            _cfg(tiny_data, out, **{**fields, "sample_interval": 6, "sample_tokens": 4}), DistInfo(device=CPU), "auto"
        )
    finally:
        torch.set_num_threads(threads)
    assert [r["step"] for r in records(out) if "sample" in r] == [6, 8]  # step 6 again, and the end's
    straight, again = train_losses(tmp_path / "straight"), train_losses(out)
    assert sorted(again) == list(range(8))
    for step in range(8):
        assert abs(again[step] - straight[step]) <= 1e-6, (step, again[step], straight[step])


def test_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(tiny_data, tmp_path, monkeypatch, capsys):
    from gpt2lab.train.trainer import Trainer, _stop_on_signals

    trainer = Trainer.from_config(_cfg(tiny_data, tmp_path), DistInfo(device=CPU))
    trainer.step = 1
    good = trainer.save()
    with _stop_on_signals(trainer):
        os.kill(os.getpid(), signal.SIGINT)  # the first: noted, the step goes on
        assert trainer.stop_requested and trainer.stop_signal == signal.SIGINT
        assert "Ctrl-C: stopping after this step" in capsys.readouterr().err

        def second_ctrl_c_mid_save(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler raises KeyboardInterrupt here

        monkeypatch.setattr(torch, "save", second_ctrl_c_mid_save)
        trainer.step = 2
        with pytest.raises(KeyboardInterrupt):
            trainer.save()
    assert ckpt.find_latest(str(tmp_path)) == good and os.listdir(tmp_path / "checkpoints") == ["step_000001"]
    ckpt.verify(good)


# -- prepare -------------------------------------------------------------------------------
def test_prepare_errors_are_one_line(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    src = tmp_path / "text.txt"
    src.write_text("To be, or not to be, that is the question. " * 200)
    assert main(["prepare", "--source", str(src), "--out", str(a_file), "--quiet"]) == 2
    assert f"--out {a_file}: is a file, not a directory" in _one_line(capsys.readouterr().err)
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    assert main(["prepare", "--source", str(fake), "--out", str(tmp_path / "o1"), "--quiet"]) == 1
    assert f"{fake}: not a readable Parquet file" in _one_line(capsys.readouterr().err)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.warns(UserWarning, match=f"{empty}: empty text file"):
        assert main(["prepare", "--source", str(empty), "--out", str(tmp_path / "o2"), "--quiet"]) == 1
    assert "are empty" in _one_line(capsys.readouterr().err)
    bad = tmp_path / "bad.jsonl"  # a malformed line after 2,000 documents
    bad.write_text((json.dumps({"text": "To be, or not to be."}) + "\n") * 2000 + "{not json\n")
    assert main(["prepare", "--source", str(bad), "--out", str(tmp_path / "o3"), "--shard-tokens", "500"]) == 1
    assert f"{bad}:2001: not valid JSON" in _one_line(capsys.readouterr().err)
    for out in ("o2", "o3"):  # training on what a failed prepare left: it says so, not "no shards"
        assert main(_argv(tmp_path / out, tmp_path / "run")) == 1  # bad input: the data
        assert _one_line(capsys.readouterr().err).endswith(
            f"{tmp_path / out / 'manifest.json'}: `gpt2lab prepare` has not finished this directory (source "
            f"{str(empty if out == 'o2' else bad)!r}: it stopped, failed or is still running); run the same "
            "prepare command again to finish it"
        )
    assert main(["prepare", "--source", "/dev/zero", "--out", str(tmp_path / "o4")]) == 1
    assert _one_line(capsys.readouterr().err) == (
        "gpt2lab prepare: --source '/dev/zero': not a file or a directory (a device, pipe or socket); name files"
    )


def test_prepare_disk_full_then_rerun_resumes(tmp_path, capsys, monkeypatch):
    src = tmp_path / "text.txt"
    src.write_text("To be, or not to be, that is the question. " * 400)
    args = ["--source", str(src), "--shard-tokens", "500", "--val-tokens", "500", "--workers", "1", "--quiet"]
    calls = {"n": 0}
    real = files.os.fsync

    def fills_up(fd):
        calls["n"] += 1
        if calls["n"] == 6:  # a few shards and manifests in
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fills_up)
    out = tmp_path / "out"
    assert main(["prepare", "--out", str(out), *args]) == 4
    line = _one_line(capsys.readouterr().err)
    assert "disk full while writing" in line and "run the same prepare command again" in line
    assert not [n for n in os.listdir(out) if n.startswith(".tmp_")]
    monkeypatch.undo()
    assert main(["prepare", "--out", str(out), *args]) == 0
    assert main(["prepare", "--out", str(tmp_path / "ref"), *args]) == 0
    for name in os.listdir(tmp_path / "ref"):
        if name.endswith(".bin"):
            assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


# -- the loss-spike guard ------------------------------------------------------------------
POISON_STEPS = (17, 20)  # these steps' batches are random token ids (loss ~ ln 50304 = 10.8)
# A 6-step window and z 4 (default 100 and 6) so a 30-step run can show it; the clean run
# below checks that even these tighter settings never fire on healthy data.
GUARD = dict(
    max_steps=30,
    ckpt_interval=8,
    keep_checkpoints=0,
    eval_interval=30,
    eval_tokens=1024,
    spike_window=6,
    spike_loss_z=4.0,
    spike_rollback=2,
)


def _poison(src: str, dst: Path) -> None:
    """A copy of ``src`` whose tokens that epoch 0 reads at POISON_STEPS are random ids."""
    from gpt2lab.data.loader import TokenLoader
    from gpt2lab.data.shards import open_shard, write_shard
    from gpt2lab.data.tokenizer import EOT_ID

    shutil.copytree(src, dst)
    loader = TokenLoader(src, "train", TINY["micro_batch_size"], TINY["seq_len"], seed=TINY["seed"])
    assert len(loader.paths) == 1
    view = loader._view(0, 0)  # shard 0's documents in epoch 0's order
    tokens = np.array(open_shard(loader.paths[0]))
    per_step = TINY["total_batch_tokens"]
    stream = np.arange(POISON_STEPS[0] * per_step, (POISON_STEPS[1] + 1) * per_step)  # ordered-stream offsets
    doc = np.searchsorted(view.cum, stream, side="right") - 1
    raw = view.starts[doc] + stream - view.cum[doc]  # where each offset lives in the shard file
    raw = raw[tokens[raw] != EOT_ID]  # documents keep their boundaries, so the order stays the same
    tokens[raw] = np.random.default_rng(0).integers(0, EOT_ID, len(raw))
    write_shard(dst / loader.paths[0].name, tokens.astype(np.uint16))


def _val(run) -> float:
    return [r["val_loss"] for r in records(run) if "val_loss" in r][-1]


@pytest.mark.slow  # two 30-step training runs, ~16-22 s: `make test-slow`
def test_spike_guard_skips_and_rolls_back_poisoned_data(tiny_data, tmp_path):
    poisoned = tmp_path / "poisoned"
    _poison(tiny_data, poisoned)
    clean, guarded = tmp_path / "clean", tmp_path / "guarded"
    train(_cfg(tiny_data, clean, **GUARD), DistInfo(device=CPU))
    train(_cfg(str(poisoned), guarded, **GUARD), DistInfo(device=CPU))
    assert not [r for r in records(clean) if "skipped" in r or "rollback_to" in r]  # healthy: never fires
    recs = records(guarded)
    spikes = [r["step"] for r in recs if r.get("skipped") == "spike"]
    rollbacks = [r for r in recs if "rollback_to" in r]
    assert spikes and set(spikes) <= set(range(POISON_STEPS[0], POISON_STEPS[1] + 1)), spikes
    assert rollbacks and all(r["rollback_to"].endswith("step_000016") for r in rollbacks)
    ranges = [r["skip_tokens"] for r in rollbacks]
    assert ranges[0][0] == POISON_STEPS[0] * TINY["total_batch_tokens"]  # exactly from the first bad batch
    assert ranges[-1][1] >= (POISON_STEPS[1] + 1) * TINY["total_batch_tokens"]  # through the last one
    assert set(train_losses(guarded)) | set(spikes) == set(range(30))  # each step trained or skipped
    assert (
        max(v for s, v in train_losses(guarded).items() if s >= 8) < 10.5 < min(r["loss"] for r in recs if "loss" in r)
    )
    assert abs(_val(guarded) - _val(clean)) < 0.1, (_val(guarded), _val(clean))
    # with the guard off, the same data visibly spikes: losses near chance
    off = tmp_path / "off"
    shutil.copytree(guarded / "checkpoints" / "step_000016", off / "checkpoints" / "step_000016")
    train(_cfg(str(poisoned), off, **{**GUARD, "max_steps": 21, "spike_window": 0}), DistInfo(device=CPU), "auto")
    assert min(train_losses(off)[s] for s in range(POISON_STEPS[0], POISON_STEPS[1] + 1)) > 10.5
    # the skipped ranges are reproducible: resuming from before the spikes makes the same decisions
    again = tmp_path / "again"
    shutil.copytree(guarded / "checkpoints" / "step_000016", again / "checkpoints" / "step_000016")
    train(_cfg(str(poisoned), again, **GUARD), DistInfo(device=CPU), "auto")
    assert [r["skip_tokens"] for r in records(again) if "rollback_to" in r] == ranges
    assert train_losses(again) == {s: v for s, v in train_losses(guarded).items() if s >= 16}
    state = torch.load(guarded / "checkpoints" / "step_000024" / "state.pt", weights_only=True)
    assert [list(r) for r in state["skips"]] == [r["skip_positions"] for r in rollbacks]


def test_spike_guard_on_the_device_read_back_every_few_steps_decides_as_every_step(tiny_data, tmp_path):
    """The checks on the device (read back every 4 steps, as a GPU does every 16) skip the same
    steps, roll back to the same checkpoint over the same data and train to the same losses as the
    host's checks every step; only the step times (shared over each read-back) differ."""
    poisoned = tmp_path / "poisoned"
    _poison(tiny_data, poisoned)
    every, few = tmp_path / "every", tmp_path / "few"
    train(_cfg(str(poisoned), every, **GUARD), DistInfo(device=CPU))
    train(_cfg(str(poisoned), few, **GUARD, check_interval=4), DistInfo(device=CPU))
    timing = ("dt_ms", "tok_per_s", "mfu")

    def plain(run):  # the checkpoint rolled back to by name (the runs' folders differ)
        return [
            {k: os.path.basename(v) if k == "rollback_to" else v for k, v in r.items() if k not in timing}
            for r in records(run)
        ]

    assert [r for r in records(few) if "rollback_to" in r]  # the poison still calls for a rollback
    assert plain(few) == plain(every)

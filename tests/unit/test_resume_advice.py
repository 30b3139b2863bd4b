"""The advice a stopped run prints is a command that continues it: taken from the output and run.

A stop signal is simulated at a chosen step (what SIGTERM's handler does: the step finishes, a
checkpoint is saved, the run exits 143). Also: `--init-from` with `--resume auto` (the command
that began a fine-tune, repeated) continues it, other weights are refused naming both; a resume
with another `--max-steps` says how the schedule changed; `--resume` of no directory is exit 2."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal

import pytest
from conftest import TINY, cli_args, records

from gpt2lab import cli
from gpt2lab.train.evaluation import Evaluator
from gpt2lab.train.trainer import Trainer


@pytest.fixture
def stop_at(monkeypatch):
    """stop_at(N): the run gets SIGTERM's stop request during step N-1, so it saves step_N and exits."""
    original = Trainer.train_step

    def arm(step: int) -> None:
        def train_step(self):
            done = original(self)  # counts the step
            if self.step == step and not self.stop_requested:
                self.stop_requested, self.stop_signal = True, signal.SIGTERM
            return done

        monkeypatch.setattr(Trainer, "train_step", train_step)

    yield arm
    monkeypatch.setattr(Trainer, "train_step", original)


def advice(err: str) -> list[str]:
    """The gpt2lab words of the command in the last line's backticks (what follows the program)."""
    line = err.strip().splitlines()[-1]
    found = re.search(r"continue with `([^`]*)`", line)
    assert found, line
    words = shlex.split(found.group(1))
    assert words[-2:] == ["--resume", "auto"]
    return words[words.index("gpt2lab") + 1 :] if "gpt2lab" in words else words[1:]


def _train(**fields) -> list[str]:
    return ["train", "--preset", "shakespeare-cpu", *cli_args(**fields)]


def test_a_stopped_train_says_the_command_that_finishes_it(tiny_data, tmp_path, stop_at, capsys):
    out = tmp_path / "run"
    stop_at(2)
    assert cli.main(_train(data=tiny_data, out=str(out), max_steps=4)) == 143
    words = advice(capsys.readouterr().err)
    assert words[:3] == ["train", "--preset", "shakespeare-cpu"] and str(out) in words
    stop_at(0)  # disarmed
    assert cli.main(words) == 0
    assert max(r["step"] for r in records(out) if "train_loss" in r) == 3
    assert (out / "checkpoints" / "step_000004").is_dir()


def test_a_run_stopped_before_its_first_step_says_nothing_was_saved_and_its_advice_starts_it(
    tiny_data, tmp_path, monkeypatch, capsys
):
    """A SIGTERM during the step-0 evaluation (or sample): no step to save, so no checkpoint is named."""
    original = Evaluator.__call__

    def evaluate(self, step, log):
        if step == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's own handler takes it
        return original(self, step, log) or step == 0

    monkeypatch.setattr(Evaluator, "__call__", evaluate)
    out = tmp_path / "run"
    assert cli.main(_train(data=tiny_data, out=str(out), max_steps=2)) == 143
    out_text, err = capsys.readouterr()
    assert "stopped by SIGTERM at step 0 (before its first step: nothing saved)" in err.strip().splitlines()[-1]
    assert "stop signal: no step to save" in out_text + err and "None" not in out_text + err
    assert not (out / "checkpoints").exists()
    monkeypatch.setattr(Evaluator, "__call__", original)
    assert cli.main(advice(err)) == 0
    assert (out / "checkpoints" / "step_000002").is_dir()


def test_a_stopped_fine_tune_resumes_with_its_init_from_and_refuses_other_weights(
    finished_run, tiny_data, tmp_path, stop_at, capsys
):
    out = tmp_path / "tuned"
    stop_at(2)
    argv = _train(data=tiny_data, out=str(out), max_steps=4) + ["--init-from", str(finished_run)]
    assert cli.main(argv) == 143
    words = advice(capsys.readouterr().err)
    assert "--init-from" in words and str(finished_run) in words
    other = tmp_path / "other"  # a run of its own: other weights
    assert cli.main(_train(data=tiny_data, out=str(other), max_steps=1)) == 0
    refused = [str(other) if w == str(finished_run) else w for w in words]
    assert cli.main(refused) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and f"--init-from {other}" in line and f"began from {finished_run}" in line
    stop_at(0)
    assert cli.main(words) == 0
    info = json.loads((out / "run_info.json").read_text())
    plan = info["plan"]
    assert plan["init_from"]["source"] == str(finished_run) and plan["resume"].endswith("step_000002")


def test_a_resume_with_other_max_steps_names_the_schedule_it_changes(tiny_data, tmp_path, stop_at, capsys):
    out = tmp_path / "run"
    stop_at(4)  # past the warmup (3 steps): the cosine part moves
    assert cli.main(_train(data=tiny_data, out=str(out), max_steps=6)) == 143
    capsys.readouterr()
    stop_at(0)
    assert cli.main(_train(data=tiny_data, out=str(out), max_steps=8) + ["--resume", "auto"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "LR schedule" in line]
    hi, lo, warm = TINY["max_lr"], TINY["min_lr"], TINY["warmup_steps"]
    cosine = lambda steps: lo + 0.5 * (1 + math.cos(math.pi * (4 - warm) / (steps - warm))) * (hi - lo)  # noqa: E731
    assert notes == [
        "gpt2lab train: note: resuming at step 4 with another LR schedule than its checkpoint's: max_steps 6 -> 8; "
        f"the cosine schedule now ends at step 8, and step 4's learning rate is {cosine(8):.3g} "
        f"(the checkpoint's schedule: {cosine(6):.3g})"
    ]
    lr = next(r["lr"] for r in records(out) if r.get("step") == 4 and "lr" in r)
    assert lr == pytest.approx(cosine(8))  # what the note says is what ran
    plan = json.loads((out / "run_info.json").read_text())["plan"]
    assert plan["schedule_change"] == notes[0].split("note: ", 1)[1]


def test_resume_of_no_directory_is_a_usage_error(tiny_data, tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert cli.main(_train(data=tiny_data, out=str(tmp_path / "run")) + ["--resume", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"gpt2lab train: --resume {missing}: no such directory; pass auto (the newest checkpoint in --out), "
        "a run directory or a checkpoint directory"
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_a_stopped_demo_says_the_train_command_that_finishes_its_run(tiny_data, tmp_path, stop_at, capsys):
    """The demo takes no --resume (each demo is a new run): its advice is the train command of its settings."""
    out = tmp_path / "demo"
    stop_at(1)
    argv = ["demo", "--recipe", "faithful", "--max-steps", "2", "--data", tiny_data, "--out", str(out)]
    assert cli.main(argv + ["--dtype", "float32"]) == 143
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("gpt2lab demo: stopped by SIGTERM at step 1")
    words = advice(err)
    assert words[:3] == ["train", "--preset", "shakespeare-cpu"] and "--max-steps" in words
    stop_at(0)
    assert cli.main(words) == 0
    assert (out / "checkpoints" / "step_000002").is_dir()
    assert json.loads((out / "run_info.json").read_text())["plan"]["resume"].endswith("step_000001")

"""Helpers shared by the training tests: tiny shards, tiny configs, CLI runs in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA, ROOT

# A model small enough that a step takes milliseconds; the vocabulary stays GPT-2's (padded).
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, seq_len=32, micro_batch_size=2,
            total_batch_tokens=128, max_steps=10, warmup_steps=3, max_lr=3e-3, min_lr=3e-4,
            dtype="float32", device="cpu", compile=False, seed=1234, eval_interval=0,
            hellaswag_interval=0, sample_interval=0, ckpt_interval=0, progress=False,
            keep_cpu_memory=False)  # in-process tests must not change the test process's allocator


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    """Tiny Shakespeare as token shards, made with the data package's own prepare()."""
    from gpt2lab.data.prepare import prepare

    out = tmp_path_factory.mktemp("shards") / "tinyshakespeare"
    prepare("tinyshakespeare", str(out), progress=False)
    return str(out)


def cli_args(**fields) -> list[str]:
    """``--field value`` flags for ``gpt2lab train`` from TINY plus overrides."""
    args = []
    for key, value in {**TINY, **fields}.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args += ["--" + key.replace("_", "-"), text]
    return args


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    src = str(ROOT / "src")
    e["PYTHONPATH"] = src + os.pathsep + e.get("PYTHONPATH", "")
    return e


def train_cmd(**fields) -> list[str]:
    return [sys.executable, "-m", "gpt2lab", "train", "--preset", "shakespeare-cpu", *cli_args(**fields)]


def run_train(resume: str | None = None, timeout: float = 120, **fields) -> subprocess.CompletedProcess:
    cmd = train_cmd(**fields) + (["--resume", resume] if resume else [])
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def records(run_dir) -> list[dict]:
    """Every record of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line]


def torchrun_cmd(nproc: int = 2, **fields) -> list[str]:
    """`torchrun --standalone --nproc_per_node N -m gpt2lab train ...` for the tiny run."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "gpt2lab", *train_cmd(**fields)[3:]]


def train_losses(run_dir: str) -> dict[int, float]:
    """step -> train_loss from a run's metrics.jsonl."""
    out = {}
    for line in Path(run_dir, "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train_loss" in rec:
            out[rec["step"]] = rec["train_loss"]
    return out


@pytest.fixture(scope="session")
def finished_run(tiny_data, tmp_path_factory) -> Path:
    """A finished 4-step run with every evaluation on (for report tests); read-only.

    Made by the real CLI in this process (``cli.main`` with ``sys.argv`` as the console
    script would set it): a subprocess would cost a second torch import.
    """
    from unittest import mock

    from gpt2lab import cli

    out = tmp_path_factory.mktemp("finished") / "run"
    hellaswag = str(DATA / "hellaswag_val_200.jsonl")
    argv = ["train", "--preset", "shakespeare-cpu", *cli_args(
        data=tiny_data, out=str(out), max_steps=4, eval_interval=2, eval_tokens=128, hellaswag_interval=4,
        hellaswag_data=hellaswag, hellaswag_limit=4, sample_interval=2, sample_tokens=6, ckpt_interval=2,
        keep_checkpoints=0)]
    with mock.patch.object(sys, "argv", ["/venv/bin/gpt2lab", *argv]):
        assert cli.main(argv) == 0
    return out

"""Sharded (DCP) checkpoints of `gpt2lab train --strategy fsdp` under torchrun (2 ranks, gloo):
kill -9 and resume, resume on one process, export (logits against transformers), and a
checkpoint that was not fully written is never chosen.

Two torchrun launches (the killed run and its resume); everything else runs in this process.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2lab import checkpoint as ckpt
from gpt2lab.errors import CheckpointError
from test_train_dist import _wait_for
from train_utils import cli_args, env, tiny_data, train_cmd, train_losses  # noqa: F401

# TINY: 128 tokens a step = 2 micro-steps on one process, 1 per rank on two
FIELDS = dict(max_steps=12, ckpt_interval=4, keep_checkpoints=2)


def _torchrun(out: Path, data: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gpt2lab",
            *train_cmd(out=str(out), data=data, strategy="fsdp", **FIELDS)[3:], *extra]


def _train_here(out: Path, data: str, *extra: str) -> str:
    """`gpt2lab train` in this process (one process, so no sharding); its stdout and stderr."""
    from gpt2lab.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        rc = main(["train", "--preset", "shakespeare-cpu", *cli_args(out=str(out), data=data, **FIELDS), *extra])
    assert rc == 0, text.getvalue()
    return text.getvalue()


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    """An uninterrupted one-process run, and a 2-rank FSDP run killed (-9, every process) after
    its step-4 checkpoint and resumed with --resume auto; the losses it logged before the kill."""
    root = tmp_path_factory.mktemp("sharded")
    straight, fsdp = root / "straight", root / "fsdp"
    _train_here(straight, tiny_data)
    proc = subprocess.Popen(_torchrun(fsdp, tiny_data), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for(fsdp / "checkpoints" / "step_000004", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks at once
    proc.wait(timeout=30)
    before = train_losses(fsdp)
    assert max(before) < 11, "the run finished before it was killed"
    shutil.copytree(fsdp / "checkpoints" / "step_000004", root / "step_000004")  # as the kill left it
    resumed = subprocess.run(_torchrun(fsdp, tiny_data, "--resume", "auto"), env=env(), capture_output=True,
                             text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "strategy fsdp" in resumed.stdout
    return {"root": root, "straight": straight, "fsdp": fsdp, "before": before, "step4": root / "step_000004"}


def test_fsdp_kill_9_then_resume_equals_uninterrupted(runs):
    straight, again, before = train_losses(runs["straight"]), train_losses(runs["fsdp"]), runs["before"]
    assert sorted(again) == list(range(12))
    for step in range(4, max(before) + 1):  # the steps done twice: the same ranks, bit for bit
        assert again[step] == before[step], (step, again[step], before[step])
    for step in range(12):  # and the uninterrupted run's curve (DDP's tolerance in test_train_dist)
        assert abs(again[step] - straight[step]) < 1e-5, (step, again[step], straight[step])
    assert sorted(os.listdir(runs["fsdp"] / "checkpoints")) == ["step_000008", "step_000012"]  # the newest 2 kept
    ck = runs["fsdp"] / "checkpoints" / "step_000012"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(ck))  # each rank wrote its shard


def test_two_rank_checkpoint_resumes_on_one_process_skipping_unfinished_ones(runs, tiny_data):
    one = runs["root"] / "one"
    ck = one / "checkpoints"
    shutil.copytree(runs["step4"], ck / "step_000004")
    shutil.copytree(runs["step4"], ck / ".tmp_step_000006_999999")  # a save killed before rank 0 renamed it
    shutil.copytree(runs["step4"], ck / "step_000007")  # shards without the checksums rank 0 writes last
    os.remove(ck / "step_000007" / ckpt.CHECKSUMS)
    shutil.copytree(runs["step4"], ck / "step_000009")  # complete once, then it lost a rank's shard
    os.remove(ck / "step_000009" / "__1_0.distcp")
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(one))] == ["step_000004", "step_000009"]
    out = _train_here(one, tiny_data, "--resume", "auto")
    assert "step_000009 is damaged (__1_0.distcp is missing); trying the one before it" in out
    assert "resumed from " + str(ck / "step_000004") in out  # 2 ranks' shards read by one process
    straight, again = train_losses(runs["straight"]), train_losses(one)
    assert sorted(again) == list(range(4, 12))
    for step in range(4, 12):
        assert abs(again[step] - straight[step]) < 1e-5, (step, again[step], straight[step])
    assert os.path.isfile(ck / "step_000012" / "model.safetensors")  # one process writes the full layout


def test_sharded_checkpoint_exports_with_transformers_logits(runs, tmp_path):
    import transformers

    from gpt2lab.cli import main
    from gpt2lab.init_from import load_into
    from gpt2lab.load import load_model
    from gpt2lab.model import GPT

    assert main(["export", str(runs["fsdp"]), str(tmp_path / "hf")]) == 0  # consolidated in this process
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    reference = load_model(str(runs["straight"]))  # the one-process run's weights after the same 12 steps
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hf_logits, ours = theirs(idx).logits, reference(idx)[0][..., :50257]
        sharded_ours = load_model(str(runs["fsdp"]))(idx)[0][..., :50257]  # what sample and eval load
    started = GPT(reference.config)  # train --init-from RUN_DIR takes the sharded run's weights too
    assert load_into(started, str(runs["fsdp"]))["step"] == 12
    with torch.no_grad():
        assert torch.equal(started.eval()(idx)[0][..., :50257], sharded_ours)
    assert hf_logits.shape[-1] == 50257  # the padded rows dropped
    assert (hf_logits - sharded_ours).abs().max().item() <= 1e-5  # 1.8e-7 measured
    assert (hf_logits - ours).abs().max().item() <= 1e-4  # 8.9e-6 measured: 12 steps of float rounding


def test_flipped_bytes_in_a_shard_are_named(runs, tmp_path):
    good = tmp_path / "step_000004"
    shutil.copytree(runs["step4"], good)
    shard = good / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match its checksum"):
        ckpt.load_model(str(good))

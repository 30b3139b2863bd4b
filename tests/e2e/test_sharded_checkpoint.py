"""Sharded (DCP) checkpoints of `gpt2lab train --strategy fsdp` under torchrun (2 ranks, gloo):
continue a one-process checkpoint under FSDP, kill -9 and resume, resume on one process,
export (logits against transformers), and a checkpoint not fully written is never chosen.

Two torchrun launches (the killed run and its resume); everything else runs in this process.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import cli_args, env, torchrun_cmd, train_losses, wait_for

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.system.errors import CheckpointError
from gpt2lab.weights.load import load_model

# TINY: 128 tokens a step = 2 micro-steps on one process, 1 per rank on two
FIELDS = dict(max_steps=12, ckpt_interval=4, keep_checkpoints=2)


# Every test here trains with torchrun (the module's runs: two ranks, ~40 s on 2 cores): make test-slow.
pytestmark = pytest.mark.slow


def _torchrun(out: Path, data: str, *extra: str) -> list[str]:
    return [*torchrun_cmd(out=str(out), data=data, strategy="fsdp", **FIELDS), *extra]


def _train_here(out: Path, data: str, *extra: str) -> str:
    """`gpt2lab train` in this process (one process, so no sharding); its stdout and stderr."""
    from gpt2lab.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        rc = main(["train", "--preset", "shakespeare-cpu", *cli_args(out=str(out), data=data, **FIELDS), *extra])
    assert rc == 0, text.getvalue()
    return text.getvalue()


def _kill_9_all(proc: subprocess.Popen) -> None:
    """SIGKILL both ranks and torchrun at once (torchrun starts each rank in a session of its own,
    so killing its process group would leave the ranks training)."""
    ranks = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=30)
    while any(_running(pid) for pid in ranks):  # gone (or a zombie) before anything is read
        time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    """An uninterrupted one-process run; a 2-rank FSDP run that continues its (full) step-4
    checkpoint, is killed (-9, every process) after its own (sharded) step-8 checkpoint and
    resumed with --resume auto; the losses logged before the kill."""
    root = tmp_path_factory.mktemp("sharded")
    straight, fsdp = root / "straight", root / "fsdp"
    _train_here(straight, tiny_data, "--keep-checkpoints", "0")
    shutil.copytree(straight / "checkpoints" / "step_000004", fsdp / "checkpoints" / "step_000004")
    proc = subprocess.Popen(
        _torchrun(fsdp, tiny_data, "--resume", "auto"), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for(fsdp / "checkpoints" / "step_000008", proc)
    _kill_9_all(proc)
    before = train_losses(fsdp)
    assert max(before) < 11, "the run finished before it was killed"
    shutil.copytree(fsdp / "checkpoints" / "step_000008", root / "step_000008")  # as the kill left it
    resumed = subprocess.run(
        _torchrun(fsdp, tiny_data, "--resume", "auto"), env=env(), capture_output=True, text=True, timeout=180
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from " + str(fsdp / "checkpoints" / "step_000008") in resumed.stdout
    assert "strategy  fsdp" in resumed.stdout
    return {"root": root, "straight": straight, "fsdp": fsdp, "before": before, "step8": root / "step_000008"}


def test_fsdp_continues_a_full_checkpoint_and_resumes_after_kill_9_as_uninterrupted(runs):
    straight, again, before = train_losses(runs["straight"]), train_losses(runs["fsdp"]), runs["before"]
    assert sorted(again) == list(range(4, 12))  # from the one-process run's step 4 on
    for step in range(8, max(before) + 1):  # the steps done twice: the same ranks, bit for bit
        assert again[step] == before[step], (step, again[step], before[step])
    for step in range(4, 12):  # and the uninterrupted run's curve (DDP's tolerance in test_train_dist)
        assert abs(again[step] - straight[step]) < 1e-5, (step, again[step], straight[step])
    assert sorted(os.listdir(runs["fsdp"] / "checkpoints")) == ["step_000008", "step_000012"]  # the newest 2 kept
    ck = runs["fsdp"] / "checkpoints" / "step_000012"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(ck))  # each rank wrote its shard


def test_two_rank_checkpoint_resumes_on_one_process_skipping_unfinished_ones(runs, tiny_data):
    one = runs["root"] / "one"
    ck = one / "checkpoints"
    shutil.copytree(runs["step8"], ck / "step_000008")
    shutil.copytree(runs["step8"], ck / ".tmp_step_000009_999999")  # a save killed before rank 0 renamed it
    shutil.copytree(runs["step8"], ck / "step_000010")  # shards without the checksums rank 0 writes last
    os.remove(ck / "step_000010" / ckpt.CHECKSUMS)
    shutil.copytree(runs["step8"], ck / "step_000011")  # complete once, then it lost a rank's shard
    os.remove(ck / "step_000011" / "__1_0.distcp")
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(one))] == ["step_000008", "step_000011"]
    out = _train_here(one, tiny_data, "--resume", "auto")
    assert "step_000011 is damaged (__1_0.distcp is missing); trying the one before it" in out
    assert "resumed from " + str(ck / "step_000008") in out  # 2 ranks' shards read by one process
    straight, again = train_losses(runs["straight"]), train_losses(one)
    assert sorted(again) == list(range(8, 12))
    for step in range(8, 12):
        assert abs(again[step] - straight[step]) < 1e-5, (step, again[step], straight[step])
    assert os.path.isfile(ck / "step_000012" / "model.safetensors")  # one process writes the full layout


def test_sharded_checkpoint_exports_with_transformers_logits(runs, tmp_path):
    import transformers

    import gpt2lab
    from gpt2lab.cli import main
    from gpt2lab.model.gpt import GPT
    from gpt2lab.train.init_from import find_source, load_source
    from gpt2lab.weights.load import load_model

    assert main(["export", str(runs["fsdp"]), str(tmp_path / "hf")]) == 0  # consolidated in this process
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    reference = load_model(str(runs["straight"]))  # the one-process run's weights after the same 12 steps
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hf_logits, ours = theirs(idx).logits, reference(idx)[0][..., :50257]
        sharded_ours = load_model(str(runs["fsdp"]))(idx)[0][..., :50257]  # what sample and eval load
        api = gpt2lab.from_pretrained(str(runs["fsdp"]))(idx)[0][..., :50257]  # and the Python API
        ckpt = gpt2lab.from_pretrained(str(runs["fsdp"]) + "/checkpoints/step_000012")(idx)[0][..., :50257]
    assert torch.equal(api, sharded_ours) and torch.equal(ckpt, sharded_ours)
    started = GPT(reference.config)  # train --init-from RUN_DIR takes the sharded run's weights too
    src = find_source(str(runs["fsdp"]))  # as the run plan resolves it; the Trainer then loads it
    assert src.step == 12
    load_source(started, src)
    with torch.no_grad():
        assert torch.equal(started.eval()(idx)[0][..., :50257], sharded_ours)
    assert hf_logits.shape[-1] == 50257  # the padded rows dropped
    assert (hf_logits - sharded_ours).abs().max().item() <= 1e-5  # 1.8e-7 measured
    assert (hf_logits - ours).abs().max().item() <= 1e-4  # 8.9e-6 measured: 12 steps of float rounding


def test_flipped_bytes_in_a_shard_are_named(runs, tmp_path):
    good = tmp_path / "step_000008"
    shutil.copytree(runs["step8"], good)
    shard = good / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match its checksum"):
        load_model(str(good))


def test_sigterm_to_torchrun_saves_a_sharded_checkpoint_that_resumes(tiny_data, tmp_path):
    """A scheduler's SIGTERM to torchrun: torchrun passes it to the ranks, every rank finishes its
    step, the sharded checkpoint of exactly the logged steps is written, and --resume auto
    continues it (here on one process). (torchrun itself then exits 1 with its own
    SignalException report, whatever its workers' codes: that part is torchrun's.)"""
    out = tmp_path / "fsdp"
    cmd = _torchrun(out, tiny_data)
    cmd[cmd.index("--max-steps") + 1] = "100000"
    cmd[cmd.index("--ckpt-interval") + 1] = "0"
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(out / "metrics.jsonl", proc)
    while len(train_losses(out)) < 3:
        assert proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=90)
    steps = len(train_losses(out))
    assert os.listdir(out / "checkpoints") == [f"step_{steps:06d}"], stderr[-2000:]
    assert (out / "checkpoints" / f"step_{steps:06d}" / ".metadata").is_file()  # DCP's, every rank wrote its shard
    assert "SIGTERM: stopping after this step, saving a checkpoint" in stderr
    _train_here(out, tiny_data, "--resume", "auto", "--max-steps", str(steps + 2))
    assert sorted(train_losses(out)) == list(range(steps + 2))

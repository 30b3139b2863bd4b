"""Sharded (DCP) checkpoints of an FSDP2 model: resume on 2 ranks and on 1, consolidate for
export (logits against transformers), and never choose one that was not fully written.

One torchrun launch (tests/fsdp_ckpt_worker.py, 2 ranks, gloo) makes the checkpoints; the
rest runs in this process, without a process group.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_ckpt_worker import CONFIG, build, probe, train_step
from gpt2lab import checkpoint as ckpt
from gpt2lab.errors import CheckpointError
from gpt2lab.model import GPT
from train_utils import env, tiny_data  # noqa: F401

WORKER = Path(__file__).with_name("fsdp_ckpt_worker.py")


@pytest.fixture(scope="module")
def fsdp_run(tiny_data, tmp_path_factory) -> Path:
    """A 2-rank FSDP run dir: sharded checkpoints after steps 2 and 4, losses.json, logits.pt."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           tiny_data, str(out)]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_two_rank_checkpoint_resumes_on_two_ranks_and_on_one(fsdp_run, tiny_data):
    res = json.loads((fsdp_run / "losses.json").read_text())
    losses = res["losses"]
    assert res["resumed"] == losses[2:]  # the same 2 ranks after a restart: bit for bit
    step2 = ckpt.checkpoint_dir(str(fsdp_run), 2)
    assert os.path.isfile(os.path.join(step2, "__1_0.distcp"))  # each rank wrote its shard
    straight = build(tiny_data, seed=0)  # one process, twice the accumulation, never stopped
    reference = [train_step(straight) for _ in range(4)]
    for a, b in zip(losses, reference):
        assert abs(a - b) < 1e-5, (losses, reference)
    resumed = build(tiny_data, seed=1)  # other weights: all of them must come from the checkpoint
    ckpt.load(step2, resumed)  # written by 2 ranks, read by 1: DCP reshards
    assert resumed["trainer"].step == 2 and resumed["loader"].position == 8
    moments = resumed["optimizer"].state_dict()["state"]
    assert int(moments[0]["step"]) == 2 and moments[0]["exp_avg"].abs().sum() > 0
    for a, b in zip([train_step(resumed) for _ in range(2)], reference[2:]):
        assert abs(a - b) < 1e-5


def test_sharded_checkpoint_exports_with_transformers_logits(fsdp_run, tmp_path):
    import transformers

    from gpt2lab.cli import main
    from gpt2lab.init_from import load_into
    from gpt2lab.load import load_model

    live = torch.load(fsdp_run / "logits.pt")  # the FSDP model's own logits after step 4
    idx = probe()
    with torch.no_grad():  # sample and eval load it so: consolidated in this process
        assert (load_model(str(fsdp_run))(idx)[0] - live).abs().max().item() <= 1e-6
    started = GPT(ckpt.model_config(CONFIG))  # train --init-from RUN_DIR takes the same weights
    assert load_into(started, str(fsdp_run))["step"] == 4
    with torch.no_grad():
        assert (started.eval()(idx)[0] - live).abs().max().item() <= 1e-6
    assert main(["export", str(fsdp_run), str(tmp_path / "hf")]) == 0
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        hf_logits = theirs(idx).logits
    assert hf_logits.shape[-1] == 50257  # the padded rows dropped
    assert (hf_logits - live[..., :50257]).abs().max().item() <= 1e-4


def test_a_sharded_checkpoint_not_fully_written_is_never_chosen(fsdp_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fsdp_run / "checkpoints", run / "checkpoints")
    ck, good = run / "checkpoints", str(run / "checkpoints" / "step_000004")
    shutil.copytree(good, ck / ".tmp_step_000006_999999")  # a save killed before rank 0 renamed it
    shutil.copytree(good, ck / "step_000008")  # shards without the checksums rank 0 writes last
    os.remove(ck / "step_000008" / ckpt.CHECKSUMS)
    shutil.copytree(good, ck / "step_000010")  # a complete one that later lost a rank's shard
    os.remove(ck / "step_000010" / "__1_0.distcp")
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(run))] == \
        ["step_000002", "step_000004", "step_000010"]
    skipped = []
    assert ckpt.find_intact(str(run), report=skipped.append) == good  # what --resume auto takes
    assert len(skipped) == 1 and "__1_0.distcp is missing" in skipped[0]
    shard = Path(good, "__0_0.distcp")  # flipped bytes in a shard: the checksum names it
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match its checksum"):
        ckpt.load_model(good)

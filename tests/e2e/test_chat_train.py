"""Training on conversations keeps what training promises: DDP and FSDP on two processes equal one
process (the masked loss normalised over the step's assistant tokens on all ranks), kill -9 then
resume equals an uninterrupted run, and the dry run says what the loss is taken on."""

from __future__ import annotations

import subprocess

import pytest
from conftest import (
    DATA,
    cli_args,
    env,
    killed_then_resumed_equals_straight,
    records,
    run_train,
    torchrun_cmd,
    train_losses,
    val_losses,
)

FIELDS = dict(
    total_batch_tokens=256,
    max_steps=3,
    eval_interval=3,
    eval_tokens=256,
    sample_interval=3,
    sample_tokens=4,
    sample_prompt="Hi!",
)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> str:
    from gpt2lab.data.prepare import prepare

    out = tmp_path_factory.mktemp("chat") / "shards"
    prepare(str(DATA / "chat_slice.jsonl.zst"), str(out), progress=False, val_tokens=2000)
    return str(out)


def _torchrun(out, **fields) -> subprocess.CompletedProcess:
    proc = subprocess.run(torchrun_cmd(out=str(out), **fields), env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_ddp_and_fsdp_on_conversations_equal_one_process(chat_data, tmp_path):
    run_train(out=str(tmp_path / "one"), data=chat_data, **FIELDS)
    _torchrun(tmp_path / "ddp", data=chat_data, strategy="ddp", **FIELDS)
    _torchrun(tmp_path / "fsdp", data=chat_data, strategy="fsdp", check_interval=2, **FIELDS)  # checks on the device
    one = train_losses(tmp_path / "one")
    assert sorted(one) == [0, 1, 2] and one[2] < one[0]
    for name in ("ddp", "fsdp"):
        other = train_losses(tmp_path / name)
        assert all(abs(one[s] - other[s]) < 1e-5 for s in one), (name, one, other)
        val, val_ref = val_losses(tmp_path / name), val_losses(tmp_path / "one")
        assert sorted(val) == sorted(val_ref) == [0, 3] and all(abs(val[s] - val_ref[s]) < 1e-5 for s in val)
    samples = [r["sample"] for r in records(tmp_path / "one") if "sample" in r]
    assert samples and all(s.startswith("User: Hi!\nAssistant: ") for s in samples)  # a chat run's sample is a reply


@pytest.mark.slow
def test_kill_9_then_resume_on_conversations_equals_uninterrupted(chat_data, tmp_path):
    fields = dict(data=chat_data, max_steps=24, ckpt_interval=6, keep_checkpoints=2, keep_cpu_memory=True)
    killed_then_resumed_equals_straight(tmp_path, fields, "step_000012")


def test_dry_run_says_what_the_loss_is_taken_on(chat_data, tmp_path):
    import json
    import sys

    manifest = json.loads(open(f"{chat_data}/manifest.json").read())
    n, total = manifest["splits"]["train"]["supervised"], manifest["splits"]["train"]["tokens"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpt2lab",
            "train",
            "--preset",
            "shakespeare-cpu",
            "--dry-run",
            *cli_args(data=chat_data, out=str(tmp_path / "run")),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"supervised on {n:,} of {total:,} tokens" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_chat_gpt2_preset_from_an_hf_gpt2_directory_trains_on_conversations(chat_data, tmp_path):
    """The GPU preset's own path (--init-from gpt2: a GPT-2 of 50,257 tokens) on data with the two
    turn tokens: the run pads the vocabulary, GPT-2's rows are copied and the turn tokens start
    from their mean row. A tiny GPT-2 directory stands in for the hub's, on the CPU."""
    import json
    import sys

    import torch
    import transformers
    from safetensors.torch import load_file

    src = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=50257)
    ).save_pretrained(src)
    from unittest import mock

    from gpt2lab import cli

    out = tmp_path / "run"  # in this process (no second torch import); the allocator left as it is
    argv = [
        "train",
        "--preset",
        "chat-gpt2",
        "--init-from",
        str(src),
        "--data",
        chat_data,
        "--out",
        str(out),
        "--device",
        "cpu",
        "--max-steps",
        "1",
        "--micro-batch-size",
        "2",
        "--seq-len",
        "64",
        "--total-batch-tokens",
        "128",
        "--eval-interval",
        "0",
        "--sample-interval",
        "0",
        "--progress",
        "false",
        "--keep-cpu-memory",
        "false",
    ]
    with mock.patch.object(sys, "argv", ["/venv/bin/gpt2lab", *argv]):
        assert cli.main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == 50304 and cfg["model"]["chat_template"] == "chatml"
    assert len(train_losses(out)) == 1
    theirs = load_file(str(src / "model.safetensors"))["transformer.wte.weight"]
    ckpt = next((out / "checkpoints").iterdir())
    ours = load_file(str(ckpt / "model.safetensors"))
    wte = next(v for k, v in ours.items() if k.endswith("wte.weight"))
    assert wte.shape[0] == 50304
    moved = (wte[:50257].float() - theirs.float()).abs().max()  # one step at 5e-5 * 0.1 (warmup) moves little
    assert moved < 1e-3, moved

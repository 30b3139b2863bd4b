"""Whole runs in subprocesses: DDP (2 processes, gloo) vs one process, kill -9 + resume, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import (
    DATA,
    cli_args,
    env,
    killed_then_resumed_equals_straight,
    records,
    run_train,
    torchrun_cmd,
    train_cmd,
    train_losses,
    val_losses,
    wait_for,
)

# B=2, T=32: 256 tokens/step = 4 micro-steps on 1 process, 2 per rank on 2 processes. HellaSwag's 3
# examples split 2 + 1 over two ranks (uneven work) and a sample is generated at the end.
DIST_FIELDS = dict(
    total_batch_tokens=256,
    max_steps=4,
    eval_interval=2,
    eval_tokens=256,
    hellaswag_interval=4,
    hellaswag_data=str(DATA / "hellaswag_val_200.jsonl"),
    hellaswag_limit=3,
    sample_interval=4,
    sample_tokens=4,
)


def _torchrun(out, **fields) -> subprocess.CompletedProcess:
    proc = subprocess.run(torchrun_cmd(out=str(out), **fields), env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def one_and_ddp(tiny_data, tmp_path_factory):
    """The same run on one process and, as DDP, on two (shared by the DDP and FSDP tests)."""
    root = tmp_path_factory.mktemp("dist")
    run_train(out=str(root / "one"), data=tiny_data, **DIST_FIELDS)
    proc = _torchrun(root / "ddp", data=tiny_data, strategy="ddp", **DIST_FIELDS)
    return root / "one", root / "ddp", proc


@pytest.mark.slow
def test_ddp_two_processes_equal_one_with_double_accumulation(one_and_ddp):
    one_dir, two_dir, proc = one_and_ddp
    one, two = train_losses(one_dir), train_losses(two_dir)
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    assert one[3] < one[0]  # it trained
    assert "x 2 process(es) x 2 micro-steps" in proc.stdout
    assert "1 process(es)" not in proc.stdout  # rank 1 printed nothing
    val_one, val_two = val_losses(one_dir), val_losses(two_dir)
    assert sorted(val_one) == sorted(val_two) == [0, 2, 4]  # every eval_interval and the end
    for step in val_one:  # the same val tokens, split over ranks and averaged
        assert abs(val_one[step] - val_two[step]) < 1e-5


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_process_and_ddp(one_and_ddp, tiny_data, tmp_path):
    """FSDP2 (with activation checkpointing on) against the unsharded runs: losses, grad norms, evals."""
    one_dir, ddp_dir, _ = one_and_ddp
    proc = _torchrun(tmp_path / "fsdp", data=tiny_data, strategy="fsdp", activation_checkpointing=True, **DIST_FIELDS)
    assert "strategy  fsdp (asked for with --strategy fsdp); activation checkpointing on" in proc.stdout
    dirs = {"one": one_dir, "ddp": ddp_dir, "fsdp": tmp_path / "fsdp"}
    runs = {name: records(d) for name, d in dirs.items()}
    losses = {name: {r["step"]: r for r in recs if "train_loss" in r} for name, recs in runs.items()}
    assert sorted(losses["fsdp"]) == [0, 1, 2, 3]
    for other in ("one", "ddp"):
        for step, rec in losses["fsdp"].items():
            ref = losses[other][step]
            assert abs(rec["train_loss"] - ref["train_loss"]) < 1e-5, (other, step)
            # the norm of the whole gradient over the shards. fp32 sums of the tied wte's 1.6M squares
            # (mostly tiny lm_head terms) are off by up to ~3e-4 of the float64 norm, differently for a
            # whole tensor and for two halves; the losses above show the updates are the same
            assert abs(rec["grad_norm"] - ref["grad_norm"]) < 1e-3 * ref["grad_norm"], (other, step)
        val, val_ref = val_losses(dirs["fsdp"]), val_losses(dirs[other])
        assert sorted(val) == sorted(val_ref) == [0, 2, 4]
        assert all(abs(val[s] - val_ref[s]) < 1e-5 for s in val)
    # every rank scored its HellaSwag examples and took part in the sample (gathered weights)
    evals = {
        name: [
            (r["step"], r.get("hellaswag_n"), r.get("hellaswag_acc"), r.get("sample"))
            for r in recs
            if "hellaswag_n" in r or "sample" in r
        ]
        for name, recs in runs.items()
    }
    assert [e[:2] for e in evals["fsdp"]] == [(0, 3), (0, None), (4, 3), (4, None)]
    assert evals["fsdp"] == evals["one"] == evals["ddp"]
    info = json.loads((tmp_path / "fsdp" / "run_info.json").read_text())
    assert info["plan"]["strategy"]["value"] == "fsdp" and info["plan"]["activation_checkpointing"] is True
    # sharded: rank 0 holds half of every parameter (dim 0 split in two; every dim 0 here is even)
    assert (
        info["params_on_rank_0"] * 2
        == info["params"]
        == json.loads((ddp_dir / "run_info.json").read_text())["params_on_rank_0"]
    )


@pytest.mark.slow
def test_kill_9_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    fields = dict(data=tiny_data, max_steps=40, ckpt_interval=8, keep_checkpoints=2, keep_cpu_memory=True)
    out = killed_then_resumed_equals_straight(tmp_path, fields, "step_000016")  # same kernels and threads
    names = sorted(os.listdir(out / "checkpoints"))
    assert names == ["step_000032", "step_000040"]  # the newest two kept


def test_kill_9_then_resume_keeps_where_an_init_from_run_began(tiny_data, tmp_path):
    """What --init-from resolved to is no setting (config.json has only the source): the plan
    records it (run_info.json), every checkpoint carries it, and the run resumed after kill -9,
    without --init-from, reports the same record and passes it on to its own checkpoints."""
    import torch
    from conftest import tiny_gpt

    from gpt2lab.checkpoint.store import list_checkpoints, step_of
    from gpt2lab.system.files import sha256_file
    from gpt2lab.weights import export

    src = str(tmp_path / "src")
    export.save_pretrained(tiny_gpt(seed=3, vocab_size=50257, block_size=64), src)
    weights = os.path.join(src, "model.safetensors")
    out = tmp_path / "run"
    fields = dict(data=tiny_data, out=str(out), max_steps=100000, ckpt_interval=2, keep_checkpoints=0)
    proc = subprocess.Popen(
        train_cmd(init_from=src, **fields), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for(out / "checkpoints" / "step_000002", proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    began = json.loads((out / "run_info.json").read_text())["plan"]["init_from"]
    digest = sha256_file(weights)
    assert began == {
        "source": src,
        "kind": "hf_dir",
        "weights": weights,
        "sha256": digest,
        "step": None,
        "id": f"sha256:{digest}",
    }
    config = json.loads((out / "config.json").read_text())
    assert config["finetune"]["init_from"] == src and "init_from_id" not in json.dumps(config)
    last = step_of(list_checkpoints(str(out))[-1])
    run_train(resume="auto", **{**fields, "max_steps": last + 2})
    info = json.loads((out / "run_info.json").read_text())
    assert info["plan"]["resume"].endswith(f"step_{last:06d}")
    assert info["plan"]["init_from"] == began and info["plan"]["config"]["finetune"]["init_from"] == src
    newest = list_checkpoints(str(out))[-1]
    assert step_of(newest) == last + 2
    assert torch.load(os.path.join(newest, "state.pt"), weights_only=True)["init_from"] == began


def test_sigterm_finishes_the_step_saves_and_exits_preempted(tiny_data, tmp_path):
    out = tmp_path / "run"
    fields = dict(data=tiny_data, max_steps=100000, ckpt_interval=0)
    proc = subprocess.Popen(
        train_cmd(out=str(out), **fields), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = out / "metrics.jsonl"
    wait_for(metrics, proc)
    while len(train_losses(out)) < 3:
        assert proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr  # 128 + SIGTERM: "preempted, resume me", not "done"
    assert "stopping after this step" in stderr and "Traceback" not in stderr
    steps = len(train_losses(out))
    ckpts = os.listdir(out / "checkpoints")
    assert ckpts == [f"step_{steps:06d}"], (ckpts, steps)  # every logged step is in the checkpoint
    assert stderr.rstrip().endswith(" --resume auto`")  # the command that continues it (test_resume_advice)
    run_train(out=str(out), resume="auto", **{**fields, "max_steps": steps + 2})
    assert sorted(train_losses(out)) == list(range(steps + 2))


def test_existing_run_needs_resume_flag(tiny_data, tmp_path, capsys):
    from gpt2lab.cli import main

    argv = ["train", "--preset", "shakespeare-cpu", *cli_args(out=str(tmp_path), data=tiny_data, max_steps=2)]
    assert main(argv) == 0 and sorted(train_losses(tmp_path)) == [0, 1]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already has checkpoints; continue it with `" in err and "gpt2lab train --preset shakespeare-cpu" in err
    assert err.rstrip().endswith(" --resume auto` or choose another --out"), err
    assert main(argv + ["--resume", "auto", "--max-steps", "3"]) == 0
    assert sorted(train_losses(tmp_path)) == [0, 1, 2]


# Muon + AdamW (and the wsd schedule) on the modern block (every switch on, so an untied head
# has its own --head-lr), fp32 Newton-Schulz so that this CPU runs it fast.
MUON_FIELDS = dict(
    optimizer="muon",
    muon_lr=0.02,
    embed_lr=6e-3,
    head_lr=4e-3,
    lr_schedule="wsd",
    decay_frac=0.5,
    muon_ns_dtype="float32",
    pos_emb="rotary",
    norm="rmsnorm",
    qk_norm=True,
    mlp_act="relu2",
    tie_embeddings=False,
    zero_init_proj=True,
    logit_softcap=15.0,
)


@pytest.mark.slow
def test_muon_ddp_two_processes_equal_one_with_double_accumulation(tiny_data, tmp_path):
    """Also with the checks on the device, read back every 3 steps over two ranks (a GPU's way)
    against the one process's every step."""
    fields = dict(data=tiny_data, **DIST_FIELDS, **MUON_FIELDS)
    run_train(out=str(tmp_path / "one"), **fields)
    proc = _torchrun(tmp_path / "ddp", strategy="ddp", check_interval=3, **fields)
    assert "x 2 process(es) x 2 micro-steps" in proc.stdout
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "ddp")
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    assert one[3] < one[0]
    val_one, val_two = val_losses(tmp_path / "one"), val_losses(tmp_path / "ddp")
    assert all(abs(val_one[s] - val_two[s]) < 1e-5 for s in val_one)
    plan = json.loads((tmp_path / "ddp" / "run_info.json").read_text())["plan"]
    assert plan["muon_ns_dtype"] == {"value": "float32", "reason": "asked for with --muon-ns-dtype"}


@pytest.mark.slow
def test_muon_kill_9_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    fields = dict(
        data=tiny_data, max_steps=24, ckpt_interval=6, keep_checkpoints=2, keep_cpu_memory=True, **MUON_FIELDS
    )
    # the Muon momentum and AdamW moments come back: bit for bit
    out = killed_then_resumed_equals_straight(tmp_path, fields, "step_000012")
    # resuming it as an AdamW run is one line naming the optimizers (what the run trains), exit 2
    proc = subprocess.run(
        train_cmd(
            out=str(out), **{**fields, "optimizer": "adamw", "embed_lr": "none", "head_lr": "none", "max_steps": 30}
        )
        + ["--resume", "auto"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "--optimizer adamw: the checkpoint " in proc.stderr
        and "was trained with optimizer muon; resume with --optimizer muon" in proc.stderr
        and "Traceback" not in proc.stderr
    )


# The speedrun's levers, every one on: value embeddings, U-net skips, a zero-initialised
# untied head, NorMuon, and the batch ramp, which the kill lands in the middle of (steps 0-11 ramp from
# 128 to 512 tokens; the checkpoint at step 4).
LEVER_FIELDS = dict(
    value_embeds=1,
    unet_skips=True,
    tie_embeddings=False,
    zero_init_head=True,
    optimizer="muon",
    muon_variant="normuon",
    muon_ns_dtype="float32",
    lr_schedule="wsd",
    total_batch_tokens=512,
    batch_ramp_steps=12,
    batch_ramp_start=128,
)


@pytest.mark.slow
def test_levers_kill_9_mid_ramp_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    fields = dict(
        data=tiny_data, max_steps=24, ckpt_interval=4, keep_checkpoints=2, keep_cpu_memory=True, **LEVER_FIELDS
    )
    # NorMuon's second moments, the loader's position and the ramp's step come back: bit for bit
    out = killed_then_resumed_equals_straight(tmp_path, fields, "step_000004")
    # the tokens of each step: 128 x (1 + 3 * step // 12) on the ramp, then 512
    per_step = [128 * (1 + 3 * s // 12) if s < 12 else 512 for s in range(24)]
    tokens = {r["step"]: r["tokens"] for r in records(out) if "tokens" in r}
    assert [tokens[s] for s in range(24)] == [sum(per_step[: s + 1]) for s in range(24)]


@pytest.mark.slow
def test_levers_fsdp_two_processes_equal_one_process(tiny_data, tmp_path):
    """FSDP2 shards the gates (1-D: it refuses 0-d parameters), the skip weights and the value-embedding
    tables; with activation checkpointing the blocks recompute with their value embeddings; the ramp's
    steps hold the same tokens on two processes as on one."""
    fields = dict(
        data=tiny_data,
        total_batch_tokens=256,
        max_steps=4,
        value_embeds=1,
        unet_skips=True,
        tie_embeddings=False,
        zero_init_head=True,
        batch_ramp_steps=2,
        batch_ramp_start=128,
    )
    run_train(out=str(tmp_path / "one"), **fields)
    _torchrun(tmp_path / "fsdp", strategy="fsdp", activation_checkpointing=True, **fields)
    one, fsdp = train_losses(tmp_path / "one"), train_losses(tmp_path / "fsdp")
    assert sorted(one) == sorted(fsdp) == [0, 1, 2, 3]
    for step in one:
        assert abs(one[step] - fsdp[step]) < 1e-5, (step, one[step], fsdp[step])
    tokens = [r["tokens"] for r in records(tmp_path / "fsdp") if "tokens" in r]
    assert tokens == [128, 256, 512, 768]  # 128 x (1 + 1 * step // 2) on the ramp, then 256


# The next levers: multi-token prediction (its weight decaying), the sequence-length ramp (8, then 16,
# then 32 tokens a row over the first 8 steps), cautious weight decay; with Muon, Polar Express.
NEXT_LEVERS = dict(
    mtp_heads=2, mtp_weight=0.5, mtp_weight_final=0.1, seq_len_ramp_steps=8, seq_len_start=8, cautious_wd=True
)
NEXT_MUON = dict(optimizer="muon", muon_orth="polar_express", muon_ns_dtype="float32", muon_weight_decay=0.05)


@pytest.mark.parametrize(
    "optim, strategy",
    [({}, "ddp"), (NEXT_MUON, "ddp"), ({"activation_checkpointing": True}, "fsdp")],
    ids=["adamw", "muon", "adamw-fsdp"],
)
@pytest.mark.slow
def test_next_levers_two_processes_equal_one_with_double_accumulation(tiny_data, tmp_path, optim, strategy):
    """DDP (and FSDP2, which shards the heads with the root) on two processes against one."""
    fields = dict(
        data=tiny_data, **{**DIST_FIELDS, "eval_interval": 0, "hellaswag_interval": 0}, **NEXT_LEVERS, **optim
    )
    fields["seq_len_ramp_steps"] = 2  # 4 steps: 8 tokens a row, then 16, then 32 twice
    _two_processes_equal_one(tmp_path, fields, strategy)


def _two_processes_equal_one(tmp_path, fields: dict, strategy: str) -> None:
    """``fields`` trained on one process and on two (``strategy``): the same loss at each of 4 steps."""
    run_train(out=str(tmp_path / "one"), **fields)
    proc = _torchrun(tmp_path / "ddp", strategy=strategy, **fields)
    assert "x 2 process(es) x 2 micro-steps" in proc.stdout
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "ddp")
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])


@pytest.mark.slow
def test_next_levers_kill_9_in_the_short_sequences_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    """Killed after the checkpoint of step 2, while the rows are 8 tokens long (steps 0-3): the loader's
    position, the heads, the weight's schedule and the optimizers' state come back bit for bit."""
    fields = dict(
        data=tiny_data,
        max_steps=16,
        ckpt_interval=2,
        keep_checkpoints=2,
        keep_cpu_memory=True,
        **NEXT_LEVERS,
        **NEXT_MUON,
    )
    killed_then_resumed_equals_straight(tmp_path, fields, "step_000002")


# --token-features: the share of the token tables (an untied head: two tables), with AdamW and Muon
TOKEN_FEATURES = dict(token_features=True, tie_embeddings=False)


@pytest.mark.parametrize("optim", [{}, NEXT_MUON], ids=["adamw", "muon"])
@pytest.mark.slow
def test_token_features_two_processes_equal_one_with_double_accumulation(tiny_data, tmp_path, optim):
    """The share reads the tables' gradients after DDP's all-reduce: the same update on every rank."""
    fields = dict(
        data=tiny_data, **{**DIST_FIELDS, "eval_interval": 0, "hellaswag_interval": 0}, **TOKEN_FEATURES, **optim
    )
    _two_processes_equal_one(tmp_path, fields, "ddp")
    assert json.loads((tmp_path / "ddp" / "config.json").read_text())["optim"]["token_features"] is True


@pytest.mark.slow
def test_token_features_kill_9_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    """The features' Adam moments and step counts come back bit for bit (the index is rebuilt from the
    tokenizer)."""
    fields = dict(
        data=tiny_data,
        max_steps=16,
        ckpt_interval=2,
        keep_checkpoints=2,
        keep_cpu_memory=True,
        **TOKEN_FEATURES,
        **NEXT_MUON,
    )
    killed_then_resumed_equals_straight(tmp_path, fields, "step_000002")

"""The GPU proof's tools run end to end on the CPU (tiny sizes), so a session lent a GPU
spends its device time measuring, not debugging: `bench ladder`, `bench memory` and
benchmarks/gpu.sh in its smoke mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, env


@pytest.mark.slow
def test_ladder_rungs_are_cumulative_and_timed():
    cmd = [
        sys.executable,
        "-m",
        "gpt2lab",
        "bench",
        "ladder",
        "--size",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--rungs",
        "fp32,tf32,bf16",
    ]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    rungs = res["rungs"]
    assert [r["rung"] for r in rungs] == ["fp32", "tf32", "bf16"]
    assert [(r["tf32"], r["bf16"], r["compile"]) for r in rungs] == [
        (False, False, False),
        (True, False, False),
        (True, True, False),
    ]
    for r in rungs:
        assert abs(r["tok_per_s"] - 32 / (r["ms_per_step"] / 1000)) <= 1
        assert 10 < r["loss"] < 12  # ln(50257) = 10.8 at init
    bad = subprocess.run(cmd[:-1] + ["fp32,warp"], env=env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown warp" in bad.stderr


def _gpu_sh(tmp_path, *stages: str) -> tuple:
    """benchmarks/gpu.sh STAGES in its smoke mode (tiny, CPU); (OUT, RUN)."""
    out, run = tmp_path / "out", tmp_path / "run"
    e = dict(
        env(),
        GPU_SH_SMOKE="1",
        OUT=str(out),
        RUN=str(run),
        PYTHON=sys.executable,
        HELLASWAG=str(ROOT / "tests" / "data" / "hellaswag_val_200.jsonl"),
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), *stages],
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.getcwd(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, run


@pytest.mark.slow
def test_gpu_sh_smoke_memory_big(tmp_path):
    out, _ = _gpu_sh(tmp_path, "memory", "big")
    mem = json.loads((out / "memory.jsonl").read_text())
    assert mem["largest_micro_batch"] == 1 and [{k: t[k] for k in ("B", "fits", "peak_gib")} for t in mem["tries"]] == [
        {"B": 1, "fits": True, "peak_gib": None}
    ]
    assert (
        mem["tries"][0]["predicted_gib"] > 1.8
    )  # gpt2lab.distributed.memplan: 124M's fp32 weights, grads, AdamW (16 B/param)
    big = [json.loads(x) for x in (out / "big.jsonl").read_text().splitlines()]
    assert [b["preset"] for b in big] == ["gpt2-350m", "gpt2-774m"] and all(b["tok_per_s_median"] > 0 for b in big)


@pytest.mark.slow
def test_gpu_sh_smoke_train_eval_finetune(tmp_path):
    out, run = _gpu_sh(tmp_path, "train", "eval", "finetune")
    steps = [json.loads(x) for x in (out / "train_metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in steps if "train_loss" in r}) == list(range(6))
    assert (out / "samples.txt").read_text().count("ROMEO:") == 1
    hs = json.loads((out / "hellaswag.json").read_text())
    assert hs["n"] == 8 and 0 <= hs["acc_norm"] <= 1 and hs["examples_per_s"] > 0
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    for kind in ("full", "lora"):  # fine-tuned from the train stage's run: its weights, 2 new steps
        ft = [json.loads(x) for x in (out / f"finetune_{kind}_metrics.jsonl").read_text().splitlines()]
        assert sorted(r["step"] for r in ft if "train_loss" in r) == [0, 1]
    assert "init_from" in (run / "ft_lora" / "config.json").read_text()


def test_ladder_records_an_out_of_memory_rung_and_goes_on(monkeypatch, capsys, tmp_path):
    """On an 80 GB H100 the fp32 rungs at B=64 run out of memory; the ladder must say so and go on.
    ``--profile``: the rung that ran is profiled (its operators' table and a Chrome trace), not the other."""
    import argparse

    import torch

    from gpt2lab.benchmarks import ladder

    real = ladder._build

    def build(rung, *a, **k):
        if rung == "fp32":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(rung, *a, **k)

    monkeypatch.setattr(ladder, "_build", build)
    args = argparse.Namespace(
        size="tiny",
        batch_size=2,
        seq_len=16,
        steps=1,
        warmup=1,
        rungs="fp32,tf32",
        data=None,
        device="cpu",
        peak_flops=None,
        profile=str(tmp_path / "prof"),
    )
    res = ladder.run(args)
    assert [r["rung"] for r in res["rungs"]] == ["fp32", "tf32"]
    assert res["rungs"][0]["oom"] is True and "ms_per_step" not in res["rungs"][0]
    assert 10 < res["rungs"][1]["loss"] < 12 and res["rungs"][1]["ms_per_step"] > 0
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["tf32_profile.txt", "tf32_trace.json"]
    assert "aten::mm" in (tmp_path / "prof" / "tf32_profile.txt").read_text()  # the model's matmuls, profiled
    assert json.loads((tmp_path / "prof" / "tf32_trace.json").read_text())["traceEvents"]


def test_gpu_sh_never_works_in_a_folder_it_did_not_make(tmp_path):
    """Its stages replace run directories under $RUN: a user's non-empty folder is refused, untouched."""
    mine = tmp_path / "mine"
    (mine / "run").mkdir(parents=True)
    (mine / "run" / "keep.txt").write_text("mine")
    e = dict(env(), GPU_SH_SMOKE="1", OUT=str(tmp_path / "out"), RUN=str(mine), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "train"], env=e, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "was not made by gpu.sh" in proc.stderr
    assert (mine / "run" / "keep.txt").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["run"]


@pytest.mark.slow
def test_gpu_sh_smoke_decode_and_chat(tmp_path):
    out, run = _gpu_sh(tmp_path, "decode", "chat")
    decode = [json.loads(x) for x in (out / "decode.jsonl").read_text().splitlines()]
    holds = [r for r in decode if "dtype" in r]
    assert [r["dtype"] for r in holds] == ["bfloat16", "float32"] and all(len(r["ms"]) == 2 for r in holds)
    assert "DISABLE_ADDMM_CUDA_LT=1" in {r.get("variant") for r in decode}
    assert "by self CPU time" in (out / "decode_profile.txt").read_text()
    chat = [json.loads(x) for x in (out / "chat_metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in chat if "train_loss" in r) == [0, 1]  # from the random GPT-2 it wrote
    assert (run / "gpt2_random" / "config.json").exists()

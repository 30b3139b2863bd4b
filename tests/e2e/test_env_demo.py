"""`gpt2lab env` reports what auto would choose; the demo runs end to end on the fp32 path."""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import env, run_gpt2lab

from gpt2lab.system import runtime
from gpt2lab.train.settings import load_preset


@pytest.mark.slow
def test_env_prints_the_fields_a_bug_report_needs():
    r = run_gpt2lab("env", "--json", "--device", "cpu", env=env())
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for key in (
        "torch",
        "cuda",
        "device",
        "cpu",
        "cpu_flags",
        "native_bf16",
        "matmul_fp32_gflops",
        "matmul_bf16_gflops",
        "read_gb_per_s",
        "compile_available",
        "auto_dtype",
        "auto_dtype_reason",
        "auto_compile",
        "auto_compile_reason",
        "extras",
    ):
        assert key in info, key
    assert info["matmul_fp32_gflops"] > 0 and info["matmul_bf16_gflops"] > 0 and info["read_gb_per_s"] > 0
    # what env says auto picks is what the choice function gives for the rates it measured
    probe = runtime.Probe(info["matmul_fp32_gflops"], info["matmul_bf16_gflops"])
    facts = runtime.Facts("cpu", cpu_flags=tuple(info["cpu_flags"]), probe=probe)
    assert info["auto_dtype"] == runtime.choose_dtype("auto", facts).value
    assert info["auto_muon_ns_dtype"] == runtime.choose_ns_dtype("auto", facts).value
    assert info["extras"]["transformers"]  # a test dependency, so installed here
    text = run_gpt2lab("env", "--device", "cpu", env=env())
    assert re.search(r"^auto_dtype:\s+(float32|bfloat16)$", text.stdout, re.M), text.stdout


@pytest.mark.slow
def test_demo_preset_trains_in_fp32_end_to_end(tmp_path):
    """The path CPUs without native bf16 take (auto -> float32), at the demo's real model size, with
    the default recipe (the modern one, shakespeare-cpu-fast)."""
    data, out = tmp_path / "data", tmp_path / "run"
    r = run_gpt2lab(
        "demo",
        "--data",
        str(data),
        "--out",
        str(out),
        "--max-steps",
        "3",
        "--dtype",
        "float32",
        "--tokens",
        "16",
        env=env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    info = json.loads((out / "run_info.json").read_text())
    assert info["plan"]["dtype"] == {"value": "float32", "reason": "asked for with --dtype"}
    cfg = load_preset("shakespeare-cpu-fast")
    saved = json.loads((out / "config.json").read_text())
    assert info["params"] > 0 and saved["model"]["n_embd"] == cfg.model.n_embd
    assert saved["optim"]["optimizer"] == "muon" and saved["model"]["pos_emb"] == "rotary"
    assert "[demo] recipe fast: the modern recipe" in r.stdout and "--recipe faithful" in r.stdout
    vals = [
        json.loads(line)["val_loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in line
    ]
    m = re.search(r"validation loss (\d+\.\d+) \(chance: ln 50304 = 10\.83\)", r.stdout)
    assert m and float(m.group(1)) == round(vals[-1], 2), r.stdout
    assert vals[0] == pytest.approx(math.log(50304), abs=0.1)  # step 0: about chance
    assert "sample from the trained model" in r.stdout and "ROMEO:" in r.stdout


def test_demo_chat_trains_its_base_deeper(monkeypatch, tmp_path):
    """`demo --chat` without --base trains the demo's model at CHAT_BASE_LAYERS layers first."""
    import argparse

    from gpt2lab.commands import demo

    seen = []

    class Stop(Exception):
        pass

    def base(args):
        seen.append(args)
        raise Stop

    monkeypatch.setattr(demo, "run_base", base)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(
        chat=True,
        base=None,
        recipe="fast",
        out=None,
        data="d",
        chat_data="c",
        max_steps=1,
        dtype="auto",
        prompt="ROMEO:",
        tokens=8,
        seed=1,
    )
    with pytest.raises(Stop):
        demo.run(args)
    assert seen[0].n_layer == demo.CHAT_BASE_LAYERS == 4 and seen[0].out.startswith("runs")


@pytest.mark.slow
def test_demo_chat_fine_tunes_a_base_and_answers_before_and_after(tiny_data, tmp_path):  # noqa: F811
    """`demo --chat --base RUN`: chat-cpu from the base on the bundled conversations; the losses before
    and after and three messages answered by each (a small base of the demo's preset, one step)."""
    from gpt2lab.commands.demo import CHAT_PROMPTS

    base, out = tmp_path / "base", tmp_path / "chat"
    r = run_gpt2lab(
        "train",
        "--preset",
        "shakespeare-cpu-fast",
        "--data",
        tiny_data,
        "--out",
        str(base),
        "--n-layer",
        "1",
        "--n-embd",
        "64",
        "--n-head",
        "2",
        "--max-steps",
        "1",
        "--progress",
        "false",
        "--eval-interval",
        "0",
        "--sample-interval",
        "0",
        env=env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_gpt2lab(
        "demo",
        "--chat",
        "--base",
        str(base),
        "--chat-data",
        str(tmp_path / "chitchat"),
        "--out",
        str(out),
        "--max-steps",
        "1",
        env=env(),
        timeout=300,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    saved = json.loads((out / "config.json").read_text())
    assert saved["finetune"]["init_from"] == str(base) and saved["model"]["chat_template"] == "chatml"
    m = re.search(r"assistant tokens: (\d+\.\d+) before, (\d+\.\d+) after", r.stdout)
    vals = [
        json.loads(line)["val_loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in line
    ]
    assert m and (float(m.group(1)), float(m.group(2))) == (round(vals[0], 2), round(vals[-1], 2)), r.stdout
    assert all(f"User: {p}" in r.stdout for p in CHAT_PROMPTS) and r.stdout.count("  chat model: ") == 3

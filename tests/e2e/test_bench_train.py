"""gpt2lab bench train: its reference model is the same network, and the command runs end to end (the preset's
run, another recipe and the reference, in turn)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import cli_args, env

from gpt2lab.benchmarks.train import ReferenceGPT
from gpt2lab.model.gpt import GPT, GPTConfig


def _reference_state(sd: dict) -> dict:
    """gpt2lab (HF-named) weights under ReferenceGPT's names."""
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("transformer.").replace("mlp.c_fc", "mlp.0").replace("mlp.c_proj", "mlp.2")
        out[k] = v
    return out


def test_reference_model_is_the_same_network():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=96)
    ours = GPT(cfg)
    ref = ReferenceGPT(cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd)
    missing, unexpected = ref.load_state_dict(_reference_state(ours.state_dict()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to wte
    x = torch.randint(0, cfg.vocab_size, (3, 16))
    y = torch.randint(0, cfg.vocab_size, (3, 16))
    _, loss = ours(x, y, return_logits=False)
    assert abs(loss.item() - ref(x, y).item()) < 1e-5


@pytest.mark.slow
def test_bench_train_cli_times_both_sides(tiny_data):  # noqa: F811
    flags = cli_args(data=tiny_data, max_steps=100)
    cmd = [
        sys.executable,
        "-m",
        "gpt2lab",
        "bench",
        "train",
        "--preset",
        "shakespeare-cpu",
        *flags,
        "--recipe",
        "shakespeare-cpu:max_lr=1e-3,dtype=float32",
        "--reference",
        "--reference-compile",
        "false",
        "--rounds",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
    ]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res["rounds_ms"]) == 2 and len(res["reference_rounds_ms"]) == 2
    assert res["ms_per_step"] > 0 and res["reference_ms_per_step"] > 0
    assert abs(res["tok_per_s"] - 128 / (res["ms_per_step"] / 1000)) < 0.5
    # the report divides the unrounded medians; its ms figures are rounded to 0.01 ms
    assert abs(res["speedup"] - res["reference_ms_per_step"] / res["ms_per_step"]) < 1e-3
    (recipe,) = res["recipes"]  # timed in turn with the preset's run, round by round
    assert recipe["recipe"] == "shakespeare-cpu:max_lr=1e-3,dtype=float32" and len(recipe["rounds_ms"]) == 2
    assert abs(recipe["vs_preset"] - recipe["ms_per_step"] / res["ms_per_step"]) < 1e-2

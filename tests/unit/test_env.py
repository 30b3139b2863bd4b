"""`gpt2lab env`: what the inference probe has cached (the file, each model shape's device, time,
choices and figures), and `--clear-cache`, which removes that file and nothing else."""

from __future__ import annotations

import json
import os

import torch
from conftest import tiny_gpt

from gpt2lab import cli
from gpt2lab.inference import probe as prep
from gpt2lab.inference.choice import InferenceRequest, Timing
from gpt2lab.system import runtime
from gpt2lab.system.runtime import Facts

ZEN = Facts("cpu", "AMD EPYC (Zen 4)", ("avx512_bf16",), kernels=dict.fromkeys(("packed", "bfloat16/packed")))


def _cached(tmp_path, monkeypatch) -> None:
    """One entry, measured by decide with fake figures (bf16 faster), chosen for sample and score."""
    monkeypatch.setenv("GPT2LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2LAB_PROBE", raising=False)
    monkeypatch.setattr(prep, "estimate_seconds", lambda *a, **k: 1.0)
    monkeypatch.setattr(
        prep, "measure", lambda m, c, *a, **k: Timing(40.0, 2.0 if c.dtype == "float32" else 1.5 + len(c.kernel) / 10)
    )
    model = tiny_gpt(seed=0, vocab_size=97, block_size=16, n_layer=3)
    for workload in ("sample", "score"):
        prep.decide(model, torch.device("cpu"), InferenceRequest(linear="plain", workload=workload), facts=ZEN)
    monkeypatch.setattr(runtime, "measure_matmul", lambda device: runtime.Probe(100.0, 200.0))  # env's own, not ours


def test_env_lists_the_probe_cache_path_and_each_entry(tmp_path, monkeypatch, capsys):
    _cached(tmp_path, monkeypatch)
    monkeypatch.setattr(runtime, "machine_load", lambda: runtime.Load(4, 4, 2))  # torch was imported: afresh
    capsys.readouterr()
    assert cli.main(["env", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    busy = "threads sleep while they wait: 2 cores busy with other work, 4 of ours on 4 cores"
    assert f"threads_wait:          {busy}" in out
    at = next(i for i, line in enumerate(out) if line.startswith("probe_cache:"))
    path = str(tmp_path / "probes.json")
    assert out[at].split() == ["probe_cache:", path, "(1", "entry)"]
    [key] = json.loads((tmp_path / "probes.json").read_text())["entries"]
    assert out[at + 1].startswith(f"  {key}: 3 layers, 2 heads, 32 wide, vocabulary 97, block 16 on cpu, measured 20")
    # one dtype; the kernel by workload: sample's step bf16/plain 1.5 + 0.5 = 2.0 ms against decode's
    # 2.1; score's prefill, equal: the first by name
    assert out[at + 2] == "    chose: sample bfloat16/plain, score bfloat16/decode"
    assert "    float32/decode: prefill 40 ms, one-row step 2 ms" in out[at + 3 :]
    assert "    bfloat16/decode: prefill 40 ms, one-row step 2.1 ms" in out[at + 3 :]
    assert cli.main(["env", "--device", "cpu", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["probe_cache"]["path"] == path
    assert info["probe_cache"]["entries"] == json.loads((tmp_path / "probes.json").read_text())["entries"]


def test_env_clear_cache_removes_the_probe_file_only_and_says_so(tmp_path, monkeypatch, capsys):
    _cached(tmp_path, monkeypatch)
    (tmp_path / "other.json").write_text("{}")  # not the probe cache: stays
    (tmp_path / "notes").mkdir()
    capsys.readouterr()
    assert cli.main(["env", "--clear-cache"]) == 0
    path = tmp_path / "probes.json"
    assert capsys.readouterr().out == f"gpt2lab env: removed {path} (1 entry of measured figures)\n"
    assert sorted(os.listdir(tmp_path)) == ["notes", "other.json"]
    assert cli.main(["env", "--clear-cache"]) == 0
    assert capsys.readouterr().out == f"gpt2lab env: no probe cache at {path}; nothing removed\n"
    assert runtime.cached() == {}

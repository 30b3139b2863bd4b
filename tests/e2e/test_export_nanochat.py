"""The demo's default recipe leaves gpt2lab: a few steps of `shakespeare-cpu-fast` (its model as the demo
trains it), `gpt2lab export` to Hugging Face NanoChat, and `gpt2lab sample` of the export writes what
sampling the run writes; transformers' AutoModelForCausalLM computes the run's logits from the export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import env, run_gpt2lab

from gpt2lab.train.settings import load_preset


def _train(preset: str, data: str, run: Path, steps: int, *extra: str):
    """A few fp32 steps of ``preset`` into ``run``, no evaluation; the finished process."""
    r = run_gpt2lab(
        "train",
        "--preset",
        preset,
        "--data",
        data,
        "--out",
        str(run),
        "--max-steps",
        str(steps),
        "--eval-interval",
        "0",
        "--progress",
        "false",
        "--dtype",
        "float32",
        *extra,
        env=env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.slow
def test_the_demo_preset_exports_and_samples_the_same(tiny_data, tmp_path):  # noqa: F811
    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    r = _train("shakespeare-cpu-fast", tiny_data, run, 3, "--sample-interval", "0")
    assert "gpt2lab train: export    Hugging Face NanoChatForCausalLM" in r.stdout  # said before the first step
    assert json.loads((run / "run_info.json").read_text())["plan"]["export"] == "Hugging Face NanoChatForCausalLM"
    r = run_gpt2lab("export", str(run), str(hf_dir), env=env())
    assert r.returncode == 0, r.stderr
    assert "NanoChatForCausalLM" in r.stdout
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["NanoChatForCausalLM"]

    texts = []
    for model in (run, hf_dir):  # sample's defaults (temperature 1, top-k 50, seed 42), in fp32
        r = run_gpt2lab(
            "sample",
            "--model",
            str(model),
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "24",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-stop-at-eot",
            env={**env(), "GPT2LAB_PROBE": "0"},
        )  # the device's rule picks the kernels: nothing timed
        assert r.returncode == 0, r.stderr
        texts.append(r.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("--- sample 1/1\nROMEO:") and len(texts[0]) > 40

    import transformers

    from gpt2lab.weights.load import load_model

    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    ours = load_model(str(run))
    assert ours.config.modern() == load_preset("shakespeare-cpu-fast").model.modern()  # the demo's model
    assert not ours.config.bias and ours.config.embed_norm
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(idx)[0][..., :50257] - theirs(idx).logits).abs().max().item()
    assert diff <= 1e-4
    assert Path(hf_dir, "gpt2lab_export.json").is_file()


@pytest.mark.slow
def test_the_flagship_long_preset_exports_what_its_run_computes(tiny_data, tmp_path):  # noqa: F811
    """wiki-cpu-long-fast, its own shape and levers (the weight average: the checkpoint holds the average),
    a few steps: the export is a NanoChat whose logits are the run's."""
    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    _train("wiki-cpu-long-fast", tiny_data, run, 2)
    r = run_gpt2lab("export", str(run), str(hf_dir), env=env())
    assert r.returncode == 0, r.stderr
    import transformers

    from gpt2lab.weights.load import load_model

    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    assert type(theirs).__name__ == "NanoChatForCausalLM"
    ours = load_model(str(run))
    preset = load_preset("wiki-cpu-long-fast").model
    assert (ours.config.n_layer, ours.config.n_embd, ours.config.value_embeds) == (preset.n_layer, preset.n_embd, 0)
    idx = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(idx)[0][..., :50257] - theirs(idx).logits).abs().max().item()
    assert diff <= 1e-4

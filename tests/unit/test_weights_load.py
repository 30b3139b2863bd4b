"""Poor loading cases: a truncated model.safetensors or an invalid config.json in an HF
directory is one line naming the file in every command that takes a model; a resume with another
--lora-rank names the flag; the "another model shape" message lists only the fields that differ."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import damaged_copy, tiny_gpt

from gpt2lab import cli
from gpt2lab.checkpoint import store
from gpt2lab.system.errors import CheckpointError


def command(name: str, model: str, tmp_path, data: str) -> list[str]:
    return {
        "sample": ["sample", "--model", model, "--device", "cpu", "--max-new-tokens", "2"],
        "export": ["export", model, str(tmp_path / "exported")],
        "eval": ["eval", "loss", "--model", model, "--data", data, "--device", "cpu"],
        "serve": ["serve", "--model", model, "--device", "cpu", "--port", "0"],
        "train": [
            "train",
            "--preset",
            "shakespeare-cpu",
            "--init-from",
            model,
            "--data",
            data,
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "1",
        ],
    }[name]


@pytest.mark.parametrize("what", ["weights", "config"])
@pytest.mark.parametrize("name", ["sample", "export", "eval", "serve", "train"])
def test_a_damaged_hf_directory_is_one_line_naming_the_file(gpt2_vocab_export, tiny_data, tmp_path, capsys, name, what):
    _, d = gpt2_vocab_export
    bad = damaged_copy(d, str(tmp_path / "model"), what)
    code = cli.main(command(name, str(tmp_path / "model"), tmp_path, tiny_data))  # no SystemExit: cli.main's line
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines and bad in lines[-1], err
    assert "state.pt" not in err and "checkpoint" not in lines[-1], err  # not taken for a damaged checkpoint
    assert code == (2 if name == "train" else 1)  # train: --init-from is a flag value (InitFromError)
    assert not (tmp_path / "exported").exists() and not (tmp_path / "run").exists()


def test_another_model_shape_names_only_the_fields_that_differ(tmp_path):
    class Trainer:  # the trainer's part of state.pt
        def state_dict(self) -> dict:
            return {"step": 1}

    saved = tiny_gpt(n_layer=2, n_embd=32)
    parts = {"model": saved, "optimizer": torch.optim.SGD(saved.parameters(), lr=0.1), "trainer": Trainer()}
    store.save(str(tmp_path), 1, parts, {"model": dataclasses.asdict(saved.config)})
    ckpt = store.find_latest(str(tmp_path))
    other = tiny_gpt(n_layer=3, n_embd=32)
    with pytest.raises(CheckpointError) as e:
        store.load_weights(other, ckpt)
    msg = str(e.value)
    assert "n_layer 2 there, 3 here" in msg, msg
    assert "n_head" not in msg and "n_embd" not in msg and "vocab_size" not in msg, msg


@pytest.mark.parametrize(
    "argv, named",
    [(["export", "{src}", "{out}"], "SRC"), (["sample", "--model", "{src}", "--device", "cpu"], "--model")],
)
def test_a_missing_model_is_named_as_the_argument_that_gave_it(tmp_path, capsys, argv, named):
    src, out = str(tmp_path / "nowhere"), str(tmp_path / "out")
    assert cli.main([a.format(src=src, out=out) for a in argv]) == 1  # a model file that cannot be used
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f": {named} {src}: no such directory, and not a GPT-2 hub name" in lines[0], lines

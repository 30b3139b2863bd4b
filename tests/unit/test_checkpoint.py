"""Checkpoints: atomic, pruned, prefix-free, loadable with weights_only, accepted as a model spec."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.model.config import model_from_config
from gpt2lab.model.gpt import GPT
from gpt2lab.system import formats
from gpt2lab.system.errors import CheckpointError
from gpt2lab.train.optim import AdamW, param_groups
from gpt2lab.weights.load import WeightsError, load_model

CFG = {"model": dict(block_size=16, vocab_size=50304, token_vocab_size=50257, n_layer=2, n_head=2, n_embd=16)}


def _trained(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(model_from_config(CFG))
    opt = AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    x = torch.randint(0, 50257, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    return model, opt


class Plain:
    """A checkpoint part holding plain values (stands in for the loader and the trainer)."""

    def __init__(self, **values) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def _parts(model, opt, step=0) -> dict:
    return {
        "model": model,
        "optimizer": opt,
        "loader": Plain(position=step),
        "rng": ckpt.RNG(),
        "scaler": None,
        "trainer": Plain(step=step, tokens=step * 32),
    }


def _save(run, model, opt, step, keep=0):
    return ckpt.save(str(run), step, _parts(model, opt, step), CFG, keep=keep)


def test_roundtrip_restores_everything(tmp_path):
    model, opt = _trained()
    torch.manual_seed(99)
    path = _save(tmp_path, torch.compile(model), opt, 7)  # a compiled wrapper: keys must still be clean
    expected_rand = torch.rand(3)
    assert os.path.basename(path) == "step_000007"
    keys = load_file(os.path.join(path, "model.safetensors")).keys()
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in keys) and "lm_head.weight" not in keys

    fresh, fresh_opt = _trained(seed=1)
    parts = _parts(fresh, fresh_opt)
    ckpt.load(path, parts)
    assert torch.equal(torch.rand(3), expected_rand)  # torch RNG continues where it was saved
    assert parts["trainer"].values == {"step": 7, "tokens": 224} and parts["loader"].values == {"position": 7}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # the tie survives loading
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    assert json.load(open(os.path.join(path, "config.json"))) == {"format_version": formats.RUN.version, **CFG}
    assert torch.load(os.path.join(path, "state.pt"), weights_only=True)["format_version"] == formats.CHECKPOINT.version


def test_keep_newest_and_ignore_partial(tmp_path):
    model, opt = _trained()
    for step in (1, 2, 3, 4):
        _save(tmp_path, model, opt, step, keep=2)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["step_000003", "step_000004"]
    os.makedirs(tmp_path / "checkpoints" / ".tmp_step_000009_123")  # a save killed half-way
    os.makedirs(tmp_path / "checkpoints" / "step_000010")  # no state.pt: not complete
    assert ckpt.find_latest(str(tmp_path)).endswith("step_000004")


def test_load_model_from_run_or_checkpoint_dir(tmp_path):
    model, opt = _trained()
    _save(tmp_path, model, opt, 1)
    model.transformer.wte.weight.data.mul_(2)
    path = _save(tmp_path, model, opt, 2)
    x = torch.randint(0, 50257, (1, 8))
    for spec in (str(tmp_path), path):
        loaded = load_model(spec)
        assert loaded.config.token_vocab_size == 50257  # padded rows are never sampled
        assert torch.equal(loaded(x)[0], model.eval()(x)[0])


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(WeightsError, match="neither a checkpoint"):
        load_model(str(tmp_path))


def test_optimizer_file_loads_with_weights_only(tmp_path):
    model, opt = _trained()
    path = _save(tmp_path, model, opt, 1)
    for name in ("optimizer.pt", "state.pt"):
        torch.load(os.path.join(path, name), weights_only=True)  # raises on anything unsafe


def test_every_checkpoint_file_gets_the_umasks_mode(tmp_path):
    """atomic_dir gives each file 0666 less the umask, safetensors' 0600 model file included."""
    import stat

    model, opt = _trained()
    old = os.umask(0o027)
    try:
        path = _save(tmp_path, model, opt, 3)
    finally:
        os.umask(old)
    modes = {
        name: stat.S_IMODE(os.stat(os.path.join(path, name)).st_mode)
        for name in os.listdir(path)
        if os.path.isfile(os.path.join(path, name))
    }
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, {k: oct(v) for k, v in modes.items()}


def _rewrite(path: str, name: str, change) -> None:
    """Change one file of a checkpoint and its checksum with it (as another gpt2lab would have written it)."""
    file = os.path.join(path, name)
    if name == "state.pt":
        state = torch.load(file, weights_only=True)
        change(state)
        torch.save(state, file)
    else:
        config = json.load(open(file))
        change(config)
        json.dump(config, open(file, "w"))
    sums = json.load(open(os.path.join(path, ckpt.CHECKSUMS)))
    sums[name] = ckpt.sha256_file(file)
    json.dump(sums, open(os.path.join(path, ckpt.CHECKSUMS), "w"))


@pytest.mark.parametrize("name, fmt", [("state.pt", formats.CHECKPOINT), ("config.json", formats.RUN)])
@pytest.mark.parametrize("version", [None, 0, 99])
def test_a_checkpoint_of_another_format_version_is_refused_in_one_line(tmp_path, capsys, name, fmt, version):
    """By every reader: sample/eval/export (load_model), resume (load), --init-from (find_source)."""
    model, opt = _trained()
    path = _save(tmp_path, model, opt, 1)
    _rewrite(path, name, lambda d: d.pop("format_version") if version is None else d.update(format_version=version))
    older = "written by an older gpt2lab" if version != 99 else "written by a newer gpt2lab"
    todo = "train it again, or read it with the gpt2lab 0.1.x that wrote it" if version != 99 else "upgrade gpt2lab"
    from gpt2lab.train import init_from

    for read in (
        lambda: load_model(str(tmp_path)),
        lambda: ckpt.load(path, _parts(*_trained(1))),
        lambda: (ckpt.read_state(path), ckpt.read_config(path)),  # the readers of either file
        lambda: init_from.find_source(str(tmp_path)),
    ):
        with pytest.raises(CheckpointError) as e:
            read()
        text = str(e.value)
        assert text.startswith(f"{path}/{name}: ") and "\n" not in text, text
        assert all(w in text for w in (older, f"reads {fmt.what} format {fmt.version}", todo)), text
        assert (f"format {version}," in text) if version is not None else "without format_version" in text
    from gpt2lab.cli import main  # the command line: that line alone, exit 3

    assert main(["sample", "--model", path, "--device", "cpu", "--max-new-tokens", "1"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(text), err

"""The run config's formats: config.json nested by section (the architecture under "model", a
GPTConfig; the rest under "batch", "optim", ...), flat flags and TOML keys mapped into their
sections, and run directories written before the nesting (tests/data/v1_run, made by
tests/data/make_v1_run.sh at commit 929f8b8: every key flat) still loading for sample, eval,
export, report and --resume."""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpt2lab import cli
from gpt2lab.train.config import (ConfigError, TrainConfig, add_config_flags, config_file_values,
                                  config_value, load_preset, merge_config, model_from_config, nest_config,
                                  overrides_from_args, preset_names, tomllib)
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.data.tokenizer import get_tokenizer
from conftest import DATA

V1_RUN = DATA / "v1_run"
V1_CKPT = V1_RUN / "checkpoints" / "step_000003"
# The fixture's architecture, as make_v1_run.sh asked for it (written here by hand, not read).
V1_MODEL = GPTConfig(n_layer=2, n_head=2, n_embd=4, block_size=16, vocab_size=50304, token_vocab_size=50257)
# The flags make_v1_run.sh trained with (flat, as users give them).
V1_FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "4", "--block-size", "16", "--vocab-size", "50304",
            "--seq-len", "16", "--micro-batch-size", "2", "--total-batch-tokens", "64", "--warmup-steps", "1",
            "--max-lr", "1e-2", "--min-lr", "1e-3", "--seed", "7", "--dtype", "float32", "--compile", "false",
            "--device", "cpu", "--eval-interval", "0", "--hellaswag-interval", "0", "--sample-interval", "0",
            "--ckpt-interval", "0", "--progress", "false", "--keep-cpu-memory", "false"]


def _by_hand() -> GPT:
    """The fixture's weights in a GPT built from V1_MODEL, read with safetensors directly."""
    model = GPT(V1_MODEL).eval()
    missing, unexpected = model.load_state_dict(load_file(str(V1_CKPT / "model.safetensors")), strict=False)
    assert not unexpected and missing == ["lm_head.weight"]  # tied to wte, stored once
    return model


def _main(argv: list[str]) -> int:
    with mock.patch.object(sys, "argv", ["gpt2lab", *argv]):
        return cli.main(argv)


def test_fixture_is_in_the_old_flat_format():
    saved = json.loads((V1_CKPT / "config.json").read_text())
    assert "model" not in saved and saved["n_embd"] == 4 and "token_vocab_size" not in saved
    assert "optim" not in saved and saved["max_lr"] == 0.01 and saved["init_from_id"] is None
    assert model_from_config(saved) == V1_MODEL
    cfg = TrainConfig.from_dict(saved)
    assert cfg.model == V1_MODEL
    # every flat key lands in its section with its value; init_from_id (provenance) is dropped
    assert (cfg.optim.max_lr, cfg.optim.min_lr, cfg.batch.seq_len, cfg.batch.total_batch_tokens) == (0.01, 0.001, 16, 64)
    assert (cfg.system.dtype, cfg.system.compile, cfg.eval.sample_prompt, cfg.seed) == ("float32", "false", "ROMEO:", 7)
    assert (cfg.checkpoint.keep_checkpoints, cfg.spike.spike_window, cfg.finetune.init_from) == (2, 100, None)
    written = cfg.to_dict()
    assert "init_from_id" not in json.dumps(written)
    for key, value in saved.items():
        if key != "init_from_id":
            assert config_value(written, key) == value, key


def test_old_run_samples_and_exports_like_its_weights(tmp_path, capsys):
    import transformers

    from gpt2lab.weights.load import load_model

    ref = _by_hand()
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    loaded = load_model(str(V1_RUN))
    assert loaded.config == V1_MODEL
    with torch.no_grad():
        want = ref(idx)[0]
        assert torch.equal(loaded(idx)[0], want)
    out = tmp_path / "hf"
    assert _main(["export", str(V1_RUN), str(out)]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, want[..., :50257], rtol=0, atol=1e-5)
    # sample, greedy: the continuation is the argmax chain of transformers' model on the export
    enc = get_tokenizer()
    ids = enc.encode("ROMEO:")
    for _ in range(5):
        with torch.no_grad():
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    capsys.readouterr()
    assert _main(["sample", "--model", str(V1_RUN), "--prompt", "ROMEO:", "--max-new-tokens", "5",
                  "--temperature", "0", "--device", "cpu", "--dtype", "float32", "--no-stop-at-eot"]) == 0
    assert capsys.readouterr().out == f"--- sample 1/1\n{enc.decode(ids)}\n"


def _check_same_data(data: str) -> None:
    """The shards the fixture was trained on (make_v1_run.sh recorded their hashes)."""
    for line in (V1_RUN.parent / "v1_run.data.sha256").read_text().splitlines():
        digest, name = line.split()
        if name.endswith(".bin"):
            got = hashlib.sha256((Path(data) / Path(name).name).read_bytes()).hexdigest()
            assert got == digest, f"prepare('tinyshakespeare') no longer makes {name}; remake tests/data/v1_run"


def test_old_run_eval_loss_and_report(tiny_data, tmp_path, capsys):
    _check_same_data(tiny_data)
    raw = np.fromfile(Path(tiny_data) / "val_000000.bin", dtype=np.uint16, offset=1024)  # 256-int32 header
    rows = torch.from_numpy(raw[:4 * 16 + 1].astype(np.int64))
    x = torch.stack([rows[i * 16:i * 16 + 16] for i in range(4)])
    y = torch.stack([rows[i * 16 + 1:i * 16 + 17] for i in range(4)])
    with torch.no_grad():
        logits = _by_hand()(x)[0]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()
    capsys.readouterr()
    assert _main(["eval", "loss", "--model", str(V1_RUN), "--data", tiny_data, "--tokens", "64",
                  "--batch-size", "2", "--device", "cpu", "--dtype", "float32"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["loss"] == pytest.approx(want, abs=1e-5)
    run = tmp_path / "v1_run"
    shutil.copytree(V1_RUN, run)  # report writes beside the run
    assert _main(["report", str(run)]) == 0
    assert "| model | 2 layers, 2 heads, 4 wide |" in (run / "report.md").read_text()


def test_old_run_resumes_from_its_step(tiny_data, tmp_path):
    """--resume continues at step 3; that step's loss is the fixture's weights' loss on the batch its
    saved loader position yields, computed here directly."""
    from gpt2lab.data import TokenLoader

    _check_same_data(tiny_data)
    run = tmp_path / "v1_run"
    shutil.copytree(V1_RUN, run)
    state = torch.load(V1_CKPT / "state.pt", weights_only=True)
    assert state["step"] == 3
    loader = TokenLoader(tiny_data, "train", 2, 16, seed=7)
    loader.load_state_dict(state["loader"])
    model = _by_hand()
    with torch.no_grad():
        want = sum(model(*loader.next_batch())[1].item() for _ in range(2)) / 2  # 2 micro-steps
    assert _main(["train", "--preset", "shakespeare-cpu", *V1_FLAGS, "--data", tiny_data, "--out", str(run),
                  "--max-steps", "4", "--resume", "auto"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if "train_loss" in r][3:]
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["train_loss"] == pytest.approx(want, rel=1e-6)
    info = json.loads((run / "run_info.json").read_text())
    assert info["resumed_from"].endswith("step_000003")
    written = json.loads((run / "checkpoints" / "step_000004" / "config.json").read_text())
    assert written["model"] == V1_MODEL.to_dict() and "n_layer" not in written  # now nested
    assert written["optim"]["max_lr"] == 0.01 and "max_lr" not in written and "init_from_id" not in written


# -- the nested config, its flat flags and keys ----------------------------------------------
def _flags(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return overrides_from_args(p.parse_args(argv))


def test_flat_flags_and_toml_keys_map_into_the_model():
    flags = _flags(["--n-layer", "3", "--n-embd", "48", "--n-head", "4", "--attn-pdrop", "0.1",
                    "--layer-norm-epsilon", "1e-6", "--max-steps", "9"])
    cfg = load_preset("shakespeare-cpu", **flags)
    base = load_preset("shakespeare-cpu")
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.attn_pdrop) == (3, 48, 4, 0.1)
    assert cfg.model.layer_norm_epsilon == 1e-6 and cfg.optim.max_steps == 9
    assert cfg.model.block_size == base.model.block_size == 128  # the preset's, untouched
    assert cfg.model.token_vocab_size == 50257  # derived, not a flag
    with pytest.raises(SystemExit):
        _flags(["--token-vocab-size", "50257"])
    flat = tomllib.loads("n_layer = 3\nn_head = 4\nmax_steps = 9\n")
    table = tomllib.loads("max_steps = 9\n[model]\nn_layer = 3\nn_head = 4\n")
    assert TrainConfig.from_dict(flat) == TrainConfig.from_dict(table)
    assert TrainConfig.from_dict(table).model.n_layer == 3
    # a flag over its preset's table: merged, layer over layer (in one dict, both is an error)
    assert TrainConfig.from_dict(merge_config(table, {"n_layer": 5})).model.n_layer == 5
    with pytest.raises(ConfigError, match=r"n_layer set both as a key and in \[model\]; keep one"):
        TrainConfig.from_dict({**table, "n_layer": 5})


def test_preset_files_may_use_a_model_table(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from gpt2lab.train import config

    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "flat.toml").write_text("n_layer = 2\nn_embd = 32\nn_head = 2\nmax_steps = 5\n")
    (tmp_path / "presets" / "nested.toml").write_text('base = "flat"\nmax_steps = 6\n[model]\nn_layer = 3\n')
    (tmp_path / "presets" / "both.toml").write_text("n_layer = 2\n[model]\nn_layer = 3\n")
    monkeypatch.setattr(config, "resources", SimpleNamespace(files=lambda package: tmp_path))
    cfg = load_preset("nested", n_head=4)
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.optim.max_steps) == (3, 32, 4, 6)
    with pytest.raises(ConfigError, match=r"both.toml: n_layer set both as a key and in \[model\]; keep one"):
        load_preset("both")


@pytest.mark.parametrize("values, words", [
    ({"n_layers": 3}, ["unknown field(s) n_layers", "n_layer"]),
    ({"model": {"n_layers": 3}}, ["unknown model field(s) n_layers", "n_layer"]),
    ({"model": 3}, ['"model" must be a table']),
    ({"n_layer": 0}, ["n_layer must be >= 1, got 0"]),
    ({"model": {"n_layer": "2"}}, ["n_layer must be a whole number, got '2'"]),
    ({"attn_pdrop": True}, ["attn_pdrop must be a number, got True"]),
    ({"model": {"n_head": 5}}, ["n_embd 768 is not divisible by n_head 5"]),
    ({"resid_pdrop": 1.5}, ["resid_pdrop 1.5 must be in [0, 1)"]),
    ({"token_vocab_size": 100}, ["token_vocab_size 100", "drop it"]),
])
def test_bad_model_values_get_one_line(values, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(values, source="x.toml")
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_bad_model_flag_exits_2_with_one_line(capsys):
    assert _main(["train", "--preset", "shakespeare-cpu", "--n-head", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "n_embd 192 is not divisible by n_head 5" in err


def test_config_json_round_trips():
    cfg = load_preset("gpt2-350m", attn_pdrop=0.1)
    written = json.loads(json.dumps(cfg.to_dict()))
    assert list(written) == ["model", "data", "out", "seed", "batch", "optim", "system", "eval", "checkpoint",
                             "logging", "spike", "finetune", "parallel"]
    assert set(written["model"]) == {f for f in GPTConfig.__dataclass_fields__}
    assert "n_layer" not in written and written["model"]["n_layer"] == 24
    assert written["batch"] == {"micro_batch_size": 64, "seq_len": 1024, "total_batch_tokens": 524288,
                                "batch_ramp_steps": 0, "batch_ramp_start": None}  # the batch ramp: off
    assert written["spike"] == {"spike_window": 100, "spike_loss_z": 6.0, "spike_norm_z": 20.0, "spike_rollback": 3}
    assert (written["optim"]["max_lr"], written["optim"]["min_lr"], written["parallel"]["strategy"]) == \
        (3e-4, 3e-5, "auto")
    assert (written["data"], written["out"], written["seed"]) == ("data/fineweb-edu-10b", "runs/gpt2-350m", 1337)
    assert TrainConfig.from_dict(written) == cfg
    assert model_from_config(written) == cfg.model


def _flatten(nested: dict) -> dict:
    """The old flat form of a nested config: every section's keys at the top (written by hand here)."""
    flat = {}
    for key, value in nested.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def test_flat_nested_and_mixed_forms_give_equal_configs():
    cfg = load_preset("gpt2-124m-fast", seed=5, spike_window=9, lora_targets="c_fc", keep_checkpoints=1)
    nested = cfg.to_dict()
    flat = _flatten(nested)
    # data, out and seed, then each section's fields: no name in two sections
    assert len(flat) == 3 + sum(len(v) for v in nested.values() if isinstance(v, dict))
    assert flat["muon_lr"] == 0.02 and flat["spike_window"] == 9 and flat["pos_emb"] == "rotary"
    mixed = {k: v for k, v in nested.items() if k not in ("optim", "spike")}
    mixed.update({**nested["optim"], **nested["spike"]})  # two sections flat, the others nested
    assert TrainConfig.from_dict(flat) == TrainConfig.from_dict(mixed) == TrainConfig.from_dict(nested) == cfg
    assert nest_config(flat) == nest_config(mixed) == nested


def _toml_chain(name: str) -> dict:
    """A shipped preset's keys with its base presets' under them, read from the TOML text here."""
    from importlib import resources

    own = tomllib.loads((resources.files("gpt2lab") / "presets" / f"{name}.toml").read_text())
    base = own.pop("base", None)
    return {**(_toml_chain(base) if base else {}), **own}


@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_preset_is_flat_and_keeps_its_values(name):
    keys = _toml_chain(name)
    assert keys and not any(isinstance(v, dict) for v in keys.values())  # flat, as written before the nesting
    got = load_preset(name).to_dict()
    for key, value in keys.items():
        assert config_value(got, key) == value, key
    defaults = _flatten(TrainConfig.from_dict({}).to_dict())
    for key, value in _flatten(got).items():  # every key the presets do not set keeps its default
        if key not in keys and key != "token_vocab_size":
            assert value == defaults[key], key


def test_presets_land_in_their_sections():
    """A few values checked against the presets' TOML text by hand."""
    xl = load_preset("gpt2-1558m")
    assert (xl.model.n_layer, xl.model.n_head, xl.model.n_embd) == (48, 25, 1600)
    assert (xl.batch.micro_batch_size, xl.batch.total_batch_tokens, xl.batch.seq_len) == (16, 1048576, 1024)
    assert (xl.optim.max_steps, xl.optim.warmup_steps, xl.optim.max_lr, xl.optim.min_lr) == (9536, 358, 2e-4, 2e-5)
    assert (xl.parallel.strategy, xl.eval.eval_interval, xl.checkpoint.ckpt_interval, xl.out) == \
        ("auto", 250, 5000, "runs/gpt2-1558m")  # eval_interval and ckpt_interval from its base, gpt2-124m
    ft = load_preset("finetune-shakespeare")
    assert (ft.finetune.init_from, ft.model.attn_pdrop, ft.eval.eval_tokens, ft.eval.sample_prompt) == \
        ("gpt2", 0.1, 8192, "ROMEO:")
    assert (ft.logging.log_interval, ft.checkpoint.keep_checkpoints, ft.optim.max_lr, ft.optim.min_lr) == \
        (10, 2, 3e-5, 3e-5)
    fast = load_preset("gpt2-124m-fast")
    assert (fast.optim.optimizer, fast.optim.lr_schedule, fast.optim.decay_frac, fast.optim.muon_ns_dtype) == \
        ("muon", "wsd", 0.4, "auto")


def test_old_config_json_with_init_from_id_loads(tmp_path):
    """config.json as written before the sections (the model nested, the rest flat) with the
    provenance key init_from_id: it loads, the key dropped; a resume reads it back as provenance."""
    import torch

    from gpt2lab.train.gather import began_from

    cfg = load_preset("finetune-shakespeare")
    nested = cfg.to_dict()
    old = {"model": nested["model"], **_flatten({k: v for k, v in nested.items() if k != "model"}),
           "init_from_id": "sha256:" + "ab" * 32}
    assert "max_lr" in old and "optim" not in old
    assert TrainConfig.from_dict(old) == cfg and "init_from_id" not in json.dumps(cfg.to_dict())
    # a checkpoint written before: its state.pt has no record, its config.json the id
    torch.save({"step": 3, "tokens": 0}, tmp_path / "state.pt")
    assert began_from(str(tmp_path), old) == {"source": "gpt2", "id": "sha256:" + "ab" * 32}
    assert began_from(str(tmp_path), {**old, "init_from_id": None}) is None  # the v1 fixture's null
    record = {"source": "gpt2", "kind": "hub", "id": "sha256:" + "cd" * 32}  # one written now: state.pt's wins
    torch.save({"step": 3, "tokens": 0, "init_from": record}, tmp_path / "state.pt")
    assert began_from(str(tmp_path), nested) == record


@pytest.mark.parametrize("values, message", [
    ({"optim": {"spike_window": 3}}, "x.toml: spike_window is in [optim] but belongs in [spike]"),
    ({"model": {"max_lr": 1e-3}}, "x.toml: max_lr is in [model] but belongs in [optim]"),
    ({"optim": {"seed": 3}}, "x.toml: seed is in [optim] but belongs at the top level"),
    ({"optim": {"max_lrr": 1e-3}}, "x.toml: unknown optim field(s) max_lrr; known optim fields: max_steps, max_lr,"),
    ({"max_lrr": 1e-3}, "x.toml: unknown field(s) max_lrr; known fields: "),
    ({"optimizer": "muon", "optim": {"optimizer": "adamw"}},
     "x.toml: optimizer set both as a key and in [optim]; keep one"),
    ({"spike": 3}, 'x.toml: "spike" must be a table of spike fields (spike_window, spike_loss_z'),
    ({"optim": {"max_steps": 2.5}}, "x.toml: max_steps must be a whole number, got 2.5"),
    ({"system": {"keep_cpu_memory": "yes"}}, "x.toml: keep_cpu_memory must be true or false, got 'yes'"),
])
def test_a_key_unknown_or_in_the_wrong_section_is_one_line(values, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(values, source="x.toml")
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_toml_files_take_section_tables_and_flags_go_over_them(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text('base = "shakespeare-cpu"\nmax_steps = 9\n[optim]\nmax_lr = 1e-3\nmin_lr = 1e-4\n'
                    "[spike]\nspike_window = 7\n")
    values = config_file_values(str(path))
    assert values["optim"]["max_lr"] == 1e-3 and values["optim"]["max_steps"] == 9 and values["spike"] == {
        "spike_window": 7}
    cfg = TrainConfig.from_dict(values)
    base = load_preset("shakespeare-cpu")
    assert (cfg.optim.max_steps, cfg.optim.max_lr, cfg.optim.min_lr, cfg.spike.spike_window) == (9, 1e-3, 1e-4, 7)
    assert cfg.model == base.model and cfg.batch == base.batch and cfg.spike.spike_rollback == 3
    # train --config FILE with flags: the flags win field by field, the file's other values stay
    from gpt2lab.commands.train import _request

    args = cli.build_parser().parse_args(["train", "--config", str(path), "--max-lr", "2e-3", "--spike-window", "5",
                                          "--n-layer", "3"])
    request = _request(args)
    assert request.values["optim"]["max_lr"] == 2e-3 and request.values["optim"]["min_lr"] == 1e-4
    assert request.values["spike"] == {"spike_window": 5} and request.explicit == {"n_layer": 3}
    assert request.get("max_steps") == 9 and request.get("spike_rollback") == 3  # the file's, the default
    # a key twice in one file, or in the wrong table: one line naming the file
    path.write_text("max_lr = 1e-3\n[optim]\nmax_lr = 2e-3\n")
    with pytest.raises(ConfigError, match=rf"^{path}: max_lr set both as a key and in \[optim\]; keep one$"):
        config_file_values(str(path))
    path.write_text("[batch]\nmax_lr = 2e-3\n")
    assert _main(["train", "--config", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"gpt2lab train: {path}: max_lr is in [batch] but belongs in [optim]"


def test_a_run_directory_is_known_by_its_config_json_of_either_form(tmp_path):
    """gpt2lab may write into a run of its own: a run dir with only a config.json (killed before
    run_info.json) or only copied checkpoints is known by the config's keys, nested or flat."""
    from gpt2lab.system import rundir

    written = load_preset("shakespeare-cpu").to_dict()
    for name, config in (("nested", written), ("flat", _flatten(written)), ("v1", json.loads(
            (V1_CKPT / "config.json").read_text()))):
        alone = tmp_path / name / "alone"
        alone.mkdir(parents=True)
        (alone / "config.json").write_text(json.dumps(config))
        copied = tmp_path / name / "copied" / "checkpoints" / "step_000004"
        copied.mkdir(parents=True)
        (copied / "config.json").write_text(json.dumps(config))
        assert rundir.inspect(str(alone)).kind == rundir.inspect(str(copied.parent.parent)).kind == rundir.RUN, name
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "config.json").write_text(json.dumps({"optim": {"max_steps": 3}, "model": {}}))
    assert rundir.inspect(str(tmp_path / "theirs")).kind == "foreign"

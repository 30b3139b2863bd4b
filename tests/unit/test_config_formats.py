"""The run config's formats: config.json nested by section (the architecture under "model", a
GPTConfig; the rest under "batch", "optim", ...) with its format_version, flat flags and TOML
keys mapped into their sections, and the one check of every file's format version
(system/formats.py): a file of an older version (a config.json without one: the flat or
half-nested form of gpt2lab 0.1.0's first runs) or a newer one is refused in one line."""

from __future__ import annotations

import argparse
import json
import sys
from unittest import mock

import pytest

from gpt2lab import cli
from gpt2lab.model.config import config_value, model_from_config
from gpt2lab.model.gpt import GPTConfig
from gpt2lab.system import formats
from gpt2lab.train.config import ConfigError, TrainConfig, merge_config, nest_config, save_config
from gpt2lab.train.settings import (
    add_config_flags,
    config_file_values,
    load_preset,
    overrides_from_args,
    preset_names,
    tomllib,
)


def _main(argv: list[str]) -> int:
    with mock.patch.object(sys, "argv", ["gpt2lab", *argv]):
        return cli.main(argv)


# -- the nested config, its flat flags and keys ----------------------------------------------
def _flags(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return overrides_from_args(p.parse_args(argv))


def test_flat_flags_and_toml_keys_map_into_the_model():
    flags = _flags(
        [
            "--n-layer",
            "3",
            "--n-embd",
            "48",
            "--n-head",
            "4",
            "--attn-pdrop",
            "0.1",
            "--layer-norm-epsilon",
            "1e-6",
            "--max-steps",
            "9",
        ]
    )
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

    from gpt2lab.train import settings

    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "flat.toml").write_text("n_layer = 2\nn_embd = 32\nn_head = 2\nmax_steps = 5\n")
    (tmp_path / "presets" / "nested.toml").write_text('base = "flat"\nmax_steps = 6\n[model]\nn_layer = 3\n')
    (tmp_path / "presets" / "both.toml").write_text("n_layer = 2\n[model]\nn_layer = 3\n")
    monkeypatch.setattr(settings, "resources", SimpleNamespace(files=lambda package: tmp_path))
    cfg = load_preset("nested", n_head=4)
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.optim.max_steps) == (3, 32, 4, 6)
    with pytest.raises(ConfigError, match=r"both.toml: n_layer set both as a key and in \[model\]; keep one"):
        load_preset("both")


@pytest.mark.parametrize(
    "values, words",
    [
        ({"n_layers": 3}, ["unknown field(s) n_layers", "n_layer"]),
        ({"model": {"n_layers": 3}}, ["unknown model field(s) n_layers", "n_layer"]),
        ({"model": 3}, ['"model" must be a table']),
        ({"n_layer": 0}, ["n_layer 0 must be >= 1"]),
        ({"model": {"n_layer": "2"}}, ["n_layer must be a whole number, got '2'"]),
        ({"attn_pdrop": True}, ["attn_pdrop must be a number, got True"]),
        ({"model": {"n_head": 5}}, ["n_embd 768 is not divisible by n_head 5"]),
        ({"resid_pdrop": 1.5}, ["resid_pdrop 1.5 must be in [0, 1)"]),
        ({"token_vocab_size": 100}, ["token_vocab_size 100", "drop it"]),
    ],
)
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
    assert list(written) == [
        "model",
        "data",
        "out",
        "seed",
        "batch",
        "optim",
        "system",
        "eval",
        "checkpoint",
        "logging",
        "spike",
        "finetune",
        "parallel",
    ]
    assert set(written["model"]) == {f for f in GPTConfig.__dataclass_fields__}
    assert "n_layer" not in written and written["model"]["n_layer"] == 24
    assert written["batch"] == {
        "micro_batch_size": 64,
        "seq_len": 1024,
        "total_batch_tokens": 524288,
        "batch_ramp_steps": 0,
        "batch_ramp_start": None,
        "seq_len_ramp_steps": 0,
        "seq_len_start": None,
    }  # the batch and sequence-length ramps: off
    assert written["spike"] == {"spike_window": 100, "spike_loss_z": 6.0, "spike_norm_z": 20.0, "spike_rollback": 3}
    assert (written["optim"]["max_lr"], written["optim"]["min_lr"], written["parallel"]["strategy"]) == (
        3e-4,
        3e-5,
        "auto",
    )
    assert (written["data"], written["out"], written["seed"]) == ("data/fineweb-edu-10b", "runs/gpt2-350m", 1337)
    assert TrainConfig.from_dict(written) == cfg
    assert model_from_config(written) == cfg.model


def test_config_json_is_written_with_its_format_version_and_read_back(tmp_path):
    cfg = load_preset("shakespeare-cpu", seed=3)
    path = tmp_path / "config.json"
    save_config(cfg, str(path))
    saved = json.loads(path.read_text())
    assert list(saved)[:2] == ["format_version", "model"] and saved["format_version"] == formats.RUN.version == 2
    assert {k: v for k, v in saved.items() if k != "format_version"} == cfg.to_dict()
    assert TrainConfig.from_dict(formats.unstamp(saved, str(path), formats.RUN)) == cfg


def _flatten(nested: dict) -> dict:
    """The flat form of a nested config (flags, TOML keys): every section's keys at the top."""
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
    assert keys and not any(isinstance(v, dict) for v in keys.values())  # flat: the presets' own form
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
    assert (xl.parallel.strategy, xl.eval.eval_interval, xl.checkpoint.ckpt_interval, xl.out) == (
        "auto",
        250,
        5000,
        "runs/gpt2-1558m",
    )  # eval_interval and ckpt_interval from its base, gpt2-124m
    ft = load_preset("finetune-shakespeare")
    assert (ft.finetune.init_from, ft.model.attn_pdrop, ft.eval.eval_tokens, ft.eval.sample_prompt) == (
        "gpt2",
        0.1,
        8192,
        "ROMEO:",
    )
    assert (ft.logging.log_interval, ft.checkpoint.keep_checkpoints, ft.optim.max_lr, ft.optim.min_lr) == (
        10,
        2,
        3e-5,
        3e-5,
    )
    fast = load_preset("gpt2-124m-fast")
    assert (fast.optim.optimizer, fast.optim.lr_schedule, fast.optim.decay_frac, fast.optim.muon_ns_dtype) == (
        "muon",
        "wsd",
        0.4,
        "auto",
    )


def test_a_retired_key_is_refused():
    """init_from_id (what --init-from resolved to, now the plan's record in state.pt) was in the
    first runs' config.json; no setting reads it now."""
    with pytest.raises(
        ConfigError, match=r"^x.toml: unknown field\(s\) init_from_id \(did you mean init_from\?\); known"
    ):
        TrainConfig.from_dict({"init_from_id": "sha256:" + "ab" * 32}, source="x.toml")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"optim": {"spike_window": 3}}, "x.toml: spike_window is in [optim] but belongs in [spike]"),
        ({"model": {"max_lr": 1e-3}}, "x.toml: max_lr is in [model] but belongs in [optim]"),
        ({"optim": {"seed": 3}}, "x.toml: seed is in [optim] but belongs at the top level"),
        (
            {"optim": {"max_lrr": 1e-3}},
            "x.toml: unknown optim field(s) max_lrr; known optim fields: max_steps, max_lr,",
        ),
        ({"max_lrr": 1e-3}, "x.toml: unknown field(s) max_lrr (did you mean max_lr?); known fields: "),
        (
            {"optimizer": "muon", "optim": {"optimizer": "adamw"}},
            "x.toml: optimizer set both as a key and in [optim]; keep one",
        ),
        ({"spike": 3}, 'x.toml: "spike" must be a table of spike fields (spike_window, spike_loss_z'),
        ({"optim": {"max_steps": 2.5}}, "x.toml: max_steps must be a whole number, got 2.5"),
        ({"system": {"keep_cpu_memory": "yes"}}, "x.toml: keep_cpu_memory must be true or false, got 'yes'"),
    ],
)
def test_a_key_unknown_or_in_the_wrong_section_is_one_line(values, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(values, source="x.toml")
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_toml_files_take_section_tables_and_flags_go_over_them(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text(
        'base = "shakespeare-cpu"\nmax_steps = 9\n[optim]\nmax_lr = 1e-3\nmin_lr = 1e-4\n[spike]\nspike_window = 7\n'
    )
    values = config_file_values(str(path))
    assert (
        values["optim"]["max_lr"] == 1e-3
        and values["optim"]["max_steps"] == 9
        and values["spike"] == {"spike_window": 7}
    )
    cfg = TrainConfig.from_dict(values)
    base = load_preset("shakespeare-cpu")
    assert (cfg.optim.max_steps, cfg.optim.max_lr, cfg.optim.min_lr, cfg.spike.spike_window) == (9, 1e-3, 1e-4, 7)
    assert cfg.model == base.model and cfg.batch == base.batch and cfg.spike.spike_rollback == 3
    # train --config FILE with flags: the flags win field by field, the file's other values stay
    from gpt2lab.commands.train import request_from

    args = cli.build_parser().parse_args(
        ["train", "--config", str(path), "--max-lr", "2e-3", "--spike-window", "5", "--n-layer", "3"]
    )
    request = request_from(args)
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


def test_a_run_directory_is_known_by_its_nested_config_json(tmp_path):
    """gpt2lab may write into a run of its own: a run dir with only a config.json (killed before
    run_info.json) or only copied checkpoints is known by the config's sections; the flat form
    of the first runs' config.json is not a run's any more."""
    from gpt2lab.system import rundir

    written = load_preset("shakespeare-cpu").to_dict()
    for name, config, kind in (
        ("nested", written, rundir.RUN),
        ("stamped", formats.stamp(written, formats.RUN), rundir.RUN),
        ("flat", _flatten(written), "foreign"),
    ):
        alone = tmp_path / name / "alone"
        alone.mkdir(parents=True)
        (alone / "config.json").write_text(json.dumps(config))
        copied = tmp_path / name / "copied" / "checkpoints" / "step_000004"
        copied.mkdir(parents=True)
        (copied / "config.json").write_text(json.dumps(config))
        assert rundir.inspect(str(alone)).kind == rundir.inspect(str(copied.parent.parent)).kind == kind, name
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "config.json").write_text(json.dumps({"optim": {"max_steps": 3}, "model": {}}))
    assert rundir.inspect(str(tmp_path / "theirs")).kind == "foreign"


# -- format versions: system/formats.py --------------------------------------------------------
OLDER = "written by an older gpt2lab; this gpt2lab (0.1.0) reads"
AGAIN = "train it again, or read it with the gpt2lab 0.1.x that wrote it"


@pytest.mark.parametrize(
    "found, words",
    [
        (None, ["RUN/config.json: a run config without format_version,", OLDER + " run config format 2;", AGAIN]),
        (1, ["RUN/config.json: run config format 1, " + OLDER + " run config format 2;", AGAIN]),
        (
            3,
            [
                "RUN/config.json: run config format 3, written by a newer gpt2lab; this gpt2lab (0.1.0) reads run "
                "config format 2; upgrade gpt2lab to read it"
            ],
        ),
        ("2", ["RUN/config.json: run config format '2', unknown to this gpt2lab;", "upgrade gpt2lab"]),
        (True, ["RUN/config.json: run config format True, unknown to this gpt2lab;"]),
    ],
)
def test_another_format_version_is_refused_in_one_line(found, words):
    with pytest.raises(ConfigError) as e:
        formats.check_version("RUN/config.json", found, formats.RUN)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_stamp_and_unstamp():
    stamped = formats.stamp({"model": {}, "format_version": 7}, formats.RUN)
    assert stamped == {"format_version": 2, "model": {}} and list(stamped)[0] == "format_version"
    assert formats.unstamp(stamped, "x", formats.RUN) == {"model": {}}
    formats.check_version("x", formats.CHECKPOINT.version, formats.CHECKPOINT)  # its own version passes
    from gpt2lab.system.errors import CheckpointError

    with pytest.raises(
        CheckpointError,
        match="^CKPT/state.pt: checkpoint format 2, written by a newer gpt2lab; "
        r"this gpt2lab \(0.1.0\) reads checkpoint format 1; upgrade gpt2lab to read it$",
    ):
        formats.unstamp({"format_version": 2}, "CKPT/state.pt", formats.CHECKPOINT, CheckpointError)
    v = formats.PROBES.version
    assert formats.is_current({"version": v, "probes": {}}, formats.PROBES, key="version")
    assert not any(
        formats.is_current(d, formats.PROBES, key="version")
        for d in ({"version": v - 1}, {"version": v + 1}, {}, [], {"version": str(v)})
    )


def _old_run(path, config: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.jsonl").write_text(
        '{"step": 0, "train_loss": 5.0, "dt_ms": 10, "tok_per_s": 1, "tokens": 64}\n{"step": 1, "val_loss": 4.0}\n'
    )
    return str(path)


@pytest.mark.parametrize("command", ["report", "plot", "compare"])
def test_report_plot_and_compare_refuse_a_run_of_another_format_in_one_line(command, tmp_path, capsys):
    written = load_preset("shakespeare-cpu").to_dict()
    runs = {
        "flat": (_flatten(written), "a run config without format_version, " + OLDER),
        "half": (
            {"model": written["model"], **_flatten({k: v for k, v in written.items() if k != "model"})},
            "a run config without format_version, " + OLDER,
        ),
        "newer": (
            {**formats.stamp(written, formats.RUN), "format_version": 3},
            "run config format 3, written by a newer gpt2lab",
        ),
    }
    good = _old_run(tmp_path / "good", formats.stamp(written, formats.RUN))
    for name, (config, words) in runs.items():
        run = _old_run(tmp_path / name, config)
        argv = {
            "report": ["report", run],
            "plot": ["plot", run, "--out", str(tmp_path / "p.png")],
            "compare": ["compare", good, run],
        }[command]
        assert _main(argv) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{run}/config.json: {words}" in err, err
        assert (AGAIN if name != "newer" else "upgrade gpt2lab to read it") in err, err
    assert (
        _main(
            {
                "report": ["report", good],
                "plot": ["plot", good, "--out", str(tmp_path / "p.png")],
                "compare": ["compare", good, good],
            }[command]
        )
        == 0
    )

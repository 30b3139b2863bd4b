"""Config: presets parse, CLI flags come from the dataclass, bad settings fail early and clearly."""

from __future__ import annotations

import argparse

import pytest

from gpt2lab.model.config import config_value
from gpt2lab.train.config import FIELDS, ConfigError, TrainConfig
from gpt2lab.train.settings import add_config_flags, load_preset, overrides_from_args, preset_names

REFERENCE = dict(
    total_batch_tokens=524288,
    micro_batch_size=64,
    seq_len=1024,
    max_lr=6e-4,
    min_lr=6e-5,
    warmup_steps=715,
    max_steps=19073,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    grad_clip=1.0,
    vocab_size=50304,
    dtype="auto",
    compile="auto",
    eval_interval=250,
    ckpt_interval=5000,
    n_layer=12,
    n_head=12,
    n_embd=768,
)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_parses_and_divides(name):
    cfg = load_preset(name)
    assert cfg.batch.seq_len <= cfg.model.block_size
    accum = cfg.grad_accum_steps(1)
    assert accum * cfg.batch.micro_batch_size * cfg.batch.seq_len == cfg.batch.total_batch_tokens


def test_expected_presets_are_shipped():
    assert {
        "gpt2-124m",
        "gpt2-124m-40b",
        "gpt3-124m",
        "gpt2-350m",
        "gpt2-774m",
        "gpt2-1558m",
        "shakespeare-cpu",
    } <= set(preset_names())


def test_gpt2_124m_is_the_reference_run():
    cfg = load_preset("gpt2-124m")
    for key, value in REFERENCE.items():
        assert config_value(cfg.to_dict(), key) == value, key
    assert cfg.grad_accum_steps(8) == 1 and cfg.grad_accum_steps(1) == 8
    # on a bf16 GPU "auto" is the recipe's setting: bf16 autocast and torch.compile
    from gpt2lab.system.runtime import Facts, resolve

    res = resolve("cuda", cfg.system.dtype, cfg.system.compile, facts=Facts("cuda", "NVIDIA H100", cuda_bf16=True))
    assert (res.dtype.value, res.compile.value) == ("bfloat16", True)
    forty = load_preset("gpt2-124m-40b")
    assert forty.optim.max_steps == 4 * cfg.optim.max_steps and forty.optim.max_lr == cfg.optim.max_lr
    gpt3 = load_preset("gpt3-124m")
    assert (gpt3.batch.seq_len, gpt3.batch.micro_batch_size, gpt3.batch.total_batch_tokens) == (2048, 32, 524288)


def test_compile_as_a_bool_is_its_text():
    """compile=True/False from Python (load_preset, from_dict) or a TOML file: "true"/"false"."""
    cfg = TrainConfig.from_dict({"compile": True, "dtype": "bfloat16"})
    assert (cfg.system.compile, cfg.system.dtype) == ("true", "bfloat16")
    assert TrainConfig.from_dict({"compile": False}).system.compile == "false"
    assert TrainConfig.from_dict({"compile": False}).to_dict()["system"]["compile"] == "false"  # saved as text


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return overrides_from_args(p.parse_args(argv))


def test_every_field_is_a_flag_and_only_given_flags_override():
    p = argparse.ArgumentParser()
    add_config_flags(p)
    flags = {a.dest for a in p._actions} - {"help"}
    # one flat flag per field of every section, but no derived or retired one
    assert flags == set(FIELDS) - {"token_vocab_size", "chat_template", "tokenizer"}
    assert {"n_layer", "attn_pdrop", "max_lr", "spike_window", "lora_rank"} <= flags and "init_from_id" not in flags
    got = _parse(
        [
            "--max-steps",
            "7",
            "--compile",
            "false",
            "--max-lr",
            "2e-3",
            "--dtype",
            "float32",
            "--peak-flops",
            "none",
            "--hellaswag-data",
            "x.jsonl",
            "--seed",
            "3",
        ]
    )
    assert got == {
        "seed": 3,
        "optim": {"max_steps": 7, "max_lr": 2e-3},
        "system": {"compile": "false", "dtype": "float32", "peak_flops": None},
        "eval": {"hellaswag_data": "x.jsonl"},
    }
    cfg, base = load_preset("shakespeare-cpu", **got), load_preset("shakespeare-cpu")
    assert (cfg.optim.max_steps, cfg.optim.max_lr, cfg.system.compile, cfg.eval.hellaswag_data, cfg.seed) == (
        7,
        2e-3,
        "false",
        "x.jsonl",
        3,
    )
    assert cfg.model == base.model and cfg.optim.min_lr == base.optim.min_lr  # the rest is the preset's


def test_a_flat_flag_lands_in_its_section():
    cfg = load_preset("shakespeare-cpu", **_parse(["--spike-window", "7", "--micro-batch-size", "3"]))
    assert (cfg.spike.spike_window, cfg.batch.micro_batch_size) == (7, 3)
    assert cfg.spike.spike_rollback == load_preset("shakespeare-cpu").spike.spike_rollback == 3


@pytest.mark.parametrize(
    "argv", [["--compile", "maybe"], ["--dtype", "float8"], ["--max-steps", "x"], ["--no-such-field", "1"]]
)
def test_bad_flags_are_rejected(argv):
    with pytest.raises(SystemExit):
        _parse(argv)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(seq_len=2048), ["seq_len 2048", "block_size 1024"]),
        (dict(n_head=5), ["n_embd 768", "n_head 5"]),
        (dict(vocab_size=1000), ["vocab_size 1000", "50257"]),
        (dict(min_lr=1.0), ["min_lr", "max_lr"]),
        (dict(max_steps=0), ["max_steps 0 must be >= 1"]),
        (dict(eval_interval=-1), ["eval_interval -1 must be >= 0"]),
        (dict(no_such=1), ["unknown field(s) no_such"]),
        (dict(spike_window=-1), ["spike_window -1 must be >= 0"]),
        (dict(dtype="float8"), ["dtype 'float8': choose one of auto, float32, bfloat16, float16"]),
    ],
)
def test_invalid_settings_say_what_to_change(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_preset("gpt2-124m", **overrides)
    for w in words:
        assert w in str(e.value)


def test_batch_not_divisible_names_the_numbers():
    cfg = load_preset("gpt2-124m", micro_batch_size=48)
    with pytest.raises(ConfigError, match="micro_batch_size 48 x seq_len 1024 x world size 3"):
        cfg.grad_accum_steps(3)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError, match="shakespeare-cpu"):
        load_preset("gpt2-125m")


def test_list_presets_states_each_presets_size_cost_and_export(capsys):
    """`gpt2lab train --list-presets`: every preset once; its parameters those of the model it builds; tokens
    steps x tokens a step by hand; a GPU time its tokens at the H100 throughput measured for gpt2-124m
    (486,800 tok/s, docs/benchmarks.md); "not measured" where nothing was; the export target."""
    from gpt2lab import cli
    from gpt2lab.model.gpt import GPT
    from gpt2lab.weights.targets import export_target

    assert cli.main(["train", "--list-presets"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if not line.startswith(" ")]
    assert [h.split(":")[0] for h in heads] == preset_names()
    lines = out.splitlines()

    def block(name: str) -> list[str]:
        i = lines.index(next(h for h in heads if h.startswith(name + ":")))
        return lines[i : i + 3]

    head, time, export = block("shakespeare-cpu")
    assert f"{GPT(load_preset('shakespeare-cpu').model).num_params():,} parameters" in head
    assert "faithful GPT-2 recipe; 250 steps, 192,000 tokens" in head  # 250 x 768
    assert export == "    export  Hugging Face GPT2LMHeadModel"
    assert block("gpt2-124m")[1] == "    time    5.7 h on one NVIDIA H100 80GB HBM3 (at 486,800 tok/s measured)"
    assert 19073 * 524288 / 486_800 / 3600 == pytest.approx(5.7, abs=0.05)
    assert block("gpt3-124m")[1] == "    time    not measured"
    for name in ("wiki-cpu-long-fast", "gpt2-124m-fast"):  # the flagships export; their record twins do not
        fast, record = block(name), block(name.replace("-fast", "-record"))
        assert "modern recipe" in fast[0] and "modern recipe" in record[0]
        assert fast[2] == "    export  " + export_target(load_preset(name).model).describe()
        assert fast[2] == "    export  Hugging Face NanoChatForCausalLM"
        assert record[2].startswith("    export  none (value_embeds=1")
    from gpt2lab.train.presets import MEASURED

    assert set(MEASURED) <= set(preset_names())  # a renamed preset keeps its measured time
    assert (
        block("wiki-cpu-fast")[1] == f"    time    {MEASURED['wiki-cpu-fast'].wall_s / 60:.1f} min on "
        f"{MEASURED['wiki-cpu-fast'].machine} (measured)"
    )

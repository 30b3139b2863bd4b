"""The run plan (gpt2lab.train.plan): each start-up decision from faked machine facts, the one
resume rule (also where the architecture comes from), --init-from found and hashed once,
--dry-run (CPU, a faked 8-GPU machine, a resume) and the plan recorded in run_info.json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY, adapt_config, cli_args, tiny_gpt
from safetensors.torch import load_file

from gpt2lab import cli
from gpt2lab.checkpoint import store as ckpt
from gpt2lab.distributed.dist import DistInfo
from gpt2lab.model.loss import choose_loss
from gpt2lab.system import runtime
from gpt2lab.system.errors import ConfigError
from gpt2lab.train import init_from, memplan, plan_text
from gpt2lab.train.config import merge_config
from gpt2lab.train.gather import Gathered, MachineFacts, Resumed, fake_machine
from gpt2lab.train.plan import Request, decide_plan, make_plan
from gpt2lab.train.run import train
from gpt2lab.train.settings import load_preset, preset_values
from gpt2lab.train.trainer import Trainer
from gpt2lab.weights import export, targets

CPU = torch.device("cpu")
PLAIN_CPU = MachineFacts(runtime.Facts("cpu", "some x86", ("avx2", "fma")))
BF16_CPU = MachineFacts(runtime.Facts("cpu", "sapphire rapids", ("amx_bf16", "avx512_bf16", "avx512f")))
H100 = runtime.Facts("cuda", "NVIDIA H100 80GB HBM3", cuda_bf16=True)
GIB = 2**30


def _cfg(out, preset="shakespeare-cpu", **fields):
    return load_preset(preset, **{**TINY, "data": "unused", "out": str(out), **fields})


def _big(preset, out, **fields):
    return load_preset(preset, data="unused", out=str(out), hellaswag_interval=0, **fields)


# -- each decision, from faked facts ----------------------------------------------------------
def test_cpu_dtype_follows_the_cpus_bf16(tmp_path):
    cfg = _cfg(tmp_path / "r", dtype="auto")
    plain, native = make_plan(cfg, PLAIN_CPU), make_plan(cfg, BF16_CPU)
    assert (plain.choices.dtype.value, native.choices.dtype.value) == ("float32", "bfloat16")
    assert "no native bf16" in plain.choices.dtype.reason and "amx_bf16" in native.choices.dtype.reason
    for plan in (plain, native):  # one process on a CPU: unwrapped, chunked loss, no datasheet peak, eager
        assert (plan.strategy.value, plan.loss.value, plan.peak_flops.value, plan.choices.compile.value) == (
            "ddp",
            "chunked",
            None,
            False,
        )
        assert plan.resume is None and plan.init is None and plan.machine.world_size == 1


def test_eight_h100s_ddp_fused_loss_datasheet_peak_and_memory(tmp_path):
    cfg = _big("gpt2-124m", tmp_path / "r")
    plan = make_plan(cfg, MachineFacts(H100, world_size=8, device_bytes=80 * GIB))
    assert (plan.choices.dtype.value, plan.choices.compile.value, plan.strategy.value, plan.loss.value) == (
        "bfloat16",
        True,
        "ddp",
        "fused",
    )
    assert plan.peak_flops.value == 989e12  # the SXM datasheet figure
    assert plan.accum == 524288 // (64 * 1024 * 8) == 1
    ref = memplan.predict(
        cfg,
        strategy="ddp",
        world_size=8,
        dtype="bfloat16",
        accum=1,
        device="cuda",
        compiled=True,
    )
    assert plan.memory == ref.to_dict() and plan.params == 124_475_904  # GPT-2 small, padded vocab
    assert "fits" in plan.strategy.reason


def test_a_model_too_big_for_ddp_shards_and_keeps_the_chunked_loss(tmp_path):
    cfg = _big("gpt2-1558m", tmp_path / "r", total_batch_tokens=1024 * 16 * 8)
    a100 = runtime.Facts("cuda", "NVIDIA A100-SXM4-40GB", cuda_bf16=True)
    plan = make_plan(cfg, MachineFacts(a100, world_size=8, device_bytes=40 * GIB))
    assert (plan.strategy.value, plan.loss.value, plan.peak_flops.value) == ("fsdp", "chunked", 312e12)
    assert "FSDP" in plan.loss.reason
    ddp = memplan.predict(
        cfg,
        strategy="ddp",
        world_size=8,
        dtype="bfloat16",
        accum=1,
        device="cuda",
        compiled=True,
    ).total
    assert ddp > 40 * GIB and f"{ddp / GIB:.1f} GiB" in plan.strategy.reason
    fsdp = memplan.predict(
        cfg,
        strategy="fsdp",
        world_size=8,
        dtype="bfloat16",
        accum=1,
        device="cuda",
        compiled=True,
    )
    assert plan.memory == fsdp.to_dict()


@pytest.mark.parametrize(
    "name, peak", [("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA GeForce RTX 4090", None)]
)
def test_peak_flops_by_gpu_name_or_flag(name, peak, tmp_path):
    facts = MachineFacts(runtime.Facts("cuda", name, cuda_bf16=True), device_bytes=24 * GIB)
    assert make_plan(_cfg(tmp_path / "r"), facts).peak_flops.value == peak
    assert make_plan(_cfg(tmp_path / "r", peak_flops=1e15), facts).peak_flops.value == 1e15


def test_gpu_without_bf16_gets_fp16_and_ddp(tmp_path):
    t4 = runtime.Facts("cuda", "Tesla T4", cuda_bf16=False)
    plan = make_plan(
        _big("gpt2-124m", tmp_path / "r", micro_batch_size=8), MachineFacts(t4, world_size=8, device_bytes=15 * GIB)
    )
    assert (plan.choices.dtype.value, plan.strategy.value) == ("float16", "ddp") and "float16" in plan.strategy.reason


def test_loss_path_rule():
    assert [
        choose_loss(d, c, s).value
        for d, c, s in [
            ("cpu", False, False),
            ("cpu", True, False),
            ("cuda", False, False),
            ("cuda", True, False),
            ("cuda", True, True),
            ("mps", False, False),
        ]
    ] == ["chunked", "chunked", "chunked", "fused", "chunked", "chunked"]


def test_decide_reads_no_file(monkeypatch):
    """train.plan.decide from made-up gathered facts alone: a resumed run's checkpoint and config, the data's
    manifest (a chat template, conversations' counts); any file opened during the decision fails the test."""
    cfg = _cfg("/nowhere/run")
    saved = {**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "chat_template": "chatml"}}
    found = Gathered(
        PLAIN_CPU,
        resumed=Resumed("/nowhere/run/checkpoints/step_000002", saved),
        skipped=("step_000003: damaged",),
        manifest={"chat_template": "chatml", "splits": {"train": {"supervised": 10, "tokens": 40}}},
    )

    def no_files(*args, **kwargs):
        raise AssertionError(f"decide opened {args[0]!r}")

    monkeypatch.setattr("builtins.open", no_files)
    monkeypatch.setattr("io.open", no_files)
    plan = decide_plan(Request.of(cfg, resume="auto"), found)
    assert plan.resume == "/nowhere/run/checkpoints/step_000002" and plan.skipped == ("step_000003: damaged",)
    assert plan.config.model.chat_template == "chatml" and plan.supervised == (10, 40)
    assert plan.machine is PLAIN_CPU and plan.loss.value == "chunked"
    with pytest.raises(ConfigError, match="was trained with"):  # the checkpoint's settings, from its config alone
        decide_plan(Request.of(cfg.with_values(seed=cfg.seed + 1), resume="auto"), found)


def test_accumulation_and_its_error_name_the_world_size(tmp_path):
    cfg = _cfg(tmp_path / "r", total_batch_tokens=2 * 32 * 3 * 4)
    assert make_plan(cfg, MachineFacts(PLAIN_CPU.device, world_size=3)).accum == 4
    with pytest.raises(ConfigError, match="world size 5"):
        make_plan(cfg, MachineFacts(PLAIN_CPU.device, world_size=5))


def test_fake_facts_file(tmp_path):
    f = tmp_path / "f.json"
    f.write_text(
        json.dumps(
            {
                "device_type": "cuda",
                "device_name": "NVIDIA H100 80GB HBM3",
                "cuda_bf16": True,
                "world_size": 8,
                "device_gib": 79.1,
            }
        )
    )
    facts = fake_machine(str(f))
    assert (facts.world_size, facts.device_bytes, facts.device.native_bf16) == (8, int(79.1 * GIB), True)
    f.write_text(json.dumps({"device_type": "tpu"}))
    with pytest.raises(ConfigError, match="GPT2LAB_FAKE_FACTS"):
        fake_machine(str(f))


# -- resume: one rule --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two GPT-2-vocabulary sources of different depth, as HF directories."""
    out = {}
    for n_layer in (2, 3):
        d = str(tmp_path_factory.mktemp(f"src{n_layer}") / "model")
        export.save_pretrained(tiny_gpt(seed=n_layer, vocab_size=50257, block_size=64, n_layer=n_layer), d)
        out[n_layer] = d
    return out


def test_resume_arch_and_weights_come_from_the_same_checkpoint(sources, tiny_data, tmp_path):
    """The newest checkpoint is damaged and says the run began from a 3-layer model; the older,
    intact one from a 2-layer model. Both the architecture and the weights come from the older."""
    out = tmp_path / "run"
    cfg = load_preset(
        "shakespeare-cpu",
        **{
            **TINY,
            "data": tiny_data,
            "out": str(out),
            "max_steps": 2,
            "ckpt_interval": 1,
            "keep_checkpoints": 0,
            "init_from": sources[2],
        },
    )
    train(adapt_config(cfg), DistInfo(device=CPU))
    older, newest = ckpt.list_checkpoints(str(out))
    saved = json.loads((open(os.path.join(newest, "config.json")).read()))
    saved["model"]["n_layer"], saved["finetune"]["init_from"] = 3, sources[3]  # its bytes change: the checksum fails
    with open(os.path.join(newest, "config.json"), "w") as fh:
        json.dump(saved, fh)
    request = Request(
        merge_config(preset_values("shakespeare-cpu"), {**TINY, "data": tiny_data, "out": str(out), "max_steps": 4}),
        resume="auto",
    )
    plan = make_plan(request, PLAIN_CPU, report=lambda line: None)
    assert plan.resume == older and len(plan.skipped) == 1 and newest in plan.skipped[0]
    assert plan.config.model.n_layer == 2 and plan.config.finetune.init_from == sources[2]
    trainer = Trainer(plan, DistInfo(device=CPU))
    assert trainer.step == 1
    expect = load_file(os.path.join(older, "model.safetensors"))
    got = ckpt.clean_state_dict(trainer.raw.state_dict())
    assert set(got) == set(expect) and all(torch.equal(got[k], expect[k]) for k in expect)


def test_resume_path_rules(tmp_path, tiny_data):
    out = tmp_path / "run"
    train(
        load_preset("shakespeare-cpu", **{**TINY, "data": tiny_data, "out": str(out), "max_steps": 1}),
        DistInfo(device=CPU),
    )
    cfg = _cfg(out)
    with pytest.raises(ConfigError, match="already has checkpoints; continue it with --resume auto"):
        make_plan(cfg, PLAIN_CPU)
    (only,) = ckpt.list_checkpoints(str(out))
    assert make_plan(cfg, PLAIN_CPU, resume=str(out)).resume == only  # a run directory: its newest intact one
    with open(os.path.join(only, "state.pt"), "ab") as fh:
        fh.write(b"x")
    with pytest.raises(ckpt.CheckpointError, match="every checkpoint is damaged"):
        make_plan(cfg, PLAIN_CPU, resume="auto", report=lambda line: None)
    with pytest.raises(ckpt.CheckpointError, match="is damaged"):
        make_plan(cfg, PLAIN_CPU, resume=only)


# -- --init-from: found once, hashed once --------------------------------------------------------
def test_init_from_is_found_and_hashed_once(sources, tmp_path, monkeypatch):
    calls = {"find": 0, "sha": 0}
    find, sha = init_from.find_source, init_from.sha256_file

    def counted_find(spec):
        calls["find"] += 1
        return find(spec)

    def counted_sha(path):
        calls["sha"] += 1
        return sha(path)

    monkeypatch.setattr(init_from, "find_source", counted_find)
    monkeypatch.setattr(init_from, "sha256_file", counted_sha)
    asked = {**TINY, "data": "unused", "out": str(tmp_path / "r"), "init_from": sources[3], "n_layer": 2}
    request = Request(
        merge_config(preset_values("shakespeare-cpu"), asked), explicit={}
    )  # the preset's n_layer gives way to the source's
    plan = make_plan(request, PLAIN_CPU)
    assert calls == {"find": 1, "sha": 1}
    weights = os.path.join(sources[3], "model.safetensors")
    assert plan.init.sha256 == sha(weights) and plan.init_record["id"] == f"sha256:{plan.init.sha256}"
    assert plan_text.record(plan)["init_from"] == {
        "source": sources[3],
        "kind": "hf_dir",
        "weights": weights,
        "sha256": sha(weights),
        "step": None,
        "id": f"sha256:{sha(weights)}",
    }
    assert "init_from_id" not in json.dumps(plan.config.to_dict())  # provenance, not a setting
    assert plan.config.model.n_layer == 3
    with pytest.raises(init_from.InitFromError, match="drop --n-layer"):
        make_plan(Request(request.values, explicit={"n_layer": 2}), PLAIN_CPU)


# -- --dry-run and run_info.json ----------------------------------------------------------------
def _tree(root) -> dict:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, files in os.walk(root) for f in files}


def test_dry_run_cpu_fake_gpus_and_resume_write_nothing(tiny_data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "new"
    assert cli.main(["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(out)), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "runtime   dtype float32 (asked for with --dtype); compile off" in text
    assert "cpu x 1" in text and not out.exists()

    facts = tmp_path / "h100x8.json"
    facts.write_text(
        json.dumps(
            {
                "device_type": "cuda",
                "device_name": "NVIDIA H100 80GB HBM3",
                "cuda_bf16": True,
                "world_size": 8,
                "device_gib": 80,
            }
        )
    )
    monkeypatch.setenv("GPT2LAB_FAKE_FACTS", str(facts))
    assert (
        cli.main(
            [
                "train",
                "--preset",
                "gpt2-124m",
                "--out",
                str(out),
                "--data",
                "unused",
                "--hellaswag-interval",
                "0",
                "--dry-run",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "cuda x 8 (NVIDIA H100 80GB HBM3, 80.0 GiB each)" in text and "strategy  ddp" in text
    assert "989 TFLOP/s" in text and "loss      fused" in text and not out.exists()
    assert cli.main(["train", "--preset", "gpt2-124m", "--out", str(out), "--data", "unused"]) == 2  # not a real run
    assert "add --dry-run" in capsys.readouterr().err and not out.exists()
    monkeypatch.delenv("GPT2LAB_FAKE_FACTS")

    run = tmp_path / "run"
    argv = ["train", "--preset", "shakespeare-cpu", *cli_args(data=tiny_data, out=str(run), max_steps=2)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    before = _tree(tmp_path)
    assert (
        cli.main(
            [
                "train",
                "--preset",
                "shakespeare-cpu",
                *cli_args(data=tiny_data, out=str(run), max_steps=4),
                "--resume",
                "auto",
                "--dry-run",
            ]
        )
        == 0
    )
    assert f"resume from {run}/checkpoints/step_000002" in capsys.readouterr().out
    assert _tree(tmp_path) == before  # nothing written, not even a lock file


def test_run_info_holds_the_plan_the_run_used(tiny_data, tmp_path):
    cfg = load_preset("shakespeare-cpu", **{**TINY, "data": tiny_data, "out": str(tmp_path / "r"), "max_steps": 1})
    from gpt2lab.train.gather import detect_machine

    expect = plan_text.record(make_plan(cfg, detect_machine(CPU, 1, cfg.system.dtype)))
    train(cfg, DistInfo(device=CPU))
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())
    assert info["format"] == "gpt2lab-run" and info["plan"] == json.loads(json.dumps(expect))
    assert info["plan"]["dtype"]["value"] == info["plan"]["facts"]["dtype"] == "float32"
    shutil.rmtree(tmp_path / "r")


NANOCHAT = dict(
    pos_emb="rotary", norm="rmsnorm", qk_norm=True, mlp_act="relu2", tie_embeddings=False, bias=False, embed_norm=True
)


@pytest.mark.parametrize(
    "fields, line",
    [
        ({}, "export    Hugging Face GPT2LMHeadModel"),
        (dict(bias=False), "export    Hugging Face GPT2LMHeadModel"),  # zero biases
        (NANOCHAT, "export    Hugging Face NanoChatForCausalLM"),
        (dict(value_embeds=1), "export    none (value_embeds=1 (GPT-2 and NanoChat: no value embeddings))"),
        ({**NANOCHAT, "bias": True}, "export    none (NanoChatForCausalLM would need bias=false (no biases))"),
    ],
)
def test_the_plan_says_what_export_will_write(fields, line, tmp_path):
    for facts in (PLAIN_CPU, MachineFacts(H100, world_size=8, device_bytes=80 * GIB)):
        plan = make_plan(_cfg(tmp_path / "r", total_batch_tokens=512, **fields), facts)
        assert line in plan_text.lines(plan) and plan_text.record(plan)["export"] == line.removeprefix("export    ")
        assert plan_text.record(plan)["export"] == targets.export_target(plan.config.model).describe()


def test_a_lever_that_cannot_export_is_in_the_dry_run(tiny_data, tmp_path, capsys):
    out = tmp_path / "r"
    assert (
        cli.main(
            [
                "train",
                "--preset",
                "shakespeare-cpu",
                *cli_args(data=tiny_data, out=str(out), value_embeds=1, unet_skips=True),
                "--dry-run",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert (
        "export    none (value_embeds=1 (GPT-2 and NanoChat: no value embeddings); unet_skips=true (GPT-2 and "
        "NanoChat: no skips between blocks))"
    ) in [line.strip() for line in text.splitlines()]
    assert not out.exists()


# -- what the checkpoints take on disk ----------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"optimizer": "muon", "muon_variant": "normuon", "tie_embeddings": False, "muon_ns_dtype": "float32"},
        {"ema_decay": 0.9},
    ],
    ids=["adamw", "normuon-untied", "ema"],
)
def test_the_plan_says_what_a_checkpoint_takes_as_saved(fields, tiny_data, tmp_path):
    """The plan's bytes per file against the files torch and safetensors write (headers and pickling:
    kilobytes); the written and kept counts against the directories left."""
    cfg = load_preset("shakespeare-cpu", **{**TINY, "data": tiny_data, "out": str(tmp_path), **fields})
    cfg = cfg.with_values(max_steps=5, ckpt_interval=2, keep_checkpoints=2)
    plan = make_plan(cfg, PLAIN_CPU)
    disk = plan_text.record(plan)["checkpoints"]
    trainer = Trainer(plan, DistInfo())
    while trainer.step < 5:  # the optimizer's state exists from its first step
        trainer.train_step()
        if trainer.step in (2, 4, 5):  # as the loop saves: every 2 steps and at the end
            where = trainer.save()
    size = lambda name: os.path.getsize(os.path.join(where, name))  # noqa: E731
    each = disk["bytes"]
    assert 0 <= size("model.safetensors") - each["weights"] < 64 * 1024
    assert 0 <= size("optimizer.pt") - each["optimizer"] < 64 * 1024
    if fields.get("ema_decay"):
        assert 0 <= size(ckpt.TRAINING) - each["training_weights"] < 64 * 1024
    whole = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where))
    assert 0 <= whole - each["total"] < 128 * 1024
    assert (disk["written"], disk["kept"], len(ckpt.list_checkpoints(str(tmp_path)))) == (3, 2, 2)
    assert disk["kept_bytes"] == 2 * each["total"] and disk["peak_bytes"] == 3 * each["total"]
    line = next(x for x in plan_text.lines(plan) if x.startswith("disk "))
    assert f"{each['total'] / 2**20:,.0f} MiB per checkpoint" in line and "3 written, 2 kept" in line


def test_cpu_presets_keep_one_checkpoint_and_gpu_presets_keep_theirs():
    from gpt2lab.train.settings import preset_names

    for name in preset_names():
        cfg = load_preset(name)
        if cfg.system.device == "cpu":
            assert cfg.checkpoint.keep_checkpoints == 1, name
    assert load_preset("gpt2-124m").checkpoint.keep_checkpoints == 3  # the field's default, unchanged
    assert load_preset("chat-gpt2").checkpoint.keep_checkpoints == 2


# -- the samples' prompt: the settings' on the data it was written for, else the data's own start ----------
def _prompt_request(data: str, prompt_for) -> Request:
    values = merge_config(preset_values("shakespeare-cpu"), {"data": data, "out": "/nowhere/run"}, source="test")
    return Request(values, source="test", prompt_for=prompt_for)


def test_a_presets_prompt_is_kept_for_its_data_and_replaced_by_the_datas_start_elsewhere():
    found = Gathered(PLAIN_CPU, manifest={"source": "x"}, val_start="First Citizen:")
    same = decide_plan(_prompt_request("data/tinyshakespeare", "data/tinyshakespeare"), found)
    assert same.config.eval.sample_prompt == "ROMEO:" and same.prompt_reason is None
    assert not any(line.startswith("sample ") for line in plan_text.lines(same))
    other = decide_plan(_prompt_request("data/mine", "data/tinyshakespeare"), found)
    assert other.config.eval.sample_prompt == "First Citizen:"
    assert (
        "sample    prompt 'First Citizen:' (the start of data/mine's first validation document; the "
        "settings' 'ROMEO:' was written for data/tinyshakespeare)" in plan_text.lines(other)
    )
    assert plan_text.record(other)["sample_prompt"]["value"] == "First Citizen:"
    empty = decide_plan(_prompt_request("data/mine", "data/tinyshakespeare"), Gathered(PLAIN_CPU, manifest={"a": 1}))
    assert empty.config.eval.sample_prompt == "" and empty.prompt_reason.startswith("empty: data/mine has no")
    given = decide_plan(_prompt_request("data/mine", None), found)  # --sample-prompt, or the Python API's config
    assert given.config.eval.sample_prompt == "ROMEO:"


def test_the_datas_start_is_its_first_validation_documents_first_tokens(tiny_data, tmp_path):
    import gpt2lab
    from gpt2lab.data.shards import read_manifest
    from gpt2lab.data.tokenizer import gpt2_tokenizer
    from gpt2lab.train.gather import PROMPT_TOKENS, val_start

    text = (Path(gpt2lab.__file__).parent / "assets" / "tinyshakespeare.txt").read_text()
    start = val_start(tiny_data, read_manifest(tiny_data))  # the val split is the text's first part
    assert (
        text.startswith(start)
        and gpt2_tokenizer().encode_ordinary(start) == gpt2_tokenizer().encode_ordinary(text[:200])[:PROMPT_TOKENS]
    )
    rows = [
        {"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(400)
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "chat")
    assert cli.main(["prepare", "--source", str(tmp_path / "c.jsonl"), "--out", out, "--quiet"]) == 0
    assert val_start(out, read_manifest(out)) == "question 0?"  # the first user message, as written


def test_training_samples_start_from_the_data_unless_it_is_the_presets(tiny_data, tmp_path, monkeypatch):
    """End to end: the CLI run on the preset's own data directory samples after "ROMEO:", on another after
    that data's start; a --sample-prompt is used as given."""
    from conftest import records

    def samples(out, *extra) -> list[str]:
        argv = ["train", "--preset", "shakespeare-cpu", *cli_args(out=str(out), max_steps=1, sample_interval=1)]
        assert cli.main([*argv, "--sample-tokens", "3", *extra]) == 0
        return [r["sample"] for r in records(out) if "sample" in r]

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    shutil.copytree(tiny_data, tmp_path / "data" / "tinyshakespeare")  # the preset's data = "data/tinyshakespeare"
    assert all(s.startswith("ROMEO:") for s in samples(tmp_path / "own", "--data", "data/tinyshakespeare"))
    elsewhere = samples(tmp_path / "other", "--data", tiny_data)
    assert elsewhere and all(s.startswith("First Citizen:\nBefore we proceed any") for s in elsewhere)
    assert all(
        s.startswith("JULIET:") for s in samples(tmp_path / "given", "--data", tiny_data, "--sample-prompt", "JULIET:")
    )

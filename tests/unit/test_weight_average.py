"""``--ema-decay``: the running average of the weights. Checked against the average
written out by hand in float64 over snapshots of the trained weights; the checkpoint holds it
as model.safetensors (what every reader loads) and the weights as trained beside it, and a
resume continues both exactly; the training itself does not change."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, evaluate_loss

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.distributed.dist import DistInfo
from gpt2lab.system.errors import ConfigError
from gpt2lab.train import plan_text
from gpt2lab.train.config import TrainConfig
from gpt2lab.train.settings import load_preset
from gpt2lab.weights.load import load_model

CPU = torch.device("cpu")


def trainer(data, out, resume=None, **kw):
    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan
    from gpt2lab.train.trainer import Trainer

    cfg = load_preset("shakespeare-cpu", **{**TINY, "data": data, "out": str(out), "max_steps": 6, **kw})
    return Trainer(make_plan(cfg, MachineFacts(runtime.Facts("cpu")), resume=resume), DistInfo(device=CPU))


def run(t, n) -> list[dict]:
    """``n`` steps; the trained weights after each (float64 copies)."""
    snaps = []
    for _ in range(n):
        t.train_step()
        snaps.append({k: v.detach().double().clone() for k, v in t.raw.state_dict().items()})
    return snaps


def weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("decay", [0.5, 0.9])
def test_the_average_is_the_written_out_one_and_evaluations_read_it(tiny_data, tmp_path, decay):  # noqa: F811
    t = trainer(tiny_data, tmp_path, ema_decay=decay, eval_tokens=256)
    snaps = run(t, 5)
    # by hand: the first step's weights, then avg = d * avg + (1 - d) * w after each later step
    avg = snaps[0]
    for w in snaps[1:]:
        avg = {k: decay * avg[k] + (1 - decay) * w[k] for k in avg}
    got = t.average.module.state_dict()
    for k, v in avg.items():
        torch.testing.assert_close(got[k].double(), v, rtol=1e-6, atol=1e-7)
    # it is not the trained weights (the test would pass vacuously if it were)
    assert (
        got["transformer.h.0.mlp.c_fc.weight"] - t.raw.state_dict()["transformer.h.0.mlp.c_fc.weight"]
    ).abs().max() > 1e-4
    # the val loss the run logs is the average's: a GPT holding the hand-made average scores the same
    from gpt2lab.model.gpt import GPT

    hand = GPT(t.raw.config)
    hand.load_state_dict({k: v.float() for k, v in avg.items()})
    cfg = t.cfg
    want = evaluate_loss(
        hand,
        cfg.data,
        tokens=256,
        batch_size=cfg.batch.micro_batch_size,
        seq_len=cfg.batch.seq_len,
        device=CPU,
        dtype="float32",
    )
    assert t.evaluate.validate().loss == pytest.approx(want, abs=1e-5)
    raw = evaluate_loss(
        t.raw,
        cfg.data,
        tokens=256,
        batch_size=cfg.batch.micro_batch_size,
        seq_len=cfg.batch.seq_len,
        device=CPU,
        dtype="float32",
    )
    assert abs(raw - want) > 1e-4


def test_averaging_leaves_the_training_unchanged(tiny_data, tmp_path):  # noqa: F811
    plain, averaged = trainer(tiny_data, tmp_path / "a"), trainer(tiny_data, tmp_path / "b", ema_decay=0.9)
    assert plain.average is None
    run(plain, 4), run(averaged, 4)
    for k, v in weights(plain.raw).items():
        assert torch.equal(v, averaged.raw.state_dict()[k]), k


def test_checkpoint_holds_the_average_and_a_resume_continues_both_exactly(tiny_data, tmp_path):  # noqa: F811
    straight = trainer(tiny_data, tmp_path / "straight", ema_decay=0.8)
    run(straight, 6)
    first = trainer(tiny_data, tmp_path / "resumed", ema_decay=0.8)
    run(first, 3)
    path = first.save()
    files = json.loads(open(f"{path}/checksums.json").read())
    assert "training.safetensors" in files and "model.safetensors" in files
    # model.safetensors is the average (what sample, serve, eval and export load); the trained weights beside it
    loaded = load_model(path)
    for k, v in weights(first.average.module).items():
        assert torch.equal(loaded.state_dict()[k], v), k
    from safetensors.torch import load_file

    trained = load_file(f"{path}/training.safetensors")
    assert torch.equal(
        trained["transformer.h.1.attn.c_attn.weight"], first.raw.state_dict()["transformer.h.1.attn.c_attn.weight"]
    )
    again = trainer(tiny_data, tmp_path / "resumed", resume=path, ema_decay=0.8)
    assert again.step == 3 and int(again.average.averaged.n_averaged) == 3
    run(again, 3)
    for mine, theirs in ((again.raw, straight.raw), (again.average.module, straight.average.module)):
        for k, v in weights(mine).items():
            assert torch.equal(v, theirs.state_dict()[k]), k


def test_the_average_switched_on_or_off_at_a_resume(tiny_data, tmp_path):  # noqa: F811
    # a resume is refused: the first part trained with (or without) the average (train.plan.resume_fields)
    off = trainer(tiny_data, tmp_path / "off")
    run(off, 2)
    path = off.save()
    assert not (tmp_path / "off" / "checkpoints" / "step_000002" / "training.safetensors").exists()
    with pytest.raises(ConfigError, match="--ema-decay 0.9: the checkpoint .* was trained with ema_decay 0.0"):
        trainer(tiny_data, tmp_path / "off", resume=path, ema_decay=0.9)
    # what the checkpoint parts do with such a checkpoint, read directly: one without an average starts
    # one from the model's weights
    on = trainer(tiny_data, tmp_path / "other", ema_decay=0.9)
    ckpt.load(path, on.parts())
    for k, v in weights(on.raw).items():
        assert torch.equal(on.average.module.state_dict()[k], v), k
    run(on, 1)  # the first update copies the weights
    for k, v in weights(on.raw).items():
        assert torch.equal(on.average.module.state_dict()[k], v), k
    # off: the weights as trained, not their average
    avg = trainer(tiny_data, tmp_path / "avg", ema_decay=0.9)
    run(avg, 2)
    path = avg.save()
    with pytest.raises(ConfigError, match="--ema-decay 0.0: the checkpoint .* was trained with ema_decay 0.9"):
        trainer(tiny_data, tmp_path / "avg", resume=path)
    plain = trainer(tiny_data, tmp_path / "plain")
    ckpt.load(path, plain.parts())
    for k, v in weights(avg.raw).items():
        assert torch.equal(plain.raw.state_dict()[k], v), k


def test_bad_decays_are_one_line_and_every_preset_but_one_is_off():
    for bad in (1.0, -0.1, 2.0):
        with pytest.raises(ConfigError, match=rf"ema_decay {bad} must be in \[0, 1\)"):
            TrainConfig.from_dict({"optim": {"ema_decay": bad}})
    assert TrainConfig().optim.ema_decay == 0.0
    from importlib import resources

    names = [p.name[:-5] for p in (resources.files("gpt2lab") / "presets").iterdir() if p.name.endswith(".toml")]
    on = {n for n in names if load_preset(n).optim.ema_decay}
    assert on == {"wiki-cpu-long-fast", "wiki-cpu-long-record"}


def test_a_sharded_model_is_refused_in_one_line(monkeypatch):
    from gpt2lab.distributed import parallel
    from gpt2lab.model.gpt import GPT, GPTConfig
    from gpt2lab.train.averaging import WeightAverage

    monkeypatch.setattr(parallel, "is_sharded", lambda m: True)  # as FSDP2 makes it
    with pytest.raises(ConfigError, match="--ema-decay: the model is sharded"):
        WeightAverage(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=16)), 0.9)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"parallel": {"strategy": "fsdp"}}, "--ema-decay with --strategy fsdp"),
        ({"finetune": {"lora_rank": 4}}, "--ema-decay with --lora-rank"),
    ],
)
def test_settings_the_average_cannot_join_are_refused_in_one_line(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_dict({"optim": {"ema_decay": 0.9}, **fields})


def test_the_planner_counts_the_average_as_the_copy_it_keeps(tiny_data, tmp_path):  # noqa: F811
    from gpt2lab.train import memplan

    t = trainer(tiny_data, tmp_path, ema_decay=0.9)
    kept = sum(p.numel() * p.element_size() for p in t.average.module.parameters())
    kw = dict(dtype="float32", device="cpu")
    with_avg, without = memplan.predict(t.cfg, **kw), memplan.predict(t.cfg.with_values(ema_decay=0.0), **kw)
    assert with_avg.terms["average"] == kept and "average" not in without.terms
    assert with_avg.total - without.total == kept
    assert t.plan.memory["average"] == round(kept / 2**20, 1)  # the run's plan counts it too
    assert any("weight average (EMA) 0.9" in line for line in plan_text.lines(t.plan))

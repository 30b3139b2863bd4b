"""The training step in-process: overfitting, accumulation, NaN skipping, golden losses, val loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, TINY, step_record

from gpt2lab.distributed.dist import DistInfo
from gpt2lab.distributed.parallel import accumulate_gradients
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.train.optim import AdamW, param_groups
from gpt2lab.train.settings import load_preset
from gpt2lab.train.trainer import Trainer, TrainingError

CPU = torch.device("cpu")
# The first 10 train losses of _trainer(...) below, recorded with torch 2.13 on CPU (fp32).
# A change here means the model, the data order, the init or the optimizer changed.
GOLDEN = [10.8304, 10.8277, 10.7914, 10.6800, 10.6113, 10.5393, 10.4928, 10.4038, 10.3637, 10.4340]


def _trainer(data: str, out, **fields) -> Trainer:
    cfg = load_preset("shakespeare-cpu", **{**TINY, "data": data, "out": str(out), **fields})
    return Trainer.from_config(cfg, DistInfo(device=CPU))


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=64, token_vocab_size=50257))
    opt = AdamW(param_groups(model, 0.0), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    x = torch.randint(0, 50257, (2, 33))
    batch = (x[:, :-1], x[:, 1:])
    for step in range(300):
        loss = accumulate_gradients(model, lambda: batch, 1, CPU, "float32")
        opt.step()
        opt.zero_grad()
        if loss.item() < 0.5:
            break
    assert loss.item() < 0.5, f"loss {loss.item():.3f} after {step + 1} steps"


def test_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(0, 50257, (4, 33))
    halves = iter([(x[:2, :-1], x[:2, 1:]), (x[2:, :-1], x[2:, 1:])])
    loss = accumulate_gradients(model, lambda: next(halves), 2, CPU, "float32")
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits, ref = model(x[:, :-1])[0], None
    ref = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))  # plain, one batch of 4
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-6
    for g, p in zip(grads, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6, rtol=0)


def test_golden_first_losses(tiny_data, tmp_path):
    trainer = _trainer(tiny_data, tmp_path)
    losses = []
    for _ in range(10):
        losses.append(step_record(trainer)["train_loss"])
    assert np.allclose(losses, GOLDEN, atol=2e-4), [round(v, 4) for v in losses]


def test_nan_step_is_skipped_then_training_continues(tiny_data, tmp_path):
    trainer = _trainer(tiny_data, tmp_path, max_bad_steps=3)
    forward = trainer.model.forward
    poison = {"on": False}

    def maybe_nan(*args, **kwargs):
        logits, loss = forward(*args, **kwargs)
        return logits, loss * float("nan") if poison["on"] else loss

    trainer.model.forward = maybe_nan
    trainer.spikes.check_bad(step_record(trainer))
    before = [p.detach().clone() for p in trainer.raw.parameters()]
    adam_steps = trainer.optimizer.state_dict()["state"][0]["step"].item()
    poison["on"] = True
    rec = step_record(trainer)
    trainer.spikes.check_bad(rec)
    assert rec["skipped"] == "nan" and trainer.spikes.bad_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.raw.parameters()))  # no update at all
    assert trainer.optimizer.state_dict()["state"][0]["step"].item() == adam_steps
    poison["on"] = False
    rec = step_record(trainer)
    trainer.spikes.check_bad(rec)
    assert "skipped" not in rec and np.isfinite(rec["train_loss"]) and trainer.spikes.bad_steps == 0
    poison["on"] = True
    trainer.spikes.check_bad(step_record(trainer))
    trainer.spikes.check_bad(step_record(trainer))
    with pytest.raises(TrainingError, match="3 steps in a row"):
        trainer.spikes.check_bad(step_record(trainer))


def test_bad_weights_never_overwrite_a_checkpoint(tiny_data, tmp_path):
    trainer = _trainer(tiny_data, tmp_path)
    trainer.step = 1
    good = trainer.save()
    with torch.no_grad():
        trainer.raw.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")
    trainer.step = 2
    with pytest.raises(TrainingError, match="non-finite weights"):
        trainer.save()
    from gpt2lab.checkpoint.store import find_latest

    assert find_latest(str(tmp_path)) == good


def test_val_loss_equals_a_plain_loop(tiny_data, tmp_path):
    from conftest import evaluate_loss

    from gpt2lab.data.shards import list_shards, open_shard

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32))
    got = evaluate_loss(model, tiny_data, tokens=4 * 3 * 32, batch_size=3, seq_len=32, device="cpu")
    tokens = np.concatenate([open_shard(p) for p in list_shards(tiny_data, "val")]).astype(np.int64)
    rows = torch.tensor(np.stack([tokens[i * 32 : i * 32 + 33] for i in range(12)]))
    with torch.no_grad():
        logits = model(rows[:, :-1])[0]
        ref = F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
    assert abs(got - ref.item()) < 1e-5
    with pytest.raises(ValueError, match="fewer than"):
        evaluate_loss(model, tiny_data, tokens=10**8, batch_size=3, seq_len=32, device="cpu")


def test_fp16_scaler_survives_nan_steps_and_resume(tiny_data, tmp_path, monkeypatch):
    import dataclasses

    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan

    cfg = load_preset("shakespeare-cpu", **{**TINY, "data": tiny_data, "out": str(tmp_path), "max_bad_steps": 3})
    plan = make_plan(cfg, MachineFacts(runtime.Facts("cpu")))
    fp16 = dataclasses.replace(plan.choices, dtype=runtime.Choice("float16", "test"))  # fp16 on CPU, test only
    plan = dataclasses.replace(plan, choices=fp16)
    trainer = Trainer(plan, DistInfo(device=CPU))
    forward, poison = trainer.model.forward, {"on": True}
    trainer.model.forward = lambda *a, **k: (lambda lo: (lo[0], lo[1] * float("nan") if poison["on"] else lo[1]))(
        forward(*a, **k)
    )
    for _ in range(2):  # two NaN steps in a row: the second must not find the scaler mid-step
        rec = step_record(trainer)
        trainer.spikes.check_bad(rec)
        assert rec["skipped"] == "nan"
    assert trainer.scaler.get_scale() == 2.0**14  # backed off twice from 2**16
    poison["on"] = False
    rec = step_record(trainer)
    trainer.spikes.check_bad(rec)
    assert np.isfinite(rec["train_loss"]) and trainer.spikes.bad_steps == 0
    trainer.scaler.update(2.0**100)  # overflows the fp16 gradients: the scaler's routine skip
    rec = step_record(trainer)
    trainer.spikes.check_bad(rec)
    assert rec["skipped"] in ("inf", "nan") and rec["grad_scaler"] and trainer.spikes.bad_steps == 0  # not counted
    json.dumps(rec, allow_nan=False)  # metrics.jsonl stays strict JSON
    assert trainer.scaler.get_scale() == 2.0**99
    trainer.step = 4
    path = trainer.save()
    resumed = Trainer(
        dataclasses.replace(make_plan(cfg, MachineFacts(runtime.Facts("cpu")), resume=path), choices=plan.choices),
        DistInfo(device=CPU),
    )
    assert resumed.scaler.state_dict() == trainer.scaler.state_dict()


def test_run_logs_val_hellaswag_samples_tensorboard_and_plot(tiny_data, tmp_path):
    """A short run with every in-training evaluation on; the logged figures equal the
    standalone evaluators applied to the checkpoint the run saved at its last step."""

    from conftest import evaluate_loss

    from gpt2lab.evals.hellaswag import evaluate_hellaswag
    from gpt2lab.train.run import train
    from gpt2lab.weights.load import load_model

    slice_ = str(DATA / "hellaswag_val_200.jsonl")
    out = tmp_path / "run"
    cfg = load_preset(
        "shakespeare-cpu",
        **{
            **TINY,
            "data": tiny_data,
            "out": str(out),
            "max_steps": 4,
            "eval_interval": 2,
            "eval_tokens": 2 * 64,
            "hellaswag_interval": 4,
            "hellaswag_data": slice_,
            "hellaswag_limit": 6,
            "sample_interval": 4,
            "sample_tokens": 8,
            "tensorboard": True,
        },
    )
    last = train(cfg, DistInfo(device=CPU))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    hs = {r["step"]: r for r in recs if "hellaswag_acc_norm" in r}
    samples = {r["step"]: r["sample"] for r in recs if "sample" in r}
    assert sorted(val) == [0, 2, 4] and sorted(hs) == [0, 4] and sorted(samples) == [0, 4]
    assert all(isinstance(s, str) and s.startswith("ROMEO:") for s in samples.values())
    model = load_model(last, CPU)
    assert abs(val[4] - evaluate_loss(model, tiny_data, tokens=2 * 64, batch_size=2, seq_len=32, device=CPU)) < 1e-5
    ref = evaluate_hellaswag(model, slice_, device=CPU, limit=6)
    assert (hs[4]["hellaswag_n"], hs[4]["hellaswag_acc"], hs[4]["hellaswag_acc_norm"]) == (
        6,
        ref["acc"],
        ref["acc_norm"],
    )
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rollback_is_a_decision_made_without_the_trainer(tmp_path):
    """The spike guard decides alone: back to the newest checkpoint at or before the first spike, never the
    spiking steps' data again; its skips outlive the checkpoint's restore; too many rollbacks to the same
    checkpoint stop the run; with no checkpoint before the spikes it trains on."""
    from gpt2lab.train.spikes import MAX_ROLLBACKS, SpikeGuard

    cfg = load_preset(
        "shakespeare-cpu", **{**TINY, "data": "unused", "out": str(tmp_path), "spike_window": 4, "spike_rollback": 2}
    )
    early = SpikeGuard(cfg)
    early.spikes = [[3, 60], [4, 80]]
    none = early.decide(end=100, step=5, restore=None)  # nothing saved yet
    assert none["rollback_to"] is None and "note" in none and early.spikes == [] and early.rollbacks == 0
    for step in (8, 16, 24):
        d = tmp_path / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "state.pt").touch()
        (d / "model.safetensors").touch()
    rollback, restored = SpikeGuard(cfg), []

    def restore(target):  # what restoring the checkpoint leaves
        restored.append(target)
        rollback.skips, rollback.bad_steps = [], 3

    for n in range(1, MAX_ROLLBACKS + 1):
        rollback.spikes = [[17, 340], [18, 360]]
        record = rollback.decide(end=380, step=19, restore=restore)
        assert record["rollback_to"].endswith("step_000016") and restored[-1] == record["rollback_to"]
        assert record["skip_positions"] == [340, 380] and record["spike_steps"] == [17, 18]
        assert rollback.skips == [[340, 380]] * n and rollback.bad_steps == 0
    assert rollback.skip_bad_data(340) == rollback.skip_bad_data(379) == 380 and rollback.skip_bad_data(339) == 339
    rollback.spikes = [[17, 340], [18, 360]]
    with pytest.raises(TrainingError, match=f"rolled back to .*step_000016 {MAX_ROLLBACKS} times"):
        rollback.decide(end=380, step=19, restore=restore)

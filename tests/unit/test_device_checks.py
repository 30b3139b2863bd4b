"""The NaN and spike checks on the device: no host sync inside a step, the verdicts of the rule
written out, skipped updates that leave weights and optimizer state exactly as they were, and
records read back a few steps at a time that equal the ones read every step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TINY

from gpt2lab.distributed.dist import DistInfo
from gpt2lab.model.loss import LossPath
from gpt2lab.train.optim import AdamW, Muon, param_groups
from gpt2lab.train.settings import load_preset
from gpt2lab.train.spikes import VALUES, SpikeGuard
from gpt2lab.train.trainer import GPU_CHECK_INTERVAL, Trainer, TrainingError, check_interval

CPU = torch.device("cpu")


def _trainer(data: str, out, **fields) -> Trainer:
    cfg = load_preset("shakespeare-cpu", **{**TINY, "data": data, "out": str(out), **fields})
    return Trainer.from_config(cfg, DistInfo(device=CPU))


def _guard(window: int, loss_z: float, norm_z: float) -> SpikeGuard:
    spike = dict(spike_window=window, spike_loss_z=loss_z, spike_norm_z=norm_z, spike_rollback=3)
    return SpikeGuard(load_preset("shakespeare-cpu", **{**TINY, "data": "unused", "out": "unused", **spike}))


def _values(n: int, seed: int) -> list[tuple[float, float]]:
    """Losses drifting down with noise, grad norms log-normal, a few spikes and NaN/inf among them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        loss = 6.0 - 0.01 * i + 0.05 * rng.standard_normal()
        norm = float(np.exp(0.1 * rng.standard_normal()))
        if i in (20, 21, 33):
            loss += 3.0  # a loss spike
        if i == 27:
            norm *= 1e4  # a gradient-norm spike
        if i == 40:
            loss = float("nan")
        if i == 41:
            norm = float("inf")
        out.append((loss, norm))
    return out


def _reference(history: list[tuple[float, float]], loss: float, norm: float, window: int, loss_z, norm_z):
    """(spike, z_loss, z_norm) of a finite step by the rule written out: z-scores against the last
    ``window`` healthy steps' losses and log norms, their deviations floored (2% of the mean loss, 0.1)."""
    if window == 0 or len(history) < window:
        return False, None, None
    losses, logs = np.array([h[0] for h in history[-window:]]), np.log([h[1] for h in history[-window:]])
    z_loss = (loss - losses.mean()) / max(losses.std(), 0.02 * abs(losses.mean()))
    z_norm = (math.log(norm) - logs.mean()) / max(logs.std(), 0.1)
    return (loss_z > 0 and z_loss > loss_z) or (norm_z > 0 and z_norm > norm_z), z_loss, z_norm


@pytest.mark.parametrize("window,loss_z,norm_z", [(8, 4.0, 6.0), (8, 0.0, 6.0), (8, 4.0, 0.0), (0, 4.0, 6.0)])
def test_the_guard_judges_by_the_rule_and_resumes_from_its_state(window, loss_z, norm_z):
    guard, healthy, verdicts = _guard(window, loss_z, norm_z), [], 0
    for i, (loss, norm) in enumerate(_values(60, 2)):
        if i == 25:  # a guard rebuilt from a checkpoint's state mid-run judges on alike
            state = guard.state_dict()
            assert state["guard"]["losses"] == [h[0] for h in healthy[-max(window, 1) :]]  # oldest first
            guard = _guard(window, loss_z, norm_z)
            guard.load_state_dict(state)
        loss, norm = float(np.float32(loss)), float(np.float32(norm))  # float32 losses, as the trainer's
        values = guard.judge(torch.tensor(loss, dtype=torch.float32), torch.tensor(norm, dtype=torch.float32))
        got = dict(zip(VALUES, values.tolist()))
        finite = math.isfinite(loss) and math.isfinite(norm)
        spike, z_loss, z_norm = _reference(healthy, loss, norm, window, loss_z, norm_z) if finite else (0, 0, 0)
        assert got["skip"] == float(not finite or spike), (i, loss, norm)
        if spike:
            verdicts += 1
            assert got["loss_z"] == pytest.approx(z_loss, rel=1e-9) and got["norm_z"] == pytest.approx(z_norm, rel=1e-9)
        elif finite:
            healthy.append((loss, norm))
    assert verdicts == (0 if window == 0 else {(4.0, 6.0): 4, (0.0, 6.0): 1, (4.0, 0.0): 3}[(loss_z, norm_z)])


def _grads(shapes, gen):
    return [torch.randn(*s, generator=gen) for s in shapes]


@pytest.mark.parametrize("kind", ["adamw", "muon", "normuon"])
def test_a_step_skipped_on_the_device_changes_nothing_and_a_kept_one_is_the_plain_step(kind):
    shapes = [(16, 8), (8, 16)]
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(*s, generator=gen) for s in shapes]

    def make():
        params = [torch.nn.Parameter(w.clone()) for w in start]
        if kind == "adamw":
            opt = AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        else:
            opt = Muon(
                params, lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True, ns_dtype=torch.float32, variant=kind
            )
        return params, opt

    (a, opt_a), (b, opt_b) = make(), make()
    assert opt_a.skips_on_device
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        grads = _grads(shapes, g)
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        if step == 2:  # skipped on the device: b does not step at all
            before = [p.detach().clone() for p in a]
            state = [(k, v.clone()) for p in a for k, v in sorted(opt_a.state[p].items())]
            opt_a.step(skip=torch.tensor(1.0, dtype=torch.float64))  # SpikeGuard.judge's verdict
            assert all(torch.equal(x, p) for x, p in zip(before, a))
            after = [(k, v) for p in a for k, v in sorted(opt_a.state[p].items())]
            assert len(after) == len(state) and all(
                k == j and torch.equal(v, w) for (k, v), (j, w) in zip(after, state)
            )
            continue
        opt_a.step(skip=torch.tensor(0.0, dtype=torch.float64))
        opt_b.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_check_interval_auto_and_where_the_host_must_decide():
    model = torch.nn.Linear(4, 4)
    fused = AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    plain = AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    gpu = torch.device("cuda")  # a fact, not a device: nothing is allocated on it
    assert check_interval(0, CPU, fused, None, None) == 1
    assert check_interval(0, gpu, fused, None, None) == GPU_CHECK_INTERVAL
    assert check_interval(5, CPU, fused, None, None) == 5
    assert check_interval(5, gpu, plain, None, None) == 1  # this optimizer cannot skip on the device
    assert check_interval(5, gpu, fused, object(), None) == 1  # fp16's scaler decides on the host
    assert check_interval(5, gpu, fused, None, object()) == 1  # so does the weight average


def test_a_step_with_device_checks_never_waits_for_the_device(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    """Reading a value back (item, tolist, bool, float of a tensor) is what waits for a GPU: none
    happens inside a step when the checks run on the device."""
    trainer = _trainer(tiny_data, tmp_path, check_interval=4)
    # the loss inside the graph, as on a GPU (the CPU's chunked loss checks its rows on the host)
    trainer.raw.set_loss(LossPath(chunked=False))
    assert len(trainer.train_step()) == 1  # read back at once (a process's first step: its compile); lazy state
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def watch(self, *a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, watch)
    for _ in range(3):
        assert trainer.train_step() == []
    assert calls == []
    monkeypatch.undo()
    records = [s.record for s in trainer.read_back()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(np.isfinite(r["train_loss"]) for r in records)


def test_nan_steps_are_skipped_on_the_device_and_counted_when_read_back(tiny_data, tmp_path):  # noqa: F811
    trainer = _trainer(tiny_data, tmp_path, max_bad_steps=3, check_interval=8)
    forward, poison = trainer.model.forward, {"on": False}
    trainer.model.forward = lambda *a, **k: (lambda lo: (lo[0], lo[1] * float("nan") if poison["on"] else lo[1]))(
        forward(*a, **k)
    )

    def step():
        assert trainer.train_step() == []

    assert len(trainer.train_step()) == 1  # a process's first step is read back at once
    before = [p.detach().clone() for p in trainer.raw.parameters()]
    adam_steps = trainer.optimizer.state_dict()["state"][0]["step"].item()
    poison["on"] = True
    step()
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.raw.parameters()))  # no update at all
    assert trainer.optimizer.state_dict()["state"][0]["step"].item() == adam_steps
    poison["on"] = False
    step()
    poison["on"] = True
    step(), step(), step()
    records = [s.record for s in trainer.read_back()]
    assert [r.get("skipped") for r in records] == ["nan", None, "nan", "nan", "nan"]
    assert all(isinstance(r["loss"], str) for r in records if r.get("skipped"))
    with pytest.raises(TrainingError, match="3 steps in a row"):
        for record in records:
            trainer.spikes.check_bad(record)

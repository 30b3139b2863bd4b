"""The NaN and spike checks on the device: no host sync inside a step, the same verdicts as the
host's guard, skipped updates that leave weights and optimizer state exactly as they were, and
records read back a few steps at a time that equal the ones read every step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TINY

from gpt2lab.distributed.dist import DistInfo
from gpt2lab.model.loss import LossPath
from gpt2lab.train.optim import Muon, make_optimizer, skips_on_device
from gpt2lab.train.settings import load_preset
from gpt2lab.train.spikes import DeviceGuard, SpikeGuard
from gpt2lab.train.trainer import GPU_CHECK_INTERVAL, Trainer, TrainingError, check_interval

CPU = torch.device("cpu")


def _trainer(data: str, out, **fields) -> Trainer:
    cfg = load_preset("shakespeare-cpu", **{**TINY, "data": data, "out": str(out), **fields})
    return Trainer.from_config(cfg, DistInfo(device=CPU))


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


@pytest.mark.parametrize("window,loss_z,norm_z", [(8, 4.0, 6.0), (8, 0.0, 6.0), (8, 4.0, 0.0), (0, 4.0, 6.0)])
def test_device_guard_gives_the_host_guards_verdicts_and_z_scores(window, loss_z, norm_z):
    host, shadow = SpikeGuard(window, loss_z, norm_z, 3), SpikeGuard(window, loss_z, norm_z, 3)
    for i, (loss, norm) in enumerate(_values(12, 1)):  # a device guard built mid-run from the host's state
        shadow.check(i, i, loss, norm)
        host.check(i, i, loss, norm)
    device = DeviceGuard(shadow, CPU)
    verdicts = 0
    for i, (loss, norm) in enumerate(_values(60, 2), start=12):
        finite = math.isfinite(loss) and math.isfinite(norm)
        want = host.check(i, i, loss, norm) if finite else None
        bad, z_loss, z_norm = device.check(
            torch.tensor(loss, dtype=torch.float32), torch.tensor(norm, dtype=torch.float32)
        )
        assert bad.dtype == torch.float32  # found_inf for the fused kernels
        assert bool(bad) == (not finite or want is not None), (i, loss, norm, want)
        if want is not None:
            verdicts += 1
            assert (round(z_loss.item(), 2), round(z_norm.item(), 2)) == (want["loss_z"], want["norm_z"])
        if finite:  # float32 losses, as the trainer's
            shadow.record(i, i, float(np.float32(loss)), float(np.float32(norm)), spiked=bool(bad))
    assert verdicts == (0 if window == 0 else {(4.0, 6.0): 4, (0.0, 6.0): 1, (4.0, 0.0): 3}[(loss_z, norm_z)])
    assert shadow.spikes == host.spikes
    assert np.allclose(list(shadow.losses), list(host.losses), atol=1e-6)


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
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        else:
            opt = Muon(
                params, lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True, ns_dtype=torch.float32, variant=kind
            )
        return params, opt

    (a, opt_a), (b, opt_b) = make(), make()
    assert skips_on_device(opt_a)
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        grads = _grads(shapes, g)
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        if step == 2:  # skipped on the device: b does not step at all
            opt_a.found_inf = torch.tensor(1.0)
            before = [p.detach().clone() for p in a]
            state = [(k, v.clone()) for p in a for k, v in sorted(opt_a.state[p].items())]
            opt_a.step()
            del opt_a.found_inf
            assert all(torch.equal(x, p) for x, p in zip(before, a))
            after = [(k, v) for p in a for k, v in sorted(opt_a.state[p].items())]
            assert len(after) == len(state) and all(
                k == j and torch.equal(v, w) for (k, v), (j, w) in zip(after, state)
            )
            continue
        opt_a.found_inf = torch.tensor(0.0)
        opt_a.step()
        del opt_a.found_inf
        opt_b.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_check_interval_auto_and_where_the_host_must_decide():
    model = torch.nn.Linear(4, 4)
    fused = make_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device=CPU)
    plain = make_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device=CPU, fused=False)
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
    trainer.train_step()  # the loader's first batch and lazy state outside the watch
    trainer.step += 1
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def watch(self, *a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, watch)
    for _ in range(3):
        assert trainer.train_step() is None
        trainer.step += 1
    assert calls == []
    monkeypatch.undo()
    records = [r for r, _, _ in trainer.read_back()]
    assert [r["step"] for r in records] == [0, 1, 2, 3] and all(np.isfinite(r["train_loss"]) for r in records)


def test_nan_steps_are_skipped_on_the_device_and_counted_when_read_back(tiny_data, tmp_path):  # noqa: F811
    trainer = _trainer(tiny_data, tmp_path, max_bad_steps=3, check_interval=8)
    forward, poison = trainer.model.forward, {"on": False}
    trainer.model.forward = lambda *a, **k: (lambda lo: (lo[0], lo[1] * float("nan") if poison["on"] else lo[1]))(
        forward(*a, **k)
    )

    def step():
        assert trainer.train_step() is None
        trainer.step += 1

    step()
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
    records = [r for r, _, _ in trainer.read_back()]
    assert [r.get("skipped") for r in records] == [None, "nan", None, "nan", "nan", "nan"]
    assert all(isinstance(r["loss"], str) for r in records if r.get("skipped"))
    with pytest.raises(TrainingError, match="3 steps in a row"):
        for record in records:
            trainer.spikes.check_bad(record)

"""Optimizer groups, AdamW against torch's reference implementation, and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.train.optim import AdamW, param_groups
from gpt2lab.train.schedule import lr_at
from gpt2lab.train.settings import load_preset


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16))


def test_weight_decay_only_on_matrices():
    model = _model()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    named = dict(model.named_parameters())  # de-duplicates the tied lm_head
    by_id = {id(p): n for n, p in named.items()}
    assert sorted(by_id[id(p)] for p in decay["params"]) == sorted(n for n, p in named.items() if p.dim() == 2)
    assert all(n.endswith("bias") or ".ln_" in n for n in (by_id[id(p)] for p in no_decay["params"]))
    assert len(decay["params"]) + len(no_decay["params"]) == len(named)
    # 2-D weights: wte (tied), wpe, and four per block
    assert len(decay["params"]) == 2 + 4 * model.config.n_layer


def test_adamw_step_matches_torch_reference():
    """Our AdamW (fused where available) against plain, unfused torch.optim.AdamW, same gradients."""
    a, b = _model(), _model()
    opt_a = AdamW(param_groups(a, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    groups_b = [
        {"params": [p for p in b.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in b.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt_b = torch.optim.AdamW(groups_b, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for pa, pb in zip(a.parameters(), b.parameters()):
            g = torch.randn(pa.shape, generator=gen)
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6, rtol=0)
    assert not torch.equal(a.transformer.wte.weight, _model().transformer.wte.weight)  # it did move


def test_lr_schedule_reference_values():
    o = load_preset("gpt2-124m").optim

    def lr(s):
        return lr_at(s, max_lr=o.max_lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, max_steps=o.max_steps)

    assert lr(0) == pytest.approx(6e-4 / 715)  # first step: max_lr / warmup, never 0
    assert lr(357) == pytest.approx(6e-4 * 358 / 715)  # linear in the warmup
    assert lr(714) == pytest.approx(6e-4)  # last warmup step reaches max_lr
    assert lr(715) == pytest.approx(6e-4)  # cosine starts at max_lr
    mid = 715 + (19073 - 715) // 2  # 9894: half-way through the decay
    assert lr(mid) == pytest.approx(3.3e-4, rel=1e-6)  # (max + min) / 2
    assert lr(19073) == pytest.approx(6e-5)  # the end: min_lr
    assert lr(30000) == pytest.approx(6e-5)  # and after it
    quarter = 715 + (19073 - 715) / 4
    assert lr(int(quarter)) == pytest.approx(6e-5 + 5.4e-4 * (1 + math.cos(math.pi / 4)) / 2, rel=1e-4)


def test_lr_schedule_is_monotone_after_warmup():
    vals = [lr_at(s, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100) for s in range(0, 120)]
    assert all(a < b for a, b in zip(vals[:10], vals[1:10]))
    assert all(a >= b for a, b in zip(vals[10:], vals[11:]))

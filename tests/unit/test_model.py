"""The GPT-2 module itself: sizes, initialisation, loss, KV cache, padded vocabulary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_gpt

from gpt2lab.model.gpt import GPT, GPTConfig


def _meta_gpt(**cfg) -> GPT:
    with torch.device("meta"):  # counts parameters without allocating 124M-1.5B floats
        return GPT(GPTConfig(**cfg))


def test_param_count_124m_and_padded_vocab():
    assert _meta_gpt().num_params() == 124_439_808
    assert _meta_gpt(vocab_size=50304, token_vocab_size=50257).num_params() == 124_475_904


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_preset_param_counts_match_transformers(name):
    import transformers

    cfg = GPTConfig.preset(name)
    hf_cfg = transformers.GPT2Config(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(hf_cfg)
    # HF counts the tied lm_head once too (parameters() de-duplicates shared tensors).
    assert _meta_gpt(**dataclasses.asdict(cfg)).num_params() == sum(p.numel() for p in hf.parameters())


def test_preset_aliases_and_bad_name():
    assert GPTConfig.preset("124M") == GPTConfig()
    assert GPTConfig.preset("350m").n_layer == 24
    with pytest.raises(ValueError, match="unknown GPT-2 size"):
        GPTConfig.preset("gpt5")


def test_config_validation_messages():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="token_vocab_size"):
        GPTConfig(vocab_size=100, token_vocab_size=101)


def test_gpt2_init_statistics():
    model = tiny_gpt(seed=0, n_layer=4, n_head=4, n_embd=256, vocab_size=1024)
    h = model.transformer.h
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.transformer.wpe.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / (2 * 4) ** 0.5  # residual projections: 1/sqrt(2 * n_layer)
    for block in h:
        assert block.attn.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
        assert block.mlp.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
        assert torch.count_nonzero(block.attn.c_attn.bias) == 0
        assert torch.equal(block.ln_1.weight, torch.ones(256))


def test_loss_is_cross_entropy_with_ignore_index():
    model = tiny_gpt()
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.randint(0, 128, (2, 16))
    targets[0, :5] = -1
    logits, loss = model(idx, targets)
    flat = logits.reshape(-1, 128)
    keep = targets.reshape(-1) != -1
    expected = -torch.log_softmax(flat[keep], -1).gather(1, targets.reshape(-1)[keep, None]).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_attention_is_causal():
    model = tiny_gpt()
    idx = torch.randint(0, 128, (1, 20))
    changed = idx.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 128
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@torch.no_grad()
def test_kv_cache_chunks_equal_full_forward():
    model = tiny_gpt()
    idx = torch.randint(0, 128, (2, 30))
    full, _ = model(idx)
    cache = model.new_kv_cache()
    pieces = []
    for lo, hi in [(0, 7), (7, 8), (8, 19), (19, 20), (20, 30)]:  # prompt, single tokens and chunks
        logits, _ = model(idx[:, lo:hi], kv_cache=cache)
        pieces.append(logits)
    assert cache.pos == 30
    assert (torch.cat(pieces, 1) - full).abs().max().item() < 1e-5


@torch.no_grad()
def test_steps_with_a_kv_cache_keep_cudnn_attention_off_and_restore_the_flag(monkeypatch):
    """cuDNN's attention builds a plan per new shape (milliseconds of host time each): every step with a
    cache runs without it, where it is run (the sampling loop, a held model's cached calls), a call
    without one (training's fixed shape) with it, and the process's flag is as it was after each step,
    an exception included, and stays off where the user turned it off."""
    from gpt2lab.inference.choice import Candidate
    from gpt2lab.inference.form import hold
    from gpt2lab.model.sampling import generate, plan_free_attention

    model, seen = tiny_gpt(), []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    idx = torch.randint(0, 128, (1, 8))
    model(idx)
    assert seen == [True, True]  # two layers, no cache
    generate(model, idx, 2)  # the prompt and one step, two layers each
    assert seen[2:] == [False] * 4 and torch.backends.cuda.cudnn_sdp_enabled()
    held, cache = hold(model, Candidate("float32", "plain")), model.new_kv_cache()
    held(idx, kv_cache=cache)
    assert seen[6:] == [False] * 2 and torch.backends.cuda.cudnn_sdp_enabled()

    def broken(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", broken)
    with pytest.raises(RuntimeError, match="planted"):
        with plan_free_attention(idx.device):
            model(idx[:, :1], kv_cache=cache)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with plan_free_attention(idx.device):
            model(idx[:, :1], kv_cache=model.new_kv_cache())
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


@torch.no_grad()
def test_last_only_and_block_size_limit():
    model = tiny_gpt()
    idx = torch.randint(0, 128, (2, 10))
    full, _ = model(idx)
    last, _ = model(idx, last_only=True)
    assert last.shape == (2, 1, 128)
    assert torch.allclose(last, full[:, -1:], atol=1e-6)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_flops_per_token_formula():
    model = _meta_gpt()
    n = model.num_params() - 1024 * 768  # without position embeddings
    assert model.flops_per_token(1024) == 6 * n + 12 * 12 * 768 * 1024


def test_padded_vocab_gradient_flows_and_shapes():
    model = tiny_gpt(vocab_size=64, token_vocab_size=50)
    idx = torch.randint(0, 50, (2, 8))
    logits, loss = model(idx, torch.randint(0, 50, (2, 8)))
    assert logits.shape == (2, 8, 64)
    loss.backward()
    assert model.transformer.wte.weight.grad is not None
    # Padded rows get no target, so their gradient is only the softmax pushing them down.
    assert (model.transformer.wte.weight.grad[50:] != 0).any()

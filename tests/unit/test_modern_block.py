"""The modern block's switches (GPTConfig.pos_emb, norm, qk_norm, mlp_act, tie_embeddings,
zero_init_proj, logit_softcap), each against an independent reference: formulas written out
here, transformers' rotary helper, plain F.cross_entropy through autograd, hand counts."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ALL_ON
from torch.nn import functional as F

from gpt2lab.model.gpt import GPT, GPTConfig, apply_rotary, norm_layer, rotary_cos_sin
from gpt2lab.model.loss import chunked_cross_entropy

SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=24, vocab_size=96)


def model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **overrides})).eval()


def test_defaults_are_gpt2():
    cfg = GPTConfig()
    assert (
        cfg.pos_emb,
        cfg.norm,
        cfg.qk_norm,
        cfg.mlp_act,
        cfg.tie_embeddings,
        cfg.zero_init_proj,
        cfg.logit_softcap,
    ) == ("learned", "layernorm", False, "gelu", True, False, 0.0)
    assert cfg.modern() == {}
    m = model()
    assert m.lm_head.weight is m.transformer.wte.weight and "wpe" in m.transformer
    assert isinstance(m.transformer.h[0].ln_1, torch.nn.LayerNorm)


@pytest.mark.parametrize(
    "bad, needle",
    [
        (dict(pos_emb="alibi"), "pos_emb 'alibi': choose one of learned, rotary"),
        (dict(norm="batchnorm"), "norm 'batchnorm': choose one of layernorm, rmsnorm"),
        (dict(mlp_act="swiglu"), "mlp_act 'swiglu': choose one of gelu, relu2"),
        (dict(logit_softcap=-1.0), "logit_softcap -1.0 must be >= 0"),
        (dict(pos_emb="rotary", n_embd=30, n_head=2), "rotary positions need an even head size"),
    ],
)
def test_bad_values_are_named(bad, needle):
    with pytest.raises(ValueError, match=needle):
        GPTConfig(**{**SMALL, **bad})


def test_rmsnorm_matches_its_formula():
    torch.manual_seed(0)
    norm = norm_layer(GPTConfig(**SMALL, norm="rmsnorm", layer_norm_epsilon=1e-5))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 32) * 3 + 1
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]  # a gain, no bias


def test_rotary_matches_transformers_llama_helper():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = GPTConfig(**SMALL, pos_emb="rotary", rope_theta=500.0)
    hs, start, T = 16, 5, 7
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, T, hs), torch.randn(2, 2, T, hs)
    ref_emb = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=32,
            num_attention_heads=2,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        )
    )
    cos_ref, sin_ref = ref_emb(q, torch.arange(start, start + T)[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_ref, sin_ref)
    cos, sin = rotary_cos_sin(cfg, torch.arange(start, start + T))
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), k_ref, rtol=1e-5, atol=1e-5)


def test_rotary_matches_the_formula_and_depends_on_offsets_only():
    cfg = GPTConfig(**SMALL, pos_emb="rotary", rope_theta=100.0)
    hs, h = 16, 8
    torch.manual_seed(1)
    x = torch.randn(1, 1, 4, hs)
    out = apply_rotary(x, *rotary_cos_sin(cfg, torch.arange(3, 3 + 4)))
    for t in range(4):  # pair i = channels (i, i + hs/2), angle = position * theta^(-2i/hs)
        for i in range(h):
            ang = (3 + t) * 100.0 ** (-2 * i / hs)
            a, b = x[0, 0, t, i].item(), x[0, 0, t, i + h].item()
            assert out[0, 0, t, i].item() == pytest.approx(a * math.cos(ang) - b * math.sin(ang), abs=1e-5)
            assert out[0, 0, t, i + h].item() == pytest.approx(b * math.cos(ang) + a * math.sin(ang), abs=1e-5)
    # q.k of rotated vectors depends on the positions' difference only
    q, k = torch.randn(1, 1, 1, hs), torch.randn(1, 1, 1, hs)
    dots = []
    for p in (0, 9):
        rq = apply_rotary(q, *rotary_cos_sin(cfg, torch.arange(p + 4, p + 4 + 1)))
        rk = apply_rotary(k, *rotary_cos_sin(cfg, torch.arange(p, p + 1)))
        dots.append((rq * rk).sum().item())
    assert dots[0] == pytest.approx(dots[1], abs=1e-4)


def test_attention_with_qk_norm_and_rotary_matches_a_hand_written_one():
    m = model(pos_emb="rotary", qk_norm=True)
    attn, eps = m.transformer.h[0].attn, m.config.layer_norm_epsilon
    torch.manual_seed(2)
    x = torch.randn(2, 6, 32)
    rope = rotary_cos_sin(m.config, torch.arange(0, 0 + 6))
    q, k, v = (x @ attn.c_attn.weight.T + attn.c_attn.bias).split(32, dim=2)
    q, k, v = (t.view(2, 6, 2, 16).transpose(1, 2) for t in (q, k, v))
    q, k = (t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) for t in (q, k))  # unit RMS per head, no gain
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32)
    expected = y @ attn.c_proj.weight.T + attn.c_proj.bias
    torch.testing.assert_close(attn(x, None, rope), expected, rtol=1e-4, atol=1e-5)


def test_relu2_mlp_is_relu_squared():
    m = model(mlp_act="relu2")
    assert m.transformer.h[0].mlp.act(torch.tensor([-2.0, 0.0, 0.5, 3.0])).tolist() == [0.0, 0.0, 0.25, 9.0]
    mlp, x = m.transformer.h[0].mlp, torch.randn(3, 32)
    h = x @ mlp.c_fc.weight.T + mlp.c_fc.bias
    expected = (torch.clamp(h, min=0) ** 2) @ mlp.c_proj.weight.T + mlp.c_proj.bias
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_zero_init_makes_each_block_the_identity():
    m = model(zero_init_proj=True)
    for block in m.transformer.h:
        for proj in (block.attn.c_proj, block.mlp.c_proj):
            assert proj.weight.abs().max() == 0 and proj.bias.abs().max() == 0
        assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    idx = torch.randint(0, 96, (2, 8))
    x = m.transformer.wte(idx) + m.transformer.wpe(torch.arange(8))
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], m.lm_head(m.transformer.ln_f(x)))
    plain = model()
    assert plain.transformer.h[0].attn.c_proj.weight.abs().max() > 0


def test_softcap_is_cap_tanh_of_the_uncapped_logits():
    capped, plain = model(logit_softcap=2.0), model()
    with torch.no_grad():
        capped.lm_head.weight.mul_(50)  # logits well past the cap (tied: wte too, so copy after)
    plain.load_state_dict(capped.state_dict())
    idx = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        raw, got = plain(idx)[0], capped(idx)[0]
    assert raw.abs().max() > 4
    torch.testing.assert_close(got, 2.0 * torch.tanh(raw / 2.0), rtol=1e-5, atol=1e-5)
    assert got.abs().max() <= 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_with_softcap_matches_cross_entropy_value_and_gradient(dtype):
    torch.manual_seed(3)
    N, C, V, cap = 40, 16, 120, 3.0
    x0, w0 = torch.randn(N, C) * 2, torch.randn(V, C)
    t = torch.randint(0, V, (N,))
    t[::7] = -1  # ignored rows
    x, w = x0.to(dtype, copy=True).requires_grad_(), w0.to(dtype, copy=True).requires_grad_()
    loss = chunked_cross_entropy(x, w, t, softcap=cap)
    loss.backward()
    xr, wr = x0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
    ref = F.cross_entropy(cap * torch.tanh((xr.to(dtype) @ wr.to(dtype).T).float() / cap), t, ignore_index=-1)
    ref.backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(loss.float(), ref, **tol)
    torch.testing.assert_close(x.grad.float(), xr.grad, **tol)
    torch.testing.assert_close(w.grad.float(), wr.grad, **tol)
    with torch.no_grad():  # the evaluation path (no gradient work)
        torch.testing.assert_close(
            chunked_cross_entropy(x0, w0, t, softcap=cap),
            F.cross_entropy(cap * torch.tanh(x0 @ w0.T / cap), t, ignore_index=-1),
        )


@pytest.mark.slow
def test_compiled_chunked_loss_with_softcap_matches():
    torch.manual_seed(4)
    x, w, t = (
        torch.randn(24, 16, requires_grad=True),
        torch.randn(80, 16, requires_grad=True),
        torch.randint(0, 80, (24,)),
    )
    loss = chunked_cross_entropy(x, w, t, compiled=True, softcap=2.5)
    gx, gw = torch.autograd.grad(loss, (x, w))
    ref = F.cross_entropy(2.5 * torch.tanh(x @ w.T / 2.5), t)
    rx, rw = torch.autograd.grad(ref, (x, w))
    torch.testing.assert_close((loss, gx, gw), (ref, rx, rw), rtol=1e-5, atol=1e-6)


def test_untied_head_has_its_own_weights_and_gradients():
    m = model(tie_embeddings=False).train()
    assert m.lm_head.weight is not m.transformer.wte.weight
    idx, tgt = torch.randint(0, 48, (2, 8)), torch.randint(0, 96, (2, 8))
    m(idx, tgt, return_logits=False)[1].backward()
    chunked = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    logits = m(idx)[0]
    F.cross_entropy(logits.view(-1, 96), tgt.view(-1)).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(chunked[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    # rows of wte never looked up get no gradient; the head's rows all do
    assert chunked["transformer.wte.weight"][48:].abs().max() == 0
    assert (chunked["lm_head.weight"].abs().sum(1) > 0).all()


def test_kv_cache_decode_equals_full_forward_with_every_option_on():
    m = model(**ALL_ON)
    idx = torch.randint(0, 96, (2, 24))  # up to block_size
    full = m(idx)[0]
    cache, parts = m.new_kv_cache(), []
    for a, b in ((0, 5), (5, 6), (6, 13), (13, 14), (14, 24)):
        parts.append(m(idx[:, a:b], kv_cache=cache)[0])
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds block_size"):
        m(idx[:, :1], kv_cache=cache)


def test_activation_checkpointing_keeps_the_rotary_loss_and_gradients():
    m = model(**ALL_ON).train()
    idx = torch.randint(0, 96, (2, 12))
    m(idx, idx, return_logits=False)[1].backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.activation_checkpointing = True
    m(idx, idx, return_logits=False)[1].backward()
    for a, p in zip(ref, m.parameters()):
        torch.testing.assert_close(p.grad, a)


def test_parameter_counts_and_flops_by_hand():
    C, L, V, T = 32, 2, 96, 24
    cfg = GPTConfig(**{**SMALL, **ALL_ON})
    # per block: c_attn 3C^2+3C, attn c_proj C^2+C, c_fc 4C^2+4C, mlp c_proj 4C^2+C, two RMSNorm gains C each
    block = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C) + 2 * C
    root = V * C + V * C + C  # wte, the untied lm_head, ln_f's gain; no wpe
    m = GPT(cfg)
    assert block == 12 * 1024 + 11 * 32 and sum(p.numel() for p in m.transformer.h[0].parameters()) == block
    assert m.num_params() == L * block + root == 31_456
    assert m.num_params(non_embedding=True) == 31_456 - V * C  # wte is looked up only; lm_head multiplies
    assert m.flops_per_token(T) == 6 * (31_456 - V * C) + 12 * L * C * T
    gpt2 = GPTConfig(**SMALL)  # learned positions, LayerNorm (2C each), tied
    assert GPT(gpt2).num_params() == L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C


def test_init_from_takes_the_modern_fields_from_the_source():
    from gpt2lab.train.init_from import ARCH_FIELDS

    assert {"pos_emb", "rope_theta", "norm", "qk_norm", "mlp_act", "tie_embeddings", "logit_softcap"} <= set(
        ARCH_FIELDS
    )
    assert "zero_init_proj" not in ARCH_FIELDS  # it only sets the initial weights


def test_flags_toml_and_old_configs(tmp_path):
    import argparse

    from gpt2lab.model.config import model_from_config
    from gpt2lab.train.config import ConfigError, TrainConfig
    from gpt2lab.train.settings import add_config_flags, overrides_from_args

    p = argparse.ArgumentParser()
    add_config_flags(p)
    args = p.parse_args(
        [
            "--pos-emb",
            "ROTARY",
            "--norm",
            "rmsnorm",
            "--qk-norm",
            "true",
            "--mlp-act",
            "relu2",
            "--tie-embeddings",
            "false",
            "--zero-init-proj",
            "yes",
            "--logit-softcap",
            "15",
            "--rope-theta",
            "1000",
        ]
    )
    cfg = TrainConfig.from_dict(overrides_from_args(args))
    assert cfg.model.modern() == dict(
        pos_emb="rotary",
        rope_theta=1000.0,
        norm="rmsnorm",
        qk_norm=True,
        mlp_act="relu2",
        tie_embeddings=False,
        zero_init_proj=True,
        logit_softcap=15.0,
    )
    with pytest.raises(SystemExit):
        p.parse_args(["--norm", "batchnorm"])
    with pytest.raises(ConfigError, match="qk_norm must be true or false, got 'yes'"):
        TrainConfig.from_dict({"model": {"qk_norm": "yes"}})
    with pytest.raises(ConfigError, match="pos_emb must be text, got 3"):
        TrainConfig.from_dict({"pos_emb": 3})
    # a config.json without these fields: GPT-2's defaults
    old = model_from_config({"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 96}})
    assert old.modern() == {} and old.tie_embeddings is True

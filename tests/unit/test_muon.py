"""Muon: the Newton-Schulz iteration against a written-out reference and the SVD, its dtype
(bf16 vs fp32, chosen from faked machine facts), the update against torch.optim.Muon, the
parameter split, the combined optimizer's state, the wsd schedule and the config checks."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from conftest import reference_newton_schulz

from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system import runtime
from gpt2lab.system.runtime import Facts, Probe, choose_ns_dtype
from gpt2lab.train.config import ConfigError
from gpt2lab.train.optim import Muon, Optimizers, make_muon, muon_split, orthogonalize
from gpt2lab.train.schedule import lr_at, scheduled_lr, set_lrs
from gpt2lab.train.settings import load_preset

CPU = torch.device("cpu")


@pytest.mark.parametrize("shape", [(24, 72), (72, 24), (48, 48)])
def test_newton_schulz_matches_written_out_reference_and_svd(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    ours = orthogonalize(g, torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == g.shape
    torch.testing.assert_close(ours.double(), reference_newton_schulz(g), atol=2e-5, rtol=0)
    # what it approximates: U V^T of the SVD (singular values pushed into roughly [0.5, 1.2])
    U, _, Vh = torch.linalg.svd(g.double(), full_matrices=False)
    uv = U @ Vh
    cosine = (ours.double() * uv).sum() / (ours.double().norm() * uv.norm())
    assert cosine > 0.97
    s = torch.linalg.svdvals(ours.double())
    assert 0.45 < s.min() and s.max() < 1.25


@pytest.mark.parametrize("shape", [(24, 72), (72, 24)])
def test_bf16_and_fp32_iterations_agree(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    fp32, bf16 = orthogonalize(g, torch.float32), orthogonalize(g, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    rel = (bf16.float() - fp32).norm() / fp32.norm()
    assert 1e-4 < rel < 0.05  # bf16 rounding (8 bits of mantissa): different, but the same update


def _model(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, **kw))


def _grads(model: GPT, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in model.parameters()]


def _muon_on_hidden(model: GPT, cls, **kw):
    return cls(muon_split(model)["hidden"], lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True, **kw)


def test_muon_step_equals_torch_muon_in_bf16_and_close_in_fp32():
    """Our Muon with the iteration in bf16 is torch.optim.Muon's update; in fp32 it differs only by bf16 rounding."""
    ref, bf16, fp32 = _model(), _model(), _model()
    opts = [
        _muon_on_hidden(ref, torch.optim.Muon),
        _muon_on_hidden(bf16, Muon, ns_dtype=torch.bfloat16),
        _muon_on_hidden(fp32, Muon, ns_dtype=torch.float32),
    ]
    start = [p.detach().clone() for p in ref.parameters()]
    for step in range(3):
        for model, opt in zip((ref, bf16, fp32), opts):
            for p, g in zip(model.parameters(), _grads(model, step)):
                p.grad = g
            opt.step()
    hidden = {id(p) for p in muon_split(ref)["hidden"]}
    for p0, pr, pb, pf in zip(start, ref.parameters(), bf16.parameters(), fp32.parameters()):
        if id(pr) not in hidden:
            continue
        torch.testing.assert_close(pb, pr, atol=1e-6, rtol=0)
        moved_ref, moved_fp32 = pr - p0, pf - p0
        assert moved_ref.norm() > 0.01
        assert (moved_fp32 - moved_ref).norm() / moved_ref.norm() < 0.05
    # the momentum buffers are torch's state, under torch's key
    p = muon_split(bf16)["hidden"][0]
    torch.testing.assert_close(
        opts[1].state[p]["momentum_buffer"], opts[0].state[muon_split(ref)["hidden"][0]]["momentum_buffer"]
    )


def test_split_gives_muon_the_blocks_matrices_and_adamw_the_rest():
    model = _model()
    split = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    role = {r: sorted(names[id(p)] for p in ps) for r, ps in split.items()}
    assert role["hidden"] == sorted(
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert role["embed"] == ["transformer.wpe.weight", "transformer.wte.weight"]
    assert role["head"] == []  # tied to wte: trained once, as the embedding
    assert all(n.endswith(".bias") or ".ln_" in n for n in role["other"])
    assert sum(len(v) for v in role.values()) == len(names)
    # an untied head (a separate tensor) is the head's
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert [names.get(id(p), "lm_head") for p in muon_split(model)["head"]] == ["lm_head"]


def _cfg(**kw):
    return load_preset(
        "shakespeare-cpu",
        optimizer="muon",
        max_lr=1e-3,
        min_lr=1e-4,
        warmup_steps=2,
        max_steps=10,
        embed_lr=3e-3,
        head_lr=2e-3,
        muon_lr=0.05,
        lr_schedule="wsd",
        decay_frac=0.5,
        **kw,
    )


def _make(model, cfg):
    return make_muon(model, cfg.optim, CPU)


def test_every_group_gets_its_peak_and_the_same_schedule_factor():
    cfg, model = _cfg(), _model()
    opt = _make(model, cfg)
    peaks = {"muon_lr": 0.05, "embed_lr": 3e-3, "max_lr": 1e-3}
    assert sorted({g["lr_name"] for g in opt.param_groups}) == sorted(peaks)
    for step in (0, 1, 4, 7, 9, 10):
        set_lrs(opt, step, cfg.optim)
        # warmup 2, stable to step 5, then linear to min_lr/max_lr = 0.1 of the peak at step 10
        factor = {0: 0.5, 1: 1.0, 4: 1.0, 7: 1 - 0.9 * 2 / 5, 9: 1 - 0.9 * 4 / 5, 10: 0.1}[step]
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(peaks[g["lr_name"]] * factor, rel=1e-12), (step, g["lr_name"])
    assert scheduled_lr(7, cfg.optim) == pytest.approx(1e-3 * (1 - 0.9 * 2 / 5))


def test_combined_state_round_trips_and_refuses_another_optimizers_state():
    cfg = _cfg()
    a, b = _model(), _model()
    opt_a = _make(a, cfg)
    for step in range(2):
        for p, g in zip(a.parameters(), _grads(a, step)):
            p.grad = g
        opt_a.step()
    state = copy.deepcopy(opt_a.state_dict())  # as a checkpoint holds it: tensors of its own
    assert sorted(state) == ["adamw", "muon"]
    b.load_state_dict(a.state_dict())
    opt_b = _make(b, cfg)
    opt_b.load_state_dict(state)
    for model, opt in ((a, opt_a), (b, opt_b)):  # one more step from the same state: the same weights
        for p, g in zip(model.parameters(), _grads(model, 9)):
            p.grad = g
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    adamw_only = torch.optim.AdamW(a.parameters()).state_dict()
    with pytest.raises(ValueError, match="holds one optimizer .adamw., this run uses adamw.muon"):
        opt_b.load_state_dict(adamw_only)
    assert isinstance(opt_b, Optimizers)


# -- the schedule ----------------------------------------------------------------------------
def test_wsd_schedule_hand_derived_values():
    def lr(s, **kw):
        return lr_at(
            s, **{**dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, schedule="wsd", decay_frac=0.2), **kw}
        )

    assert lr(0) == pytest.approx(0.1) and lr(5) == pytest.approx(0.6)  # the same warmup as cosine
    assert lr(10) == lr(50) == lr(79) == lr(80) == 1.0  # stable until step 80 = 100 - 20
    assert lr(90) == pytest.approx(1 - 0.9 * 10 / 20)  # half-way down: 0.55
    assert lr(99) == pytest.approx(1 - 0.9 * 19 / 20)  # the last step: 0.145
    assert lr(100) == lr(150) == 0.1  # min_lr at and after the end
    assert lr(99, decay_frac=0.0) == 1.0  # no decay at all
    # a decay longer than what follows the warmup starts when the warmup ends
    assert lr(15, max_steps=20, decay_frac=0.9) == pytest.approx(1 - 0.9 * 5 / 10)
    # cosine stays the default shape
    assert lr_at(55, max_lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100) == pytest.approx(0.55)


# -- the Newton-Schulz dtype, from faked machine facts ----------------------------------------
@pytest.mark.parametrize(
    "facts, want",
    [
        (Facts("cuda", "H100", cuda_bf16=True), "bfloat16"),
        (Facts("cuda", "V100", cuda_bf16=False), "float32"),
        (Facts("mps"), "float32"),
        (Facts("cpu", probe=Probe(fp32_gflops=116, bf16_gflops=0.7)), "float32"),  # AVX2 EPYC: emulated bf16
        (Facts("cpu", probe=Probe(fp32_gflops=100, bf16_gflops=300)), "bfloat16"),  # AVX512_BF16 / AMX
        (Facts("cpu", cpu_flags=("avx512_bf16",)), "bfloat16"),  # not probed: the flag
        (Facts("cpu", cpu_flags=("avx2", "fma")), "float32"),
    ],
)
def test_ns_dtype_follows_the_machine(facts, want):
    choice = choose_ns_dtype("auto", facts)
    assert choice.value == want and choice.reason
    assert choose_ns_dtype("bfloat16", facts).value == "bfloat16"  # asked for: given
    with pytest.raises(runtime.ChoiceError, match="muon_ns_dtype 'fp8'"):
        choose_ns_dtype("fp8", facts)


def test_ns_choice_is_recorded_only_for_muon():
    facts = Facts("cpu", probe=Probe(fp32_gflops=116, bf16_gflops=0.7))
    muon = runtime.resolve("cpu", "auto", "false", facts=facts, ns_dtype="auto")
    assert muon.record()["muon_ns_dtype"] == "float32"
    assert "bf16 is not faster" in muon.record()["muon_ns_dtype_reason"]
    assert "Muon Newton-Schulz in float32" in muon.summary()
    adamw = runtime.resolve("cpu", "auto", "false", facts=facts)
    assert "muon_ns_dtype" not in adamw.record() and "Muon" not in adamw.summary()


# -- config checks ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(optimizer="muon", strategy="fsdp"), "use --strategy ddp"),
        (dict(optimizer="muon", lora_rank=4), "use --optimizer adamw"),
        (dict(embed_lr=1e-3), "embed_lr 0.001: applies to --optimizer muon"),
        (dict(muon_lr=0.05), "muon_lr 0.05: applies to --optimizer muon"),
        (dict(optimizer="sgd"), "optimizer 'sgd': choose one of adamw, muon"),
        (dict(lr_schedule="linear"), "lr_schedule 'linear': choose one of cosine, wsd"),
        (dict(decay_frac=1.5), "decay_frac 1.5 must be in [0, 1]"),
        (dict(optimizer="muon", muon_momentum=1.0), "muon_momentum 1.0 must be in [0, 1)"),
    ],
)
def test_bad_optimizer_settings_are_one_line(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_preset("shakespeare-cpu", **fields)


def test_fsdp_refusal_exits_2_from_the_cli(capsys):
    from gpt2lab.cli import main

    assert main(["train", "--preset", "shakespeare-cpu", "--optimizer", "muon", "--strategy", "fsdp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Muon orthogonalises whole matrices" in err[0] and "--strategy ddp" in err[0]


def test_sharded_parameters_are_refused_when_auto_chose_fsdp(monkeypatch):
    """--strategy auto may shard a big model; Muon then refuses before the first step."""
    monkeypatch.setattr("gpt2lab.distributed.parallel.is_sharded", lambda model: True)
    with pytest.raises(ConfigError, match="the model is sharded .FSDP."):
        _make(_model(), _cfg())


def test_wiki_cpu_pair_differs_only_in_recipe_and_half_the_steps():
    faithful, fast = load_preset("wiki-cpu"), load_preset("wiki-cpu-fast")
    for key in ("n_layer", "n_embd", "n_head", "block_size"):
        assert getattr(faithful.model, key) == getattr(fast.model, key)
    assert faithful.batch == fast.batch
    assert fast.optim.max_steps * 2 == faithful.optim.max_steps
    assert (faithful.optim.optimizer, faithful.optim.lr_schedule) == ("adamw", "cosine")
    assert (fast.optim.optimizer, fast.optim.lr_schedule) == ("muon", "wsd")
    assert faithful.model == load_preset("shakespeare-cpu", n_layer=4, n_head=4, n_embd=192).model  # GPT-2 block
    fast124 = load_preset("gpt2-124m-fast")
    assert fast124.optim.optimizer == "muon" and fast124.batch == load_preset("gpt2-124m").batch


def test_wiki_cpu_long_pair_differs_only_in_recipe_and_steps():
    faithful, fast = load_preset("wiki-cpu-long"), load_preset("wiki-cpu-long-fast")
    for key in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size"):
        assert getattr(faithful.model, key) == getattr(fast.model, key)
    assert faithful.eval.eval_tokens == fast.eval.eval_tokens
    # the same tokens a step; the fast one's first 32 steps cut them into shorter rows
    assert dataclasses.replace(fast.batch, seq_len_ramp_steps=0, seq_len_start=None) == faithful.batch
    assert faithful.optim.max_steps == 720 and fast.optim.max_steps <= 240
    assert (fast.optim.optimizer, fast.optim.lr_schedule) == ("muon", "wsd")
    assert faithful.model == load_preset("wiki-cpu").model  # the faithful block, only trained longer


def test_split_of_the_modern_block():
    """Rotary (no wpe), RMSNorm gains, an untied head: Muon still gets exactly the blocks' matrices."""
    model = _model(
        pos_emb="rotary",
        norm="rmsnorm",
        qk_norm=True,
        mlp_act="relu2",
        tie_embeddings=False,
        zero_init_proj=True,
        logit_softcap=15.0,
    )
    names = {id(p): n for n, p in model.named_parameters()}
    role = {r: sorted(names[id(p)] for p in ps) for r, ps in muon_split(model).items()}
    assert role["embed"] == ["transformer.wte.weight"] and role["head"] == ["lm_head.weight"]
    assert len(role["hidden"]) == 4 * 2 and all(n.startswith("transformer.h.") for n in role["hidden"])
    assert all(
        names_p.endswith(".weight") and "ln" in names_p or names_p.endswith(".bias") for names_p in role["other"]
    )
    fast = load_preset("wiki-cpu-fast").model
    assert (
        fast.pos_emb,
        fast.norm,
        fast.qk_norm,
        fast.mlp_act,
        fast.tie_embeddings,
        fast.zero_init_proj,
        fast.logit_softcap,
    ) == ("rotary", "rmsnorm", True, "relu2", False, True, 0.0)  # softcap: see the preset


def test_demo_recipes_are_the_shakespeare_pair():
    """`gpt2lab demo --recipe` trains one of two presets of the same data and model size: GPT-2's
    recipe one flag away from the modern default."""
    from gpt2lab.commands.demo import RECIPES

    faithful, fast = load_preset(RECIPES["faithful"]), load_preset(RECIPES["fast"])
    assert RECIPES["faithful"] == "shakespeare-cpu" and faithful.optim.optimizer == "adamw"
    assert (fast.optim.optimizer, fast.optim.lr_schedule, fast.model.pos_emb) == ("muon", "wsd", "rotary")
    for key in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size"):
        assert getattr(faithful.model, key) == getattr(fast.model, key)
    assert faithful.batch == fast.batch and faithful.data == fast.data
    assert fast.optim.max_steps <= faithful.optim.max_steps  # its step is dearer: no more wall time

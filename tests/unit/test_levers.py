"""The open GPT-2 speedrun's levers: value embeddings, U-net skips between blocks, a zero
lm_head, the batch-size ramp and NorMuon, each against a written-out formula or a hand count: a
hand-written attention and U-net forward, a float64 NorMuon loop, the ramp's micro-steps by hand,
the planner's bytes against what autograd keeps and what the optimizer holds."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TINY, saved_bytes
from torch.nn import functional as F

from gpt2lab.distributed import memplan
from gpt2lab.distributed.dist import DistInfo
from gpt2lab.model.config import model_from_config
from gpt2lab.model.gpt import GPT, GPTConfig, value_embed_table
from gpt2lab.system.errors import ConfigError
from gpt2lab.train.optim import Muon, build_optimizer, muon_split, normalize_neurons, parts
from gpt2lab.train.settings import load_preset

CPU = torch.device("cpu")
SMALL = dict(n_layer=4, n_head=2, n_embd=32, block_size=24, vocab_size=96)
LEVERS = dict(value_embeds=1, unet_skips=True, tie_embeddings=False, zero_init_head=True)


def model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **overrides})).eval()


def randomize_levers(m: GPT, seed: int = 1) -> GPT:
    """Gates and skip weights away from their starting values, a head away from zero: nothing hides."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("ve_gate") or name == "skip_weights":
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 0.5)
        if not m.config.tie_embeddings:
            m.lm_head.weight.normal_(0, 0.02, generator=gen)
    return m


# -- the model ---------------------------------------------------------------------------------
def test_every_lever_is_off_by_default_and_gpt2_is_unchanged():
    cfg = GPTConfig()
    assert (cfg.value_embeds, cfg.unet_skips, cfg.zero_init_head) == (0, False, False)
    m = model()
    names = [n for n, _ in m.named_parameters()]
    assert not any("ve" in n.split(".") or "ve_gate" in n or "skip_weights" in n for n in names)
    on = model(value_embeds=2, unet_skips=True)
    assert on.config.modern() == {"value_embeds": 2, "unet_skips": True}
    # a config.json without these fields: off
    assert (
        model_from_config(
            {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 96}}
        ).modern()
        == {}
    )


@pytest.mark.parametrize(
    "bad, needle",
    [
        (dict(value_embeds=3), "value_embeds 3 must be in [0, n_layer / 2]"),
        (dict(value_embeds=-1), "value_embeds -1 must be in [0, n_layer / 2]"),
        (dict(n_layer=1, unet_skips=True), "unet_skips needs n_layer >= 2"),
        (dict(zero_init_head=True), "zero_init_head needs tie_embeddings false"),
    ],
)
def test_bad_lever_values_are_named(bad, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        GPTConfig(**{**SMALL, **bad})


def test_value_embedding_tables_feed_the_first_and_last_layers():
    cfg = GPTConfig(**{**SMALL, "n_layer": 6, "value_embeds": 2})
    assert [value_embed_table(cfg, i) for i in range(6)] == [0, 1, None, None, 0, 1]
    cfg = GPTConfig(**{**SMALL, "n_layer": 3, "value_embeds": 1})
    assert [value_embed_table(cfg, i) for i in range(3)] == [0, None, 0]
    m = model(n_layer=6, value_embeds=2)
    assert [hasattr(b.attn, "ve_gate") for b in m.transformer.h] == [True, True, False, False, True, True]
    assert m.transformer.h[0].attn.ve_gate.tolist() == [0.5]  # starts as an even mix
    assert len(m.transformer.ve) == 2 and m.transformer.ve[0].weight.shape == (96, 32)


def test_attention_with_a_value_embedding_matches_a_hand_written_one():
    m = randomize_levers(model(value_embeds=1))
    attn, table = m.transformer.h[0].attn, m.transformer.ve[0].weight
    g = attn.ve_gate.item()
    torch.manual_seed(2)
    x, idx = torch.randn(2, 6, 32), torch.randint(0, 96, (2, 6))
    q, k, v = (x @ attn.c_attn.weight.T + attn.c_attn.bias).split(32, dim=2)
    v = (1 - g) * v + g * table[idx]  # the value embedding of each position's token
    q, k, v = (t.view(2, 6, 2, 16).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32)
    expected = y @ attn.c_proj.weight.T + attn.c_proj.bias
    with torch.no_grad():
        torch.testing.assert_close(attn(x, None, None, table[idx]), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_layer", [4, 5])
def test_forward_is_the_written_out_unet(n_layer):
    """Block by block, as the issue states it: the value-embedding table into layer 0 and the last
    layer, block i's output times skip_weights[i] into the input of block n_layer-1-i."""
    m = randomize_levers(model(n_layer=n_layer, **LEVERS))
    h, w = m.transformer.h, m.skip_weights
    assert w.shape == (n_layer // 2,)
    idx = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        ve = m.transformer.ve[0](idx)
        x = m.transformer.wte(idx) + m.transformer.wpe(torch.arange(10))
        out0 = h[0](x, None, None, ve)
        out1 = h[1](out0)
        if n_layer == 4:  # 0 -> 3, 1 -> 2
            out2 = h[2](out1 + w[1] * out1)
            last = h[3](out2 + w[0] * out0, None, None, ve)
        else:  # 0 -> 4, 1 -> 3; the middle block 2 gets no skip
            out2 = h[2](out1)
            out3 = h[3](out2 + w[1] * out1)
            last = h[4](out3 + w[0] * out0, None, None, ve)
        expected = m.lm_head(m.transformer.ln_f(last))
        torch.testing.assert_close(m(idx)[0], expected, rtol=1e-5, atol=1e-6)


def test_closed_gates_and_skips_give_the_plain_models_logits():
    """Gates at 0 and skip weights at 0: the model without the levers, to the bit."""
    plain, lev = model(tie_embeddings=False), model(value_embeds=2, unet_skips=True, tie_embeddings=False)
    lev.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        lev.skip_weights.zero_()
        for block in lev.transformer.h:
            block.attn.ve_gate.zero_()
    idx = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        assert torch.equal(lev(idx)[0], plain(idx)[0])


def test_kv_cache_decode_and_activation_checkpointing_with_every_lever_on():
    from conftest import ALL_ON

    m = randomize_levers(model(**{**ALL_ON, **LEVERS, "n_layer": 5, "value_embeds": 2}))
    idx = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        full = m(idx)[0]
        cache, pieces = m.new_kv_cache(), []
        for a, b in ((0, 5), (5, 6), (6, 17), (17, 24)):
            pieces.append(m(idx[:, a:b], kv_cache=cache)[0])
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)
    m.train()
    m(idx, idx, return_logits=False)[1].backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert ref["skip_weights"].abs().min() > 0 and ref["transformer.h.4.attn.ve_gate"].abs().item() > 0
    m.zero_grad()
    m.activation_checkpointing = True
    m(idx, idx, return_logits=False)[1].backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)
    m.zero_grad()  # and the logits path (F.cross_entropy) gives the chunked loss's gradients
    m.activation_checkpointing = False
    F.cross_entropy(m(idx)[0].view(-1, 96), idx.view(-1)).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_zero_init_head_starts_every_logit_at_zero():
    m = model(**LEVERS)
    assert m.lm_head.weight.abs().max() == 0 and m.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)
    with torch.no_grad():
        assert m(torch.randint(0, 96, (2, 8)))[0].abs().max() == 0


def test_parameter_counts_by_hand_and_the_optimizer_groups():
    C, V, L, T = 32, 96, 5, 24
    cfg = GPTConfig(**{**SMALL, "n_layer": L, "value_embeds": 2, "unet_skips": True})
    block = 12 * C * C + 13 * C  # GPT-2's block: four Linears with biases, two LayerNorms
    total = L * block + V * C + T * C + 2 * C + 2 * V * C + 2 * 2 + L // 2  # + two tables, four gates, two weights
    m = GPT(cfg)
    assert m.num_params() == memplan.param_counts(cfg)["total"] == total
    assert m.num_params(non_embedding=True) == total - T * C - 2 * V * C  # the tables are looked up only
    names = {id(p): n for n, p in m.named_parameters()}
    split = {role: sorted(names[id(p)] for p in ps) for role, ps in muon_split(m).items()}
    assert split["embed"] == [
        "transformer.ve.0.weight",
        "transformer.ve.1.weight",
        "transformer.wpe.weight",
        "transformer.wte.weight",
    ]
    assert "skip_weights" in split["other"] and sum("ve_gate" in n for n in split["other"]) == 4
    assert len(split["hidden"]) == 4 * L  # Muon still gets exactly the blocks' matrices


def test_export_refuses_the_levers_in_one_line_and_init_from_takes_them():
    from gpt2lab.system.errors import UsageError
    from gpt2lab.train.init_from import ARCH_FIELDS
    from gpt2lab.weights import gpt2, nanochat, targets

    assert {"value_embeds", "unet_skips"} <= set(ARCH_FIELDS) and "zero_init_head" not in ARCH_FIELDS
    cfg = GPTConfig(**{**SMALL, **LEVERS})
    neither = [x for x in targets.gaps(cfg, gpt2.NEEDS) if x in targets.gaps(cfg, nanochat.NEEDS)]
    assert neither == ["value_embeds=1", "unet_skips=true"]  # zero_init_head: initial weights only
    with pytest.raises(UsageError) as e:
        targets.check_exportable(cfg)
    assert "\n" not in str(e.value) and (
        "value_embeds=1 (GPT-2 and NanoChat: no value embeddings); unet_skips=true "
        "(GPT-2 and NanoChat: no skips between blocks)"
    ) in str(e.value)
    assert targets.export_target(GPTConfig(**{**SMALL, "tie_embeddings": False, "zero_init_head": True})).name


# -- the memory planner --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_layer", [4, 5])
@pytest.mark.parametrize("block", [{}, dict(pos_emb="rotary", qk_norm=True, norm="rmsnorm")], ids=["gpt2", "modern"])
def test_lever_bytes_equal_what_autograd_keeps(n_layer, dtype, block):
    """A whole training forward (the chunked loss included) with the levers on, less the same model
    without them, against the planner's lever_bytes. Under autocast the fp32 lookups are alive in
    GPT.forward but kept by nothing (the gates keep their bf16 casts): the planner counts them,
    autograd does not."""
    B, T, C, K = 3, 10, 48, 2
    base = dict(n_layer=n_layer, n_head=4, n_embd=C, vocab_size=64, block_size=T, **block)
    idx = torch.randint(0, 64, (B, T))
    kept = []
    for levers in ({}, dict(value_embeds=K, unet_skips=True)):
        torch.manual_seed(0)
        m = GPT(GPTConfig(**base, **levers))

        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                m(idx, idx, return_logits=False)

        kept.append(saved_bytes(m, forward))
    act = 4 if dtype is None else 2
    cfg = GPTConfig(**base, value_embeds=K, unet_skips=True)
    predicted = memplan.lever_bytes(cfg, B * T, act, recompute=False)
    # by hand: per gated layer the mixed v, (bf16) the cast lookup, 1 - g; the lookups; the even-depth skip
    by_hand = 2 * K * (B * T * C * act * (1 if dtype is None else 2) + 4) + K * B * T * C * 4
    by_hand += B * T * C * 4 if n_layer % 2 == 0 else 0
    assert predicted == by_hand
    lookups_unkept = K * B * T * C * 4 if dtype is not None else 0
    assert kept[1] - kept[0] == predicted - lookups_unkept
    # and the planner adds them to its activations, on top of the model without the levers
    kw = dict(micro_batch=B, seq_len=T, dtype="float32" if dtype is None else "bfloat16", device="cpu", accum=1)
    with_levers, without = (memplan.phases(c, **kw)[0].terms for c in (cfg, GPTConfig(**base)))
    assert with_levers["activations"] - without["activations"] == predicted


@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_optimizer_state_bytes_with_levers_and_normuon_equal_what_it_keeps(variant):
    cfg = GPTConfig(**{**SMALL, **LEVERS, "value_embeds": 2})
    torch.manual_seed(0)
    m = randomize_levers(GPT(cfg))
    opt = load_preset("wiki-cpu-fast", muon_variant=variant).optim
    optimizer = build_optimizer(m, opt, CPU)
    idx = torch.randint(0, 96, (2, 16))
    m(idx, idx)[1].backward()
    optimizer.step()
    kept = sum(
        t.numel() * t.element_size()
        for o in parts(optimizer)
        for state in o.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    assert kept == memplan.optimizer_state_bytes(cfg, "muon", variant)
    muon = memplan.optimizer_state_bytes(cfg, "muon")
    assert kept - muon == (4 * 9 * 32 * 4 if variant == "normuon" else 0)  # one fp32 per row: 3C + C + 4C + C
    has_rows = [("second_moment" in s) for s in optimizer.named["muon"].state.values()]
    assert has_rows == [variant == "normuon"] * 16  # the default variant is today's Muon: no second moment


# -- NorMuon ------------------------------------------------------------------------------------
def reference_normalize(o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float = 1e-8):
    """NorMuon's normalisation written out row by row in float64, and its rescale to o's norm."""
    o, v = o.double(), v.double().clone()
    rows, cols = o.shape
    n = torch.empty_like(o)
    for i in range(rows):
        mean_square = sum(o[i, j].item() ** 2 for j in range(cols)) / cols
        v[i] = beta2 * v[i] + (1 - beta2) * mean_square
        n[i] = o[i] / (math.sqrt(v[i]) + eps)
    return n * (o.norm() / n.norm()), v


@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
def test_normalize_neurons_matches_the_written_out_rows(shape):
    gen = torch.Generator().manual_seed(5)
    o = torch.randn(*shape, generator=gen) * torch.linspace(0.2, 3.0, shape[0])[:, None]  # rows of unlike size
    v0 = torch.rand(shape[0], generator=gen)
    v = v0.clone()
    got = normalize_neurons(o, v, beta2=0.9)
    want, want_v = reference_normalize(o, v0, 0.9)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v.double(), want_v, rtol=1e-6, atol=1e-7)
    # from a zero second moment, one step leaves every row with the same norm, the whole the same size
    first = normalize_neurons(o, torch.zeros(shape[0]), beta2=0.95)
    rows = first.norm(dim=1)
    assert (rows.max() / rows.min()).item() == pytest.approx(1.0, abs=1e-4)
    assert first.norm().item() == pytest.approx(o.norm().item(), rel=1e-5)
    assert o.norm(dim=1).max() / o.norm(dim=1).min() > 5


def test_normuon_step_matches_the_written_out_update():
    """Three steps of our Muon(variant="normuon") against the update written out in float64:
    Nesterov momentum, the quintic Newton-Schulz iteration, NorMuon's rows, decoupled weight
    decay and Muon's per-matrix rate sqrt(max(1, rows/cols))."""
    from conftest import reference_newton_schulz

    lr, momentum, wd, beta2 = 0.02, 0.95, 0.01, 0.9
    gen = torch.Generator().manual_seed(7)
    shapes = [(24, 8), (8, 24)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    start = [p.detach().double().clone() for p in params]
    opt = Muon(
        params,
        lr=lr,
        momentum=momentum,
        weight_decay=wd,
        nesterov=True,
        ns_dtype=torch.float32,
        variant="normuon",
        beta2=beta2,
    )
    ref = [dict(w=w, buf=torch.zeros_like(w), v=torch.zeros(w.shape[0], dtype=torch.float64)) for w in start]
    for step in range(3):
        grads = [torch.randn(*s, generator=gen) for s in shapes]
        for p, g, r in zip(params, grads, ref):
            p.grad = g
            g = g.double()
            r["buf"] = momentum * r["buf"] + (1 - momentum) * g
            o = reference_newton_schulz((1 - momentum) * g + momentum * r["buf"])
            n, r["v"] = reference_normalize(o, r["v"], beta2)
            rows, cols = r["w"].shape
            r["w"] = r["w"] * (1 - lr * wd) - lr * math.sqrt(max(1.0, rows / cols)) * n
        opt.step()
    for p, r, w0 in zip(params, ref, start):
        moved, want = p.detach().double() - w0, r["w"] - w0
        assert want.norm() > 0.01 and (moved - want).norm() / want.norm() < 1e-4
        torch.testing.assert_close(opt.state[p]["second_moment"].double(), r["v"], rtol=1e-4, atol=1e-7)


def test_normuon_state_round_trips_and_resumes_bit_for_bit():
    import copy

    cfg = load_preset("wiki-cpu-fast", muon_variant="normuon", muon_beta2=0.9).optim
    a, b = randomize_levers(model(**LEVERS)), model(**LEVERS)
    opt_a = build_optimizer(a, cfg, CPU)
    idx = torch.randint(0, 96, (2, 12))
    for _ in range(2):
        a.train()(idx, idx)[1].backward()
        opt_a.step()
        opt_a.zero_grad()
    state = copy.deepcopy(opt_a.state_dict())
    assert all("second_moment" in s for s in state["muon"]["state"].values())
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, cfg, CPU)
    opt_b.load_state_dict(state)
    assert opt_b.named["muon"].variant == "normuon" and opt_b.named["muon"].beta2 == 0.9
    for m, o in ((a, opt_a), (b, opt_b)):
        m.train()(idx, idx)[1].backward()
        o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


# -- the batch-size ramp ----------------------------------------------------------------------
def _ramp_cfg(**kw):
    # TINY: micro-batch 2 x seq 32 = 64 tokens a micro-step; 512 tokens a step = 8 micro-steps
    return load_preset(
        "shakespeare-cpu", **{**TINY, "total_batch_tokens": 512, "batch_ramp_steps": 4, "batch_ramp_start": 128, **kw}
    )


def test_ramp_micro_steps_by_hand():
    cfg = _ramp_cfg()
    # step s < 4: 128 tokens (2 micro-steps of 64) times 1 + (512 / 128 - 1) * s // 4 = 1, 1, 2, 3; then 8
    assert [cfg.accum_at(s, 1) for s in range(7)] == [2, 2, 4, 6, 8, 8, 8]
    # two processes (128 tokens a micro-step): the same tokens in each step
    assert [cfg.accum_at(s, 2) for s in range(7)] == [1, 1, 2, 3, 4, 4, 4]
    assert _ramp_cfg(batch_ramp_steps=6, batch_ramp_start=64).accum_at(5, 1) == 1 + 7 * 5 // 6 == 6
    off = _ramp_cfg(batch_ramp_steps=0, batch_ramp_start=None)
    assert [off.accum_at(s, 1) for s in range(3)] == [8, 8, 8] == [off.grad_accum_steps(1)] * 3


@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(batch_ramp_start=None), "the ramp needs both"),
        (dict(batch_ramp_steps=0), "the ramp needs both"),
        (dict(batch_ramp_start=1024), "total_batch_tokens 512 is not a multiple of batch_ramp_start 1024"),
        (dict(batch_ramp_start=192), "total_batch_tokens 512 is not a multiple of batch_ramp_start 192"),
        (dict(batch_ramp_steps=-1), "batch_ramp_steps must be >= 0"),
        (dict(muon_variant="normuon"), "muon_variant normuon: applies to --optimizer muon"),
        (dict(optimizer="muon", muon_variant="adam"), "muon_variant 'adam': choose one of muon, normuon"),
        (dict(optimizer="muon", muon_beta2=1.0), "muon_beta2 1.0 must be in [0, 1)"),
    ],
)
def test_bad_ramp_and_variant_settings_are_one_line(fields, needle):
    with pytest.raises(
        ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        _ramp_cfg(**fields)


def test_a_ramp_start_that_does_not_divide_is_refused_by_the_plan(tmp_path):
    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan

    with pytest.raises(ConfigError, match="batch_ramp_start 32 is not divisible by .* = 64; set --batch-ramp-start"):
        make_plan(_ramp_cfg(batch_ramp_start=32, data="unused", out=str(tmp_path)), MachineFacts(runtime.Facts("cpu")))


def test_the_planner_peaks_at_the_final_accumulation(tmp_path):
    """A ramp's steps accumulate fewer micro-batches of the same size: never a higher peak."""
    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan

    cfg = _ramp_cfg(data="unused", out=str(tmp_path), **LEVERS, optimizer="muon", muon_variant="normuon")
    plan = make_plan(cfg, MachineFacts(runtime.Facts("cpu")))
    kw = dict(micro_batch=2, seq_len=32, dtype="float32", device="cpu", optimizer="muon", muon_variant="normuon")
    assert plan.memory == memplan.predict(cfg.model, accum=8, **kw).to_dict()
    ramp = {cfg.accum_at(s, 1) for s in range(4)}
    assert all(
        memplan.predict(cfg.model, accum=a, **kw).total <= memplan.predict(cfg.model, accum=8, **kw).total for a in ramp
    )
    line = next(x for x in plan.lines() if x.startswith("batch"))
    assert "ramped from 128 tokens (2 micro-steps) at step 0 over 4 steps" in line
    assert any(x.startswith("optimizer muon (normuon), cosine schedule; Newton-Schulz in") for x in plan.lines())


def test_ramp_run_resumed_mid_ramp_takes_the_same_batches(tiny_data, tmp_path, capsys):  # noqa: F811
    """Every lever on: a run saved at step 3 (on the ramp) and resumed equals the run straight
    through, loss for loss; the loader's position and the tokens follow the ramp by hand; the
    checkpoint's model is refused by `gpt2lab export` in one line."""
    from gpt2lab import cli
    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan
    from gpt2lab.train.trainer import Trainer

    fields = dict(
        data=tiny_data, max_steps=6, optimizer="muon", muon_variant="normuon", muon_ns_dtype="float32", **LEVERS
    )

    def trainer(out, resume=None):
        return Trainer(
            make_plan(_ramp_cfg(out=str(out), **fields), MachineFacts(runtime.Facts("cpu")), resume=resume),
            DistInfo(device=CPU),
        )

    def steps(t, n):
        recs = []
        for _ in range(n):
            recs.append(t.train_step())
            t.step += 1
        return recs

    straight = trainer(tmp_path / "straight")
    records = steps(straight, 6)
    # micro-steps 2, 2, 4, 6, 8, 8 of 64 tokens; the loader read 2 sequences a micro-step
    assert [r["tokens"] for r in records] == [64 * t for t in (2, 4, 8, 14, 22, 30)]
    assert straight.loader.position == 2 * 30
    first = trainer(tmp_path / "resumed")
    steps(first, 3)
    path = first.save()
    again = trainer(tmp_path / "resumed", resume=path)
    assert again.step == 3 and again.loader.position == 2 * (2 + 2 + 4)
    later = steps(again, 3)
    assert [r["train_loss"] for r in later] == [r["train_loss"] for r in records[3:]]
    assert [r["tokens"] for r in later] == [r["tokens"] for r in records[3:]]
    assert again.loader.position == straight.loader.position
    assert cli.main(["export", path, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and "value_embeds=1 (GPT-2 and NanoChat: no value embeddings); unet_skips=true" in err
        and "Traceback" not in err
    )
    assert not (tmp_path / "hf").exists()
    assert (
        json.loads((tmp_path / "resumed" / "checkpoints" / "step_000003" / "config.json").read_text())["batch"][
            "batch_ramp_start"
        ]
        == 128
    )


def test_flags_and_help_come_from_the_fields(capsys):
    import argparse

    from gpt2lab.cli import main
    from gpt2lab.train.config import TrainConfig
    from gpt2lab.train.settings import add_config_flags, overrides_from_args

    p = argparse.ArgumentParser()
    add_config_flags(p)
    args = p.parse_args(
        [
            "--value-embeds",
            "2",
            "--unet-skips",
            "true",
            "--tie-embeddings",
            "false",
            "--zero-init-head",
            "yes",
            "--optimizer",
            "muon",
            "--muon-variant",
            "NorMuon",
            "--muon-beta2",
            "0.9",
            "--batch-ramp-steps",
            "10",
            "--batch-ramp-start",
            "65536",
        ]
    )
    cfg = TrainConfig.from_dict(overrides_from_args(args))
    assert cfg.model.modern() == dict(value_embeds=2, unet_skips=True, tie_embeddings=False, zero_init_head=True)
    assert (cfg.optim.muon_variant, cfg.optim.muon_beta2) == ("normuon", 0.9)
    assert (cfg.batch.batch_ramp_steps, cfg.batch.batch_ramp_start) == (10, 65536)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--value-embeds",
        "--unet-skips",
        "--zero-init-head",
        "--muon-variant",
        "--muon-beta2",
        "--batch-ramp-steps",
        "--batch-ramp-start",
    ):
        assert flag in out

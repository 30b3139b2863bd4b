"""The open GPT-2 speedrun's levers: value embeddings, U-net skips between blocks, a zero
lm_head, the batch-size ramp and NorMuon, each against a written-out formula or a hand count: a
hand-written attention and U-net forward, a float64 NorMuon loop, the ramp's micro-steps by hand,
the planner's bytes against what autograd keeps and what the optimizer holds. Then multi-token
prediction (its loss written out position by position, its export through transformers), the
sequence-length ramp (the loader's rows against the full batch), Polar Express (against
torch.linalg.svd and a float64 loop) and cautious weight decay (a step by hand)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TINY, step_record
from torch.nn import functional as F

from gpt2lab.distributed.dist import DistInfo
from gpt2lab.model.config import model_from_config
from gpt2lab.model.gpt import GPT, GPTConfig, value_embed_table
from gpt2lab.system.errors import ConfigError
from gpt2lab.train import memplan, plan_text
from gpt2lab.train.optim import Muon, build_optimizer, muon_split, normalize_neurons, parts
from gpt2lab.train.schedule import accum_at, mtp_weight_at, seq_len_at
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
        (dict(value_embeds=-1), "value_embeds -1 must be >= 0"),
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
    assert m.num_params() == total
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
    from gpt2lab.weights import targets

    assert {"value_embeds", "unet_skips"} <= set(ARCH_FIELDS) and "zero_init_head" not in ARCH_FIELDS
    cfg = GPTConfig(**{**SMALL, **LEVERS})
    neither = [x for x in targets.gaps(cfg, targets.GPT2_HF.needs) if x in targets.gaps(cfg, targets.NANOCHAT_HF.needs)]
    assert neither == ["value_embeds=1", "unet_skips=true"]  # zero_init_head: initial weights only
    with pytest.raises(UsageError) as e:
        targets.check_exportable(cfg)
    assert "\n" not in str(e.value) and (
        "value_embeds=1 (GPT-2 and NanoChat: no value embeddings); unet_skips=true "
        "(GPT-2 and NanoChat: no skips between blocks)"
    ) in str(e.value)
    assert targets.export_target(GPTConfig(**{**SMALL, "tie_embeddings": False, "zero_init_head": True})).name


def test_normuon_keeps_one_more_value_per_row_with_levers():
    cfg = GPTConfig(**{**SMALL, **LEVERS, "value_embeds": 2})
    kept = {}
    for variant in ("muon", "normuon"):
        torch.manual_seed(0)
        m = randomize_levers(GPT(cfg))
        optimizer = build_optimizer(m, load_preset("wiki-cpu-fast", muon_variant=variant).optim, CPU)
        idx = torch.randint(0, 96, (2, 16))
        m(idx, idx)[1].backward()
        optimizer.step()
        kept[variant] = sum(t.nbytes for o in parts(optimizer) for s in o.state.values() for t in s.values() if t.dim())
        has_rows = [("second_moment" in s) for s in optimizer.named["muon"].state.values()]
        assert has_rows == [variant == "normuon"] * 16  # the default variant is today's Muon: no second moment
    assert kept["normuon"] - kept["muon"] == 4 * 9 * 32 * 4  # one fp32 per row: 3C + C + 4C + C, 4 blocks


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
    assert [accum_at(cfg, s, 1) for s in range(7)] == [2, 2, 4, 6, 8, 8, 8]
    # two processes (128 tokens a micro-step): the same tokens in each step
    assert [accum_at(cfg, s, 2) for s in range(7)] == [1, 1, 2, 3, 4, 4, 4]
    assert accum_at(_ramp_cfg(batch_ramp_steps=6, batch_ramp_start=64), 5, 1) == 1 + 7 * 5 // 6 == 6
    off = _ramp_cfg(batch_ramp_steps=0, batch_ramp_start=None)
    assert [accum_at(off, s, 1) for s in range(3)] == [8, 8, 8] == [off.grad_accum_steps(1)] * 3


@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(batch_ramp_start=None), "the ramp needs both"),
        (dict(batch_ramp_steps=0), "the ramp needs both"),
        (dict(batch_ramp_start=1024), "total_batch_tokens 512 is not a multiple of batch_ramp_start 1024"),
        (dict(batch_ramp_start=192), "total_batch_tokens 512 is not a multiple of batch_ramp_start 192"),
        (dict(batch_ramp_steps=-1), "batch_ramp_steps -1 must be >= 0"),
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
    kw = dict(dtype="float32", device="cpu")
    assert plan.memory == memplan.predict(plan.config, accum=8, **kw).to_dict()
    ramp = {accum_at(cfg, s, 1) for s in range(4)}
    assert all(memplan.predict(plan.config, accum=a, **kw).total <= plan.memory["total"] * 2**20 + 2**19 for a in ramp)
    line = next(x for x in plan_text.lines(plan) if x.startswith("batch"))
    assert "ramped from 128 tokens (2 micro-steps) at step 0 over 4 steps" in line
    line = next(x for x in plan_text.lines(plan) if x.startswith("runtime "))
    assert "; Muon Newton-Schulz in float32 (" in line


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
            recs.append(step_record(t))
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


# -- multi-token prediction ----------------------------------------------------------------------
MTP = dict(mtp_heads=2, mtp_weight=0.5)


def reference_mtp_loss(m: GPT, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss with multi-token prediction written out: the main head's mean cross entropy plus
    mtp_weight times the mean, over every (head d, position t) whose target y[t+d] is in the row and kept,
    of the cross entropy of (h + W_d h)[t] through the shared unembedding, logits held in full."""
    B, T = idx.shape
    cap = m.config.logit_softcap
    x = m.transformer.wte(idx) + m.transformer.wpe(torch.arange(T))
    for block in m.transformer.h:
        x = block(x)
    h = m.transformer.ln_f(x)

    def nll(z, t):  # z (C,), t an id
        logits = z @ m.lm_head.weight.T
        logits = cap * torch.tanh(logits / cap) if cap else logits
        return torch.logsumexp(logits, 0) - logits[t]

    main = [nll(h[b, t], y[b, t]) for b in range(B) for t in range(T) if y[b, t] != -1]
    extra = [
        nll(h[b, t] + m.mtp[d - 1].weight @ h[b, t], y[b, t + d])
        for d in range(1, m.config.mtp_heads + 1)
        for b in range(B)
        for t in range(T - d)
        if y[b, t + d] != -1
    ]
    return torch.stack(main).mean() + m.mtp_weight * torch.stack(extra).mean()


def mtp_model(seed: int = 0, **overrides) -> GPT:
    m = model(seed, **{**MTP, **overrides}).train()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for head in m.mtp:  # away from their zero start: nothing hides
            head.weight.normal_(0, 0.1, generator=gen)
    return m


def test_mtp_is_off_by_default_and_adds_heads_and_a_weight_only_when_asked():
    assert (GPTConfig().mtp_heads, GPTConfig().mtp_weight_final) == (0, None)
    assert not hasattr(model(), "mtp") and "mtp_weight" not in dict(model().named_buffers())
    m = model(**MTP)
    assert [n for n, _ in m.named_parameters() if n.startswith("mtp")] == ["mtp.0.weight", "mtp.1.weight"]
    assert all(h.weight.abs().max() == 0 for h in m.mtp)  # every head starts as the next-token head
    assert "mtp_weight" not in m.state_dict() and m.mtp_weight.item() == 0.5
    assert m.config.modern() == {"mtp_heads": 2}
    assert m.num_params() == model().num_params() + 2 * 32 * 32
    with pytest.raises(ValueError, match=r"mtp_heads 24 must be in \[0, block_size 24\)"):
        GPTConfig(**{**SMALL, "mtp_heads": 24})
    with pytest.raises(ValueError, match="mtp_weight_final -0.1 must be >= 0"):
        GPTConfig(**{**SMALL, "mtp_weight_final": -0.1})


@pytest.mark.parametrize("softcap", [0.0, 8.0], ids=["nocap", "softcap"])
def test_mtp_loss_and_gradients_match_the_written_out_heads(softcap):
    """Chunked (never the logits) and fused (logits + F.cross_entropy) against the loss written out
    position by position, with ignored targets; both paths' gradients alike."""
    from gpt2lab.model.loss import LossPath

    m = mtp_model(logit_softcap=softcap, n_layer=2)
    idx, y = torch.randint(0, 96, (3, 11)), torch.randint(0, 96, (3, 11))
    y[0, 4] = y[2, 10] = -1
    m.set_mtp_weight(0.7)
    want = reference_mtp_loss(m, idx, y)
    want.backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    for path in (LossPath(True), LossPath(False)):
        m.zero_grad()
        _, loss = m.set_loss(path)(idx, y, return_logits=False)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        loss.backward()
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6, msg=n)
    assert ref["mtp.1.weight"].abs().max() > 0


def test_mtp_leaves_evaluation_and_generation_alone():
    """Outside training (and for positions, last_only, the KV cache) the loss is the next-token loss alone."""
    m, plain = mtp_model(tie_embeddings=True), model()
    plain.load_state_dict(m.state_dict(), strict=False)
    idx, y = torch.randint(0, 96, (2, 9)), torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        m.eval()
        assert torch.equal(m(idx, y, return_logits=False)[1], plain(idx, y, return_logits=False)[1])
        assert torch.equal(m(idx)[0], plain(idx)[0])
        m.train()
        plain.train()
        assert m(idx, y, return_logits=False)[1] > plain(idx, y, return_logits=False)[1]  # the heads' loss added
        m.set_mtp_weight(0.0)
        torch.testing.assert_close(m(idx, y, return_logits=False)[1], plain(idx, y, return_logits=False)[1])


def test_mtp_weight_schedule_by_hand():
    cfg = _ramp_cfg(max_steps=11, mtp_heads=2, mtp_weight=0.5, mtp_weight_final=0.1)
    # 0.5 at step 0, linearly to 0.1 at step 10 (the last of 11), then held
    assert [round(mtp_weight_at(cfg, s), 6) for s in (0, 5, 10, 20)] == [0.5, 0.3, 0.1, 0.1]
    assert [mtp_weight_at(_ramp_cfg(max_steps=11, mtp_weight=0.5), s) for s in (0, 10)] == [0.5, 0.5]


def test_mtp_heads_are_training_only_for_export(tmp_path):
    """A config exportable without the heads stays exportable with them; the export holds no head, and
    transformers' GPT-2 computes the model's next-token logits from it."""
    import transformers
    from safetensors.torch import load_file

    from gpt2lab.weights import targets
    from gpt2lab.weights.export import save_pretrained

    cfg = GPTConfig(**{**SMALL, **MTP})
    target = targets.export_target(cfg)
    assert target.name == "GPT2LMHeadModel" and target.dropped == (
        "mtp_heads=2 (multi-token prediction heads, a training loss: not written)",
    )
    assert targets.check_exportable(cfg).name == "GPT2LMHeadModel"
    assert targets.export_target(GPTConfig(**SMALL)).describe() == "Hugging Face GPT2LMHeadModel"
    modern = dict(norm="rmsnorm", bias=False, embed_norm=True, pos_emb="rotary", qk_norm=True)
    assert targets.export_target(GPTConfig(**{**SMALL, **MTP, **modern})).name == "NanoChatForCausalLM"
    neither = GPTConfig(**{**SMALL, **MTP, "value_embeds": 1})
    with pytest.raises(Exception, match="value_embeds=1"):
        targets.check_exportable(neither)
    m = mtp_model()
    save_pretrained(m, str(tmp_path / "hf"))
    assert not any("mtp" in k for k in load_file(str(tmp_path / "hf" / "model.safetensors")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    idx = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, m.eval()(idx)[0], rtol=1e-4, atol=1e-5)
    assert m.config.mtp_heads == 2 and len(m.mtp) == 2  # the model exported is left as it was


# -- the sequence-length ramp ---------------------------------------------------------------------
def test_seq_len_ramp_by_hand_and_bad_values():
    # seq_len 32 from 8: k = 2 doublings over 12 steps: 8 for steps 0-5, 16 for 6-11, then 32
    cfg = _ramp_cfg(seq_len_ramp_steps=12, seq_len_start=8)
    assert [seq_len_at(cfg.batch, s) for s in range(14)] == [8] * 6 + [16] * 6 + [32] * 2
    # 4 -> 32 (k = 3) over 5 steps: 4 * 2^floor(3s/5), floor(0, 0.6, 1.2, 1.8, 2.4) = 0, 0, 1, 1, 2
    assert [seq_len_at(_ramp_cfg(seq_len_ramp_steps=5, seq_len_start=4).batch, s) for s in range(6)] == [
        4,
        4,
        8,
        8,
        16,
        32,
    ]
    off = _ramp_cfg()
    assert {seq_len_at(off.batch, s) for s in range(5)} == {32}
    # the accumulation and the tokens of a step do not change on the ramp
    assert [accum_at(cfg, s, 1) for s in range(6)] == [accum_at(off, s, 1) for s in range(6)]
    for fields, needle in [
        (dict(seq_len_ramp_steps=4), "the sequence-length ramp needs both"),
        (dict(seq_len_start=8), "the sequence-length ramp needs both"),
        (dict(seq_len_ramp_steps=4, seq_len_start=12), "seq_len_start 12 must be seq_len 32 divided by a power of two"),
        (dict(seq_len_ramp_steps=4, seq_len_start=32), "seq_len_start 32 must be seq_len 32 divided by a power of two"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            _ramp_cfg(**fields)


def test_loader_cuts_each_sequence_into_shorter_rows_and_moves_as_before(tiny_data):  # noqa: F811
    """next_batch(L): row j of sequence i is its tokens [j*L, (j+1)*L] (inputs and targets one on), the
    same tokens as the full batch; the position advances by the same sequences."""
    from gpt2lab.data import TokenLoader

    full, short = (TokenLoader(tiny_data, "train", 3, 32, seed=5) for _ in range(2))
    for _ in range(3):
        x, y = full.next_batch()
        xs, ys = short.next_batch(8)
        assert xs.shape == ys.shape == (12, 8) and short.position == full.position
        for i in range(3):
            for j in range(4):
                assert torch.equal(xs[4 * i + j], x[i, 8 * j : 8 * j + 8])
                assert torch.equal(ys[4 * i + j], y[i, 8 * j : 8 * j + 8])
                assert torch.equal(ys[4 * i + j, :-1], xs[4 * i + j, 1:])  # a target is the next input
    assert torch.equal(short.next_batch(32)[0], full.next_batch()[0])
    with pytest.raises(ValueError, match="seq_len 12 must divide the loader's sequence length 32"):
        short.next_batch(12)


# -- Polar Express --------------------------------------------------------------------------------
def reference_polar_express(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Algorithm 1 of the Polar Express paper written out in float64: the published polynomials, each
    but the last evaluated at x / 1.01, on g / (1.01 ||g||_F); the last repeated past the eighth."""
    published = [
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    ]
    x = g.double()
    wide = x.t() if x.shape[0] > x.shape[1] else x
    wide = wide / (1.01 * torch.linalg.matrix_norm(wide) + 1e-7)
    for t in range(steps):
        a, b, c = published[min(t, 7)]
        s = 1.01 if t < 7 else 1.0  # p(x / s) = (a / s) x + (b / s^3) x^3 + (c / s^5) x^5
        xxt = wide @ wide.t()
        wide = (a / s) * wide + ((b / s**3) * xxt + (c / s**5) * (xxt @ xxt)) @ wide
    return wide.t() if x.shape[0] > x.shape[1] else wide


@pytest.mark.parametrize("shape", [(96, 48), (48, 96), (64, 64)])
def test_polar_express_singular_values_are_near_one_and_nearer_than_newton_schulz(shape):
    """Against torch.linalg.svd of the input (U V^T is the target): at 5 steps the singular values are
    nearer 1 than the quintic Newton-Schulz's at 5 (0.13 against 0.32 off for these rectangular matrices,
    0.30 against 0.62 for the square one, whose smallest singular value is 0.3% of its largest), the
    output nearer U V^T; by 8 steps Polar Express has converged (Newton-Schulz's polynomial plateaus
    near 0.7-1.2 at any count). Equal to the float64 written-out algorithm at 5 and 10 steps."""
    from gpt2lab.train.optim import orthogonalize

    gen = torch.Generator().manual_seed(3)
    g = torch.randn(*shape, generator=gen, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    assert s.min() / s.max() > 1e-3  # inside the interval the polynomials were fitted on
    polar = u @ vh
    pe = orthogonalize(g.float(), torch.float32, steps=5, orth="polar_express")
    ns = orthogonalize(g.float(), torch.float32, steps=5)
    off_pe, off_ns = ((torch.linalg.svdvals(o.double()) - 1).abs().max() for o in (pe, ns))
    assert off_pe < 0.31 and off_pe < 0.6 * off_ns
    assert torch.linalg.matrix_norm(pe.double() - polar) < 0.5 * torch.linalg.matrix_norm(ns.double() - polar)
    torch.testing.assert_close(pe.double(), reference_polar_express(g, 5), rtol=1e-4, atol=1e-5)
    for steps in (8, 10):  # past the eighth the last polynomial repeats: converged to U V^T
        pe_n = orthogonalize(g.float(), torch.float32, steps=steps, orth="polar_express").double()
        ns_n = orthogonalize(g.float(), torch.float32, steps=steps).double()
        assert (torch.linalg.svdvals(pe_n) - 1).abs().max() < 1e-3 < 0.3 < (torch.linalg.svdvals(ns_n) - 1).abs().max()
        torch.testing.assert_close(pe_n, reference_polar_express(g, steps), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pe_n, polar, rtol=0, atol=1e-3)


def test_muon_with_polar_express_steps_as_written_out():
    """Two steps of Muon(orth="polar_express") against Nesterov momentum, the written-out Polar Express
    and Muon's per-matrix rate, in float64."""
    lr, momentum = 0.02, 0.95
    gen = torch.Generator().manual_seed(11)
    shapes = [(24, 8), (8, 24)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    ref = [dict(w=p.detach().double().clone(), buf=torch.zeros(s, dtype=torch.float64)) for p, s in zip(params, shapes)]
    opt = Muon(
        params, lr=lr, momentum=momentum, weight_decay=0.0, nesterov=True, ns_dtype=torch.float32, orth="polar_express"
    )
    for _ in range(2):
        for p, r in zip(params, ref):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g
            r["buf"] = momentum * r["buf"] + (1 - momentum) * g.double()
            o = reference_polar_express((1 - momentum) * g.double() + momentum * r["buf"], 5)
            rows, cols = p.shape
            r["w"] = r["w"] - lr * math.sqrt(max(1.0, rows / cols)) * o
        opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), r["w"], rtol=1e-5, atol=1e-6)


# -- cautious weight decay ------------------------------------------------------------------------
def test_cautious_adamw_step_by_hand():
    """One AdamW step on a 2x2 weight, by hand. betas (0.5, 0.5), eps 0: m = 0.5 g, v = 0.5 g^2, and the
    bias-corrected update u = m_hat / sqrt(v_hat) = sign(g). lr 0.1, wd 0.5: where u and w agree in sign
    the weight moves by -0.1 * (sign(g) + 0.5 w), elsewhere by -0.1 * sign(g) only."""
    from gpt2lab.train.optim import AdamW

    w0 = torch.tensor([[1.0, -2.0], [0.5, -0.25]])
    g = torch.tensor([[0.3, 0.7], [-0.2, -0.1]])  # signs: +,+,-,-; agree with w at (0,0) and (1,1)
    by_hand = torch.tensor(
        [
            [1.0 - 0.1 * (1 + 0.5 * 1.0), -2.0 - 0.1 * 1],
            [0.5 + 0.1 * 1, -0.25 - 0.1 * (-1 + 0.5 * -0.25)],
        ]
    )
    for fused in (False, True):
        p = torch.nn.Parameter(w0.clone())
        p.grad = g.clone()
        opt = AdamW([p], lr=0.1, betas=(0.5, 0.5), eps=0.0, weight_decay=0.5, fused=fused or None, cautious=True)
        opt.step()
        torch.testing.assert_close(p.detach(), by_hand, rtol=0, atol=1e-6)
        assert opt.param_groups[0]["weight_decay"] == 0.5  # the group keeps its decay
        plain = torch.nn.Parameter(w0.clone())
        plain.grad = g.clone()
        torch.optim.AdamW([plain], lr=0.1, betas=(0.5, 0.5), eps=0.0, weight_decay=0.5).step()
        assert (plain.detach() - p.detach()).abs().max() > 0.05  # plain AdamW decays every coordinate
    # a step the device skips (its verdict 1) leaves the weight as it was, decay included
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    opt = AdamW([p], lr=0.1, betas=(0.5, 0.5), eps=0.0, weight_decay=0.5, fused=True, cautious=True)
    opt.step(skip=torch.ones((), dtype=torch.float64))
    assert torch.equal(p.detach(), w0) and not hasattr(opt, "found_inf")


def test_cautious_muon_step_by_hand():
    """Muon's cautious decay against the update written out: O from the float64 Newton-Schulz reference;
    w -= lr * wd * I(O * w >= 0) * w, then w -= lr * sqrt(max(1, rows/cols)) * O."""
    from conftest import reference_newton_schulz

    lr, momentum, wd = 0.1, 0.9, 0.5
    gen = torch.Generator().manual_seed(2)
    w0, g = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    opt = Muon([p], lr=lr, momentum=momentum, weight_decay=wd, nesterov=True, ns_dtype=torch.float32, cautious=True)
    opt.step()
    buf = (1 - momentum) * g.double()
    o = reference_newton_schulz((1 - momentum) * g.double() + momentum * buf)
    w = w0.double()
    mask = (o * w >= 0).double()
    assert 0 < mask.sum() < mask.numel()  # some coordinates agree in sign, some do not
    want = w - lr * wd * mask * w - lr * math.sqrt(6 / 4) * o
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_new_levers_reach_the_optimizers_and_refuse_what_does_not_apply():
    m = model(**LEVERS)
    cfg = load_preset("wiki-cpu-fast", muon_orth="polar_express", cautious_wd=True).optim
    opt = build_optimizer(m, cfg, CPU)
    assert (opt.named["muon"].orth, opt.named["muon"].cautious) == ("polar_express", True)
    assert opt.named["adamw"].cautious
    plain = build_optimizer(m, load_preset("wiki-cpu-fast").optim, CPU)
    assert (plain.named["muon"].orth, plain.named["muon"].cautious) == ("newton_schulz", False)
    assert not plain.named["adamw"].cautious
    assert build_optimizer(m, _ramp_cfg(cautious_wd=True).optim, CPU).cautious
    assert not build_optimizer(m, _ramp_cfg().optim, CPU).cautious
    with pytest.raises(ConfigError, match="muon_orth polar_express: applies to --optimizer muon"):
        _ramp_cfg(muon_orth="polar_express")
    with pytest.raises(ConfigError, match="muon_orth 'cubic': choose one of newton_schulz, polar_express"):
        _ramp_cfg(optimizer="muon", muon_orth="cubic")


# -- the new levers in a run ---------------------------------------------------------------------
NO_BATCH_RAMP = dict(batch_ramp_steps=0, batch_ramp_start=None)
NEXT = dict(
    mtp_heads=2,
    mtp_weight=0.5,
    mtp_weight_final=0.1,
    seq_len_ramp_steps=4,
    seq_len_start=8,
    optimizer="muon",
    muon_orth="polar_express",
    muon_ns_dtype="float32",
    muon_weight_decay=0.1,
    cautious_wd=True,
)


def test_a_run_with_the_new_levers_resumes_mid_ramp_as_it_ran(tiny_data, tmp_path):  # noqa: F811
    """Multi-token prediction (its weight decaying), the sequence-length ramp, Polar Express and cautious
    weight decay: a run saved at step 2 (sequences of 8, then 16 tokens) and resumed equals the run
    straight through, loss for loss; the micro-batches have the ramp's shapes; the plan says each."""
    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan
    from gpt2lab.train.trainer import Trainer

    def trainer(out, resume=None):
        cfg = _ramp_cfg(out=str(out), data=tiny_data, max_steps=6, total_batch_tokens=128, **NO_BATCH_RAMP, **NEXT)
        return Trainer(make_plan(cfg, MachineFacts(runtime.Facts("cpu")), resume=resume), DistInfo(device=CPU))

    shapes, weights = [], []

    def steps(t, n):
        recs = []
        forward = t.raw.forward
        t.raw.forward = lambda idx, *a, **k: (shapes.append(tuple(idx.shape)), forward(idx, *a, **k))[1]
        for _ in range(n):
            recs.append(step_record(t))
            weights.append(round(t.raw.mtp_weight.item(), 6))
        return recs

    straight = trainer(tmp_path / "straight")
    records = steps(straight, 6)
    # 128 tokens a step: 2 micro-steps of 2 x 32 tokens, on the ramp 8 rows of 8, then 4 rows of 16
    assert shapes == [(8, 8)] * 4 + [(4, 16)] * 4 + [(2, 32)] * 4
    assert [r["tokens"] for r in records] == [128 * (s + 1) for s in range(6)]
    assert weights == [0.5, 0.42, 0.34, 0.26, 0.18, 0.1]  # 0.5 to 0.1 over steps 0..5
    first = trainer(tmp_path / "resumed")
    steps(first, 2)
    again = trainer(tmp_path / "resumed", resume=first.save())
    assert again.step == 2 and again.loader.position == first.loader.position == 2 * 2 * 2
    later = steps(again, 4)
    assert [r["train_loss"] for r in later] == [r["train_loss"] for r in records[2:]]
    assert all(torch.equal(a, b) for a, b in zip(again.raw.state_dict().values(), straight.raw.state_dict().values()))
    lines = "\n".join(plan_text.lines(straight.plan))
    assert "export    Hugging Face GPT2LMHeadModel; drops mtp_heads=2 (multi-token prediction heads" in lines
    assert "multi-token prediction: 2 more heads (tokens t+2..t+3), weight 0.5, to 0.1 at the last step" in lines
    assert "sequences of 8 tokens at step 0 (micro-batch 8 rows), doubling to 32 by step 4" in lines
    assert "; Polar Express in place of Newton-Schulz's polynomial; cautious weight decay" in lines


def test_new_lever_flags_and_memory_in_the_plan(tmp_path):
    import argparse

    from gpt2lab.system import runtime
    from gpt2lab.train.config import TrainConfig
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan
    from gpt2lab.train.settings import add_config_flags, overrides_from_args

    p = argparse.ArgumentParser()
    add_config_flags(p)
    flags = "--mtp-heads 3 --mtp-weight 0.2 --mtp-weight-final none --seq-len-ramp-steps 10 --seq-len-start 256"
    flags += " --optimizer muon --muon-orth polar_express --cautious-wd true"
    cfg = TrainConfig.from_dict(overrides_from_args(p.parse_args(flags.split())))
    assert (cfg.model.mtp_heads, cfg.model.mtp_weight, cfg.model.mtp_weight_final) == (3, 0.2, None)
    assert (cfg.batch.seq_len_ramp_steps, cfg.batch.seq_len_start, seq_len_at(cfg.batch, 5)) == (10, 256, 512)
    assert (cfg.optim.muon_orth, cfg.optim.cautious_wd) == ("polar_express", True)
    # the heads' memory is in the plan: more than the same run without them, by the planner's terms
    plans = [
        make_plan(_ramp_cfg(data="unused", out=str(tmp_path), mtp_heads=k), MachineFacts(runtime.Facts("cpu")))
        for k in (0, 2)
    ]
    assert plans[1].memory["total"] > plans[0].memory["total"]
    assert plans[1].params == plans[0].params + 2 * 32 * 32


def test_dry_run_shows_the_new_levers_and_a_resume_keeps_them(tiny_data, tmp_path, capsys):  # noqa: F811
    from conftest import cli_args

    from gpt2lab.cli import main
    from gpt2lab.train.plan import resume_fields

    flags = cli_args(data=tiny_data, out=str(tmp_path / "run"), **NEXT)
    assert main(["train", "--preset", "shakespeare-cpu", *flags, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "run").exists()
    assert "drops mtp_heads=2 (multi-token prediction heads, a training loss: not written)" in out
    assert "multi-token prediction: 2 more heads (tokens t+2..t+3), weight 0.5, to 0.1 at the last step" in out
    assert "sequences of 8 tokens at step 0 (micro-batch 8 rows), doubling to 32 by step 4" in out
    assert "Polar Express in place of Newton-Schulz's polynomial; cautious weight decay" in out
    # what changes the training must stay the same on a resume (mtp_heads: the checkpoint's shapes)
    kept = resume_fields(_ramp_cfg(**NEXT))
    assert {"mtp_weight", "mtp_weight_final", "seq_len_ramp_steps", "seq_len_start", "muon_orth", "cautious_wd"} <= set(
        kept
    )
    assert "muon_orth" not in resume_fields(_ramp_cfg())

"""--token-features: the features of a token's text, the index, and the optimizer against the
parametrisation it stands for (W = W0 + F V, V trained by torch.optim.Adam), written out with
torch's own parametrize."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system.errors import ConfigError
from gpt2lab.train import memplan, plan_text
from gpt2lab.train.optim import build_optimizer, param_groups, parts
from gpt2lab.train.schedule import set_lrs
from gpt2lab.train.settings import load_preset
from gpt2lab.train.token_features import FeatureShare, feature_index, token_features

CPU = torch.device("cpu")
WORDS = [
    " the",
    "The",
    " The",
    "the",
    " running",
    " jumping",
    "Running",
    " cat",
    " Cat",
    "cat",
    ",",
    ".",
    " 1999",
    "1999",
    " ",
    "  ",
    " walking",
    "talking",
    "ing",
    " HTML",
    "HTML",
    "!?",
    "ab1",
]


class Words:
    """A tokenizer of the few texts above (then single letters), as a run's own would decode them."""

    def __init__(self, n: int) -> None:
        self.texts = WORDS + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(n - len(WORDS))]
        self.n_vocab = n

    def decode_single_token_bytes(self, t: int) -> bytes:
        return self.texts[t].encode()


def test_token_features_by_hand():
    assert token_features(" The") == ["shape:1Ca3", "word:the"]
    assert token_features("the") == ["shape:0la3", "word:the"]
    assert token_features(" running") == ["shape:1la7", "word:running", "end3:ing", "end2:ng"]
    assert token_features("HTML") == ["shape:0Ua4", "word:html", "end3:tml", "end2:ml"]
    assert token_features(" 1999") == ["shape:1-d4", "word:1999"]
    assert token_features(",") == ["shape:0-p1", "word:,"]
    assert token_features("  ") == ["shape:1-w0"]
    assert token_features("ab1") == ["shape:0-m3", "word:ab1"]
    assert token_features(" internationalisation")[0] == "shape:1la8"  # lengths stop at 8


def test_index_keeps_the_features_two_or_more_tokens_share():
    tok = Words(120)  # merge-order blocks of ceil(120 / 50) = 3 ids
    index, weight, n = feature_index(tok, 128)  # 8 padding rows past the tokenizer
    feats = [token_features(t) + [f"rank:{i // 3}"] for i, t in enumerate(tok.texts)]
    names = sorted({f for fs in feats for f in fs})
    shared = [f for f in names if sum(f in fs for fs in feats) >= 2]
    assert n == len(shared)
    assert {"word:the", "end3:ing", "word:html", "rank:0", "rank:39"} <= set(shared)
    assert "word:," not in shared  # only "," has it
    for t in range(128):
        mine = [shared.index(f) for f in feats[t] if f in shared] if t < 120 else []
        k = len(mine)
        assert sorted(index[t, :k].tolist()) == sorted(mine)
        assert (weight[t, :k] == 1).all()
        assert (weight[t, k:] == 0).all()
    assert index.size(1) == 5  # " running": shape, word, end3, end2, rank
    assert (weight[120:] == 0).all() and (weight[:120, 0] > 0).all()  # padding has none; every token its rank


def _model(tie: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=48, tie_embeddings=tie))


class _Shared(nn.Module):
    """The reference: W = W0 + F V, F dense from the index."""

    def __init__(self, f: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("f", f)
        self.v = nn.Parameter(torch.zeros(f.size(1), 16, dtype=torch.float64))

    def forward(self, w0: torch.Tensor) -> torch.Tensor:
        return w0 + self.f @ self.v


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_steps_equal_the_table_plus_features_trained_by_adam(tie):
    """Three AdamW steps with the share against a float64 copy whose tables are parametrised as W0 + F V,
    W0 stepped by AdamW and V by torch.optim.Adam at the same rate (no weight decay: AdamW would decay
    W0 alone there, all of W here)."""
    tok = Words(40)
    opt_cfg = load_preset("wiki-cpu", weight_decay=0.0, token_features=True, beta1=0.5, beta2=0.9, warmup_steps=0).optim
    ours = _model(tie)
    ref = copy.deepcopy(ours).double()
    optimizer = build_optimizer(ours, opt_cfg, CPU, tokenizer=tok)
    share = optimizer.named["token_features"]
    assert isinstance(share, FeatureShare) and len(share.param_groups) == (1 if tie else 2)
    index, weight, n = feature_index(tok, 48)
    f = torch.zeros(48, n, dtype=torch.float64)
    f.scatter_add_(1, index, weight.double())
    shared = _Shared(f)  # a tied head reads the embedding's W0 + F V: the same module on both
    parametrize.register_parametrization(ref.transformer.wte, "weight", shared)
    parametrize.register_parametrization(ref.lm_head, "weight", shared if tie else _Shared(f))
    feature_params = list(
        {
            id(m.parametrizations.weight[0].v): m.parametrizations.weight[0].v
            for m in (ref.transformer.wte, ref.lm_head)
        }.values()
    )
    rest = [p for p in ref.parameters() if all(p is not q for q in feature_params)]
    lr = opt_cfg.max_lr
    ref_adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.0},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.5, 0.9),
        eps=opt_cfg.eps,
    )
    ref_adam = torch.optim.Adam(feature_params, lr=lr, betas=(0.5, 0.9), eps=opt_cfg.eps)
    torch.manual_seed(1)
    for step in range(3):
        idx = torch.randint(0, 40, (2, 12))
        ours.train()(idx, idx)[1].backward()
        ref.train()(idx, idx)[1].backward()
        set_lrs(optimizer, 0, opt_cfg)
        optimizer.step()
        optimizer.zero_grad()
        for o in (ref_adamw, ref_adam):
            for g in o.param_groups:
                g["lr"] = optimizer.param_groups[0]["lr"]
            o.step()
            o.zero_grad()
    assert all(p.abs().max() > 1e-3 for p in feature_params)  # the features moved
    for name, p in ours.named_parameters():
        want = dict(ref.named_parameters()).get(name)
        if want is None:  # a parametrised table: compare the summed rows
            want = ref.get_submodule(name.rsplit(".", 1)[0]).weight
        torch.testing.assert_close(p.detach().double(), want.detach(), rtol=1e-4, atol=2e-5)  # 1% of a step
    # and the features are what moved the rows apart from plain AdamW
    plain = _model(tie)
    plain_opt = build_optimizer(
        plain, load_preset("wiki-cpu", weight_decay=0.0, beta1=0.5, beta2=0.9, warmup_steps=0).optim, CPU
    )
    torch.manual_seed(1)
    for step in range(3):
        idx = torch.randint(0, 40, (2, 12))
        plain.train()(idx, idx)[1].backward()
        set_lrs(plain_opt, 0, opt_cfg)
        plain_opt.step()
        plain_opt.zero_grad()
    gap = (plain.transformer.wte.weight - ours.transformer.wte.weight).abs().max()
    assert gap > 1e-3


def test_a_skipped_step_leaves_tables_and_state_as_they_were():
    tok = Words(40)
    opt_cfg = load_preset("wiki-cpu", token_features=True).optim
    m = _model(False)
    optimizer = build_optimizer(m, opt_cfg, CPU, tokenizer=tok)
    share = optimizer.named["token_features"]
    idx = torch.randint(0, 40, (2, 12))
    m(idx, idx)[1].backward()
    share.step()
    before = [p.detach().clone() for p in m.parameters()], copy.deepcopy(share.state_dict())
    m(idx, idx)[1].backward()
    share.step(skip=torch.ones((), dtype=torch.float64))  # the device's verdict
    share.step(skip=True)  # the host's
    m.lm_head.weight.grad[3, 2] = float("inf")  # fp16's scaler skipping: not finite
    share.step()
    assert all(torch.equal(a, b) for a, b in zip(before[0], m.parameters()))
    after = share.state_dict()["state"]
    for key, state in before[1]["state"].items():
        assert all(torch.equal(state[k], after[key][k]) for k in state)


def test_state_round_trips_and_resumes_bit_for_bit():
    tok = Words(40)
    cfg = load_preset("wiki-cpu-long-fast", token_features=True).optim
    a = _model(False)
    b = copy.deepcopy(a)
    opt_a = build_optimizer(a, cfg, CPU, tokenizer=tok)
    idx = torch.randint(0, 40, (2, 12))
    for _ in range(2):
        a.train()(idx, idx)[1].backward()
        opt_a.step()
        opt_a.zero_grad()
    state = copy.deepcopy(opt_a.state_dict())
    assert sorted(state) == ["adamw", "muon", "token_features"]
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, cfg, CPU, tokenizer=tok)
    opt_b.load_state_dict(state)
    for m, o in ((a, opt_a), (b, opt_b)):
        m.train()(idx, idx)[1].backward()
        o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_the_plan_counts_the_state_it_keeps():
    tok = Words(40)
    cfg = load_preset("wiki-cpu", token_features=True).optim
    for tie in (False, True):
        m = _model(tie)
        optimizer = build_optimizer(m, cfg, CPU, tokenizer=tok)
        idx = torch.randint(0, 40, (2, 12))
        m(idx, idx)[1].backward()
        optimizer.step()
        kept = sum(
            t.numel() * t.element_size() for t in parts(optimizer)[-1].state[m.lm_head.weight].values() if t.dim() > 0
        ) * (1 if tie else 2)
        assert kept == memplan.feature_state_bytes(m.config, feature_index(tok, 48)[2])


def test_refused_where_no_table_trains_or_tables_are_frozen():
    m = _model(False)
    for p in m.parameters():
        p.requires_grad_(False)
    m.transformer.h[0].attn.c_attn.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match="--token-features: the model trains no token embedding"):
        build_optimizer(m, load_preset("wiki-cpu", token_features=True).optim, CPU, tokenizer=Words(40))


def test_param_groups_unchanged_without_the_flag():
    m = _model(False)
    plain = build_optimizer(m, load_preset("wiki-cpu").optim, CPU)
    assert isinstance(plain, torch.optim.AdamW)
    assert [len(g["params"]) for g in plain.param_groups] == [len(g["params"]) for g in param_groups(m, 0.1)]


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"parallel": {"strategy": "fsdp"}}, "--token-features with --strategy fsdp: .* use --strategy ddp"),
        ({"finetune": {"lora_rank": 4}}, "--token-features with --lora-rank: .* use full fine-tuning"),
    ],
)
def test_settings_the_share_cannot_join_are_refused_in_one_line(fields, needle):
    from gpt2lab.train.config import TrainConfig

    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_dict({"optim": {"token_features": True}, **fields})


def test_a_run_plans_the_state_it_keeps(tiny_data, tmp_path):
    from conftest import TINY

    from gpt2lab.distributed.dist import DistInfo
    from gpt2lab.system import runtime
    from gpt2lab.train.gather import MachineFacts
    from gpt2lab.train.plan import make_plan
    from gpt2lab.train.plan_text import checkpoint_bytes
    from gpt2lab.train.trainer import Trainer

    fields = {**TINY, "data": tiny_data, "out": str(tmp_path), "max_steps": 2, "tie_embeddings": False}
    cfg = load_preset("shakespeare-cpu", **fields, token_features=True)
    t = Trainer(make_plan(cfg, MachineFacts(runtime.Facts("cpu"))), DistInfo(device=CPU))
    t.train_step()
    share = t.optimizer.named["token_features"]
    kept = sum(x.numel() * x.element_size() for s in share.state.values() for x in s.values() if x.dim() > 0)
    assert kept == memplan.feature_state_bytes(t.raw.config, share.n_features) > 0
    step = 2 * 4 * share.n_features * t.raw.config.n_embd  # a step's feature gradient and update
    assert t.plan.memory["token_features"] == round((kept + step) / 2**20, 1)
    plain = load_preset("shakespeare-cpu", **fields)
    assert checkpoint_bytes(cfg)["optimizer"] - checkpoint_bytes(plain)["optimizer"] == kept
    assert any("token features shared by the token tables" in line for line in plan_text.lines(t.plan))


def test_under_fp16s_grad_scaler_the_share_steps_once_on_unscaled_gradients():
    """The scaler's path (a loss scaled by 2^10, unscaled, stepped) against the plain one: the same
    weights to the bit (a power-of-two scale is exact), so the share's tables were unscaled once
    and stepped once; an inf gradient then makes the guard skip the step and the scaler back off."""
    from gpt2lab.train.config import TrainConfig
    from gpt2lab.train.optim import unscale
    from gpt2lab.train.spikes import SpikeGuard

    tok = Words(40)
    cfg = load_preset("wiki-cpu", token_features=True, warmup_steps=0, grad_clip=0.0).optim
    a = _model(False)
    b = copy.deepcopy(a)
    opt_a, opt_b = (build_optimizer(m, cfg, CPU, tokenizer=tok) for m in (a, b))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    idx = torch.randint(0, 40, (2, 12))
    for step in range(2):
        a(idx, idx)[1].backward()
        set_lrs(opt_a, step, cfg)
        opt_a.step()
        opt_a.zero_grad()
        scaler.scale(b(idx, idx)[1]).backward()
        unscale(opt_b, scaler)  # as Trainer.train_step: unscaled, stepped, the scale updated
        set_lrs(opt_b, step, cfg)
        opt_b.step()
        scaler.update()
        opt_b.zero_grad()
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    loss = scaler.scale(b(idx, idx)[1])
    loss.backward()
    b.lm_head.weight.grad[0, 0] = float("inf")
    unscale(opt_b, scaler)
    norm = torch.nn.utils.clip_grad_norm_(b.parameters(), float("inf"))
    guard = SpikeGuard(TrainConfig().with_values(spike_window=0, spike_loss_z=6.0, spike_norm_z=20.0, spike_rollback=3))
    assert guard.judge(loss, norm)[2] == 1  # the step is skipped
    scaler.update()
    assert scaler.get_scale() < 2.0**10  # the scaler saw the inf and backed off

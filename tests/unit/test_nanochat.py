"""Models without biases (``bias``), with a normalised embedding (``embed_norm``), and the Hugging Face
NanoChat format both ways. References: transformers' own NanoChatForCausalLM and GPT2LMHeadModel (each
export loaded by AutoModelForCausalLM, a NanoChat made and saved by transformers itself), formulas
written out here, what autograd keeps, and the optimizer's groups counted by hand."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from conftest import TINY, saved_bytes

from gpt2lab import cli, from_pretrained
from gpt2lab.data.tokenizer import gpt2_tokenizer
from gpt2lab.model.gpt import GPT, GPTConfig, rotary_cos_sin
from gpt2lab.system.errors import UsageError
from gpt2lab.train.settings import load_preset, preset_names
from gpt2lab.weights import export, load, nanochat, targets
from gpt2lab.weights.load import HF_DIR, load_model, source_kind

# The modern block NanoChat computes: gpt2lab's switches with no biases and a normalised embedding.
NANOCHAT = dict(
    pos_emb="rotary", norm="rmsnorm", qk_norm=True, mlp_act="relu2", tie_embeddings=False, bias=False, embed_norm=True
)
SMALL = dict(n_layer=2, n_head=4, n_embd=64, block_size=48, vocab_size=50304, token_vocab_size=50257)
PROMPT = torch.tensor([[464, 3290, 318, 257, 1332]])


@pytest.fixture(autouse=True)
def _no_probe(monkeypatch):
    monkeypatch.setenv("GPT2LAB_PROBE", "0")  # generate()'s inference copy by the device's rule, nothing timed


def randomized(cfg: GPTConfig, seed: int = 0) -> GPT:
    """A GPT whose every parameter is random and away from its init: gains in [0.5, 1.5] (so folding them
    shows), biases nonzero, zero-initialised projections filled, matrices at 0.05 (logits of order 1)."""
    torch.manual_seed(seed)
    m = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.05)
    return m


def _hf(path: str):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # no trust_remote_code


def _logits_diff(ours: GPT, theirs, idx: torch.Tensor) -> float:
    with torch.no_grad():
        a = ours(idx)[0][..., : ours.config.real_vocab_size]
        b = theirs(idx).logits
    assert a.shape == b.shape and a.abs().max() > 1.0  # logits large enough for a difference to show
    return (a - b).abs().max().item()


def _greedy_hf(theirs, n: int = 20) -> list[int]:
    out = theirs.generate(PROMPT, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0].tolist()


# -- the two switches ---------------------------------------------------------------------------
def test_defaults_keep_every_bias_and_no_embed_norm():
    cfg = GPTConfig()
    assert cfg.bias is True and cfg.embed_norm is False and cfg.modern() == {}
    assert GPTConfig(bias=False, embed_norm=True).modern() == {"bias": False, "embed_norm": True}
    from gpt2lab.train.init_from import ARCH_FIELDS

    assert {"bias", "embed_norm"} <= set(ARCH_FIELDS)  # --init-from takes them from the source
    gpt2 = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64, block_size=8))
    names = {n for n, _ in gpt2.named_parameters()}
    assert {
        "transformer.h.0.ln_1.bias",
        "transformer.h.0.attn.c_attn.bias",
        "transformer.h.0.mlp.c_proj.bias",
        "transformer.ln_f.bias",
    } <= names


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_bias_false_is_gpt2_with_zero_biases(norm, tmp_path):
    """No bias anywhere (LayerNorm's too); the logits are those of the biased model with its biases zeroed,
    and a GPT-2 without biases exports as GPT2LMHeadModel with zeros there, transformers' logits equal."""
    shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=96, norm=norm)
    plain = randomized(GPTConfig(**shape, bias=False), seed=1)
    assert not [n for n, _ in plain.named_parameters() if n.endswith(".bias")]
    biased = GPT(GPTConfig(**shape)).eval()
    with torch.no_grad():
        for name, p in biased.named_parameters():
            p.copy_(plain.state_dict()[name] if name in plain.state_dict() else torch.zeros_like(p))
    idx = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert torch.equal(plain(idx)[0], biased(idx)[0])
    assert plain.num_params() == biased.num_params() - 2 * (9 * 32 + (2 * 32 if norm == "layernorm" else 0)) - (
        32 if norm == "layernorm" else 0
    )
    if norm == "layernorm":
        big = randomized(GPTConfig(**{**shape, "vocab_size": 50304, "token_vocab_size": 50257}, bias=False), seed=1)
        assert export.save_pretrained(big, str(tmp_path / "hf")) == "GPT2LMHeadModel"
        theirs = _hf(str(tmp_path / "hf"))
        assert theirs.transformer.h[0].attn.c_attn.bias.abs().max() == 0 == theirs.transformer.ln_f.bias.abs().max()
        assert _logits_diff(big, theirs, torch.randint(0, 50257, (2, 16))) <= 1e-4


@pytest.mark.parametrize("pos_emb", ["learned", "rotary"])
def test_embed_norm_is_the_written_out_rms_of_the_stream_start(pos_emb):
    m = randomized(
        GPTConfig(
            n_layer=2,
            n_head=2,
            n_embd=32,
            block_size=16,
            vocab_size=96,
            pos_emb=pos_emb,
            embed_norm=True,
            layer_norm_epsilon=1e-3,
        ),
        seed=2,
    )
    idx = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        x = m.transformer.wte(idx) + (m.transformer.wpe(torch.arange(10)) if pos_emb == "learned" else 0)
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-3)  # no gain
        rope = rotary_cos_sin(m.config, torch.arange(10)) if pos_emb == "rotary" else None
        for block in m.transformer.h:
            x = block(x, None, rope)
        want = m.lm_head(m.transformer.ln_f(x))
        torch.testing.assert_close(m(idx)[0], want, rtol=1e-5, atol=1e-5)
        off = GPT(replace(m.config, embed_norm=False)).eval()
        off.load_state_dict(m.state_dict())
        assert (off(idx)[0] - want).abs().max() > 1e-2  # the switch changes the model


def test_optimizers_without_biases():
    """Muon gets exactly the blocks' four matrices each, AdamW the rest: with no biases its no-decay group
    holds the gains only (two per block and ln_f), and a step of each optimizer runs."""
    from gpt2lab.train.optim import build_optimizer, muon_split, param_groups

    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=96, **NANOCHAT)
    m = GPT(cfg)
    names = {id(p): n for n, p in m.named_parameters()}
    split = {role: sorted(names[id(p)] for p in ps) for role, ps in muon_split(m).items()}
    assert len(split["hidden"]) == 4 * 3 and split["embed"] == ["transformer.wte.weight"]
    assert split["head"] == ["lm_head.weight"] and len(split["other"]) == 2 * 3 + 1
    assert all(n.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) for n in split["other"])
    decay, no_decay = param_groups(m, 0.1)
    assert len(no_decay["params"]) == 7 and all(p.dim() == 1 for p in no_decay["params"])
    for optimizer in ("adamw", "muon"):
        opt = build_optimizer(
            m, replace(load_preset("shakespeare-cpu-fast").optim, optimizer=optimizer), torch.device("cpu")
        )
        before = [p.detach().clone() for p in m.parameters()]
        idx = torch.randint(0, 96, (2, 16))
        m(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
        assert all(not torch.equal(a, p) for a, p in zip(before, m.parameters()))


# -- what the switches keep for backward ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "block", [{}, dict(pos_emb="rotary", qk_norm=True, norm="rmsnorm", mlp_act="relu2")], ids=["gpt2", "modern"]
)
def test_what_autograd_keeps_for_the_switches(block, dtype):
    """A whole training forward (chunked loss included): without biases autograd keeps exactly what it keeps
    with them; embed_norm keeps the embedding and its rstd (fp32, N (C + 1) x 4 bytes)."""
    B, T, C = 3, 10, 48
    base = dict(n_layer=2, n_head=4, n_embd=C, vocab_size=64, block_size=T, **block)
    idx = torch.randint(0, 64, (B, T))
    kept = {}
    for name, extra in (("base", {}), ("no_bias", dict(bias=False)), ("embed_norm", dict(bias=False, embed_norm=True))):
        torch.manual_seed(0)
        m = GPT(GPTConfig(**base, **extra))

        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                m(idx, idx, return_logits=False)

        kept[name] = saved_bytes(m, forward)
    assert kept["no_bias"] == kept["base"]
    assert kept["embed_norm"] - kept["no_bias"] == B * T * (C + 1) * 4


# -- export: every preset whose model a Hugging Face class computes --------------------------------
def _preset_model(name: str) -> GPTConfig:
    """The preset's architecture, every switch kept; the big ones shrunk to 2 layers x 64 wide (4 heads) and
    a block of 64, so that the test runs in seconds. The vocabulary stays the preset's (50304 padded)."""
    m = load_preset(name).model
    if m.n_embd > 192 or m.n_layer > 4:
        m = replace(m, n_layer=2, n_embd=64, n_head=4, block_size=min(m.block_size, 64))
    return replace(m, token_vocab_size=m.token_vocab_size or min(m.vocab_size, 50257))


EXPORTABLE = [n for n in preset_names() if targets.export_target(load_preset(n).model).name]


def test_the_presets_that_export():
    """The default demo's preset, the faithful ones and the flagship modern ones export; those with value
    embeddings (the record presets) do not, and say why."""
    assert {"shakespeare-cpu", "shakespeare-cpu-fast", "gpt2-124m", "wiki-cpu"} <= set(EXPORTABLE)
    assert {"wiki-cpu-long-fast", "gpt2-124m-fast"} <= set(EXPORTABLE)
    assert not {"wiki-cpu-long-record", "gpt2-124m-record"} & set(EXPORTABLE)
    for name in set(preset_names()) - set(EXPORTABLE):
        target = targets.export_target(load_preset(name).model)
        assert load_preset(name).model.value_embeds and "value_embeds=1" in target.describe(), name


@pytest.mark.parametrize("name", EXPORTABLE)
def test_preset_exports_and_transformers_computes_the_same(name, tmp_path):
    model = randomized(_preset_model(name), seed=3)
    target = export.save_pretrained(model, str(tmp_path / "hf"))
    assert target == targets.export_target(model.config).name
    theirs = _hf(str(tmp_path / "hf"))
    assert type(theirs).__name__ == target
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    assert _logits_diff(model, theirs, idx) <= 1e-4
    from gpt2lab.model.sampling import generate

    assert generate(model, PROMPT, 20, temperature=0)[0].tolist() == _greedy_hf(theirs)


def test_nanochat_export_files(tmp_path):
    import transformers

    m = randomized(GPTConfig(**SMALL, **NANOCHAT, logit_softcap=12.0, rope_theta=500.0))
    assert export.save_pretrained(m, str(tmp_path / "hf")) == "NanoChatForCausalLM"
    d = tmp_path / "hf"
    assert sorted(os.listdir(d)) == sorted(export.EXPORT_FILES)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["model_type"], cfg["vocab_size"], cfg["intermediate_size"], cfg["tie_word_embeddings"]) == (
        "nanochat",
        50257,
        256,
        False,
    )
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0}
    assert cfg["final_logit_softcapping"] == 12.0
    # the pad (the embedding's padding_idx, a row fine-tuning leaves alone): the byte 0xFF's token, in no text
    assert gpt2_tokenizer().decode_single_token_bytes(cfg["pad_token_id"]) == b"\xff"
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    assert tok("Hello, I'm a language model,")["input_ids"] == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    theirs = _hf(str(d))
    assert theirs.model.embed_tokens.weight.shape == (50257, 64) and theirs.lm_head.weight.shape == (50257, 64)
    assert _logits_diff(m, theirs, torch.randint(0, 50257, (2, 48))) <= 1e-4


@pytest.mark.parametrize(
    "variant",
    [dict(tie_embeddings=True), dict(mlp_act="gelu"), dict(logit_softcap=3.0)],
    ids=["tied", "gelu", "softcap"],
)
def test_nanochat_export_variants(variant, tmp_path):
    """A tied head (exported untied: ln_f's gain folds into the head, not into wte), tanh GELU, a softcap."""
    m = randomized(GPTConfig(**{**SMALL, **NANOCHAT, **variant}), seed=4)
    export.save_pretrained(m, str(tmp_path / "hf"))
    theirs = _hf(str(tmp_path / "hf"))
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)
    assert _logits_diff(m, theirs, torch.randint(0, 50257, (2, 48))) <= 1e-4


def test_rotary_direction_needs_the_flipped_halves(tmp_path, monkeypatch):
    """Without negating the second half of each head's q and k rows, transformers' NanoChat (which turns
    the other way) computes other logits: the flip is what makes them equal."""
    m = randomized(GPTConfig(**SMALL, **NANOCHAT), seed=5)
    monkeypatch.setattr(nanochat, "flip_halves", lambda w, n_head: w.clone())
    export.save_pretrained(m, str(tmp_path / "hf"))
    assert _logits_diff(m, _hf(str(tmp_path / "hf")), torch.randint(0, 50257, (2, 48))) > 1e-2


# -- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(value_embeds=1), "value_embeds=1 (GPT-2 and NanoChat: no value embeddings)"),
        (dict(unet_skips=True, bias=False, embed_norm=True), "unet_skips=true (GPT-2 and NanoChat: no skips"),
        (dict(bias=True), "NanoChatForCausalLM would need bias=false (no biases)"),
        (dict(norm="layernorm"), "NanoChatForCausalLM would need norm=rmsnorm (RMSNorm only)"),
        (
            dict(pos_emb="learned", norm="layernorm", qk_norm=False, mlp_act="gelu", bias=True, embed_norm=True),
            "GPT2LMHeadModel would need embed_norm=false (no norm of the embeddings)",
        ),
    ],
)
def test_what_neither_computes_is_refused_in_one_line(fields, needle, tmp_path):
    cfg = GPTConfig(**{**SMALL, **NANOCHAT, **fields})
    with pytest.raises(UsageError) as e:
        export.save_pretrained(GPT(cfg), str(tmp_path / "hf"))
    assert needle in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "hf").exists()
    assert targets.export_target(cfg).describe().startswith("none (")


# -- NanoChat directories in ----------------------------------------------------------------------
def _transformers_nanochat(tmp_path, seed: int = 0, **overrides):
    """A NanoChatForCausalLM made and randomly initialised by transformers, saved by its save_pretrained."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = {
        **dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=40,
        ),
        **overrides,
    }
    torch.manual_seed(seed)
    theirs = transformers.NanoChatForCausalLM(transformers.NanoChatConfig(**cfg)).eval()
    with torch.no_grad():  # HF's init leaves small logits; larger weights make any difference show
        for p in theirs.parameters():
            p.normal_(0.0, 0.08)
    d = str(tmp_path / f"nanochat{seed}")
    theirs.save_pretrained(d)
    return theirs, d


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(tie_word_embeddings=True, final_logit_softcapping=None),
        dict(
            hidden_act="gelu_pytorch_tanh",
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0},
        ),
    ],
    ids=["defaults", "tied-no-cap", "gelu-eps-theta"],
)
def test_a_nanochat_saved_by_transformers_loads_with_its_logits(overrides, tmp_path):
    theirs, d = _transformers_nanochat(tmp_path, **overrides)
    assert source_kind(d) == HF_DIR
    for ours in (load_model(d), from_pretrained(d)):
        assert ours.config.bias is False and ours.config.embed_norm and ours.config.pos_emb == "rotary"
        assert ours.config.tie_embeddings == bool(overrides.get("tie_word_embeddings", False))
        assert _logits_diff(ours, theirs, torch.randint(0, 300, (2, 40))) <= 1e-4
        # the cache path too: greedy decoding from a prompt, token by token
        with torch.no_grad():
            want = theirs.generate(
                torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        from gpt2lab.model.sampling import generate

        assert torch.equal(generate(ours, torch.tensor([[5, 6, 7]]), 12, temperature=0), want)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads=2"),
        (dict(intermediate_size=192), "intermediate_size=192"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(hidden_act="silu"), "hidden_act='silu'"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "rope_parameters="),
    ],
)
def test_a_nanochat_gpt2lab_cannot_compute_is_refused_by_field(overrides, needle, tmp_path, capsys):
    _, d = _transformers_nanochat(tmp_path, **overrides)
    with pytest.raises(load.WeightsError) as e:
        load_model(d)
    assert needle in str(e.value) and "config.json" in str(e.value) and "\n" not in str(e.value)
    capsys.readouterr()  # transformers' progress bars from saving
    assert cli.main(["sample", "--model", d, "--prompt", "x", "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_round_trip_export_then_model_from_pretrained_and_init_from(tiny_data, tmp_path):  # noqa: F811
    """export -> --model, gpt2lab.from_pretrained and --init-from: the exported model's logits each time."""
    from gpt2lab.distributed.dist import DistInfo
    from gpt2lab.train.gather import detect_machine
    from gpt2lab.train.plan import Request, make_plan
    from gpt2lab.train.trainer import Trainer

    m = randomized(GPTConfig(**{**SMALL, "block_size": 32}, **NANOCHAT), seed=6)
    d = str(tmp_path / "hf")
    export.save_pretrained(m, d)
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        want = m(idx)[0][..., :50257]
    cfg = load_preset("shakespeare-cpu", **{**TINY, "data": tiny_data, "out": str(tmp_path / "run"), "init_from": d})
    cpu = torch.device("cpu")
    plan = make_plan(Request(cfg.to_dict()), detect_machine(cpu, 1, "float32"))  # the preset's architecture gives way
    assert {k: getattr(plan.config.model, k) for k in NANOCHAT} == NANOCHAT
    trainer = Trainer(plan, DistInfo(device=cpu))
    for got in (load_model(d), from_pretrained(d), trainer.raw.eval()):
        with torch.no_grad():
            torch.testing.assert_close(got(idx)[0][..., :50257], want, rtol=1e-4, atol=1e-4)

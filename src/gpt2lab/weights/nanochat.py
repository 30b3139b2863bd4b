"""Hugging Face NanoChat (transformers' ``NanoChatForCausalLM``, model_type "nanochat") <-> gpt2lab.

NanoChat computes gpt2lab's modern block with ``bias`` false and ``embed_norm`` true: rotary
positions, RMSNorm, QK-norm, relu^2 (or tanh GELU), an untied head, an optional logit softcap. Its
norms have no gain, and it rotates the other way. Both are a change of weights, not of what is
computed:

- a gain g before a matrix W is W diag(g): ln_1's folds into the columns of q, k and v, ln_2's into
  fc1's, ln_f's into the head's (so a tied head is exported untied: wte stays unscaled);
- NanoChat's rotate_half is cat(x2, -x1), gpt2lab's cat(-x2, x1): a turn by minus the angle. With the
  second half of every head's q and k rows negated, NanoChat's rotated q and k are gpt2lab's with
  that half negated, so every score q.k is the same (and the RMS norm does not see signs);
- NanoChat normalises q and k after the rotation, gpt2lab before: a rotation keeps the RMS.

Loading gives gains of one. What gpt2lab does not compute (GQA, another MLP width, attention
biases, another RoPE type) is refused by field. Pure mapping: no I/O; errors are ValueErrors that
weights/read.py turns into one line naming the file.
"""

from __future__ import annotations

import torch

from gpt2lab.data.tokenizer import Tokenizer
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.weights import gpt2
from gpt2lab.weights.targets import NANOCHAT_HF

# transformers' NanoChatConfig defaults: its save_pretrained leaves out every value equal to one.
HF_DEFAULTS = {
    "vocab_size": 50304,
    "hidden_size": 768,
    "intermediate_size": 8192,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "max_position_embeddings": 2048,
    "hidden_act": "relu2",
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 15.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
ACTS = {"relu2": "relu2", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}  # hidden_act -> mlp_act
LAYER = "model.layers.{}."


def flip_halves(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``w`` (n_head * head_size, C) with the second half of every head's rows negated (its own inverse)."""
    w = w.reshape(n_head, 2, -1, w.size(-1)).clone()
    w[:, 1].neg_()
    return w.reshape(-1, w.size(-1))


# ---------------------------------------------------------------- export


def config_to_nanochat(config: GPTConfig, dtype: torch.dtype, tok: Tokenizer) -> dict:
    """The config.json transformers' NanoChatForCausalLM reads (``tok``: the model's tokenizer, for its
    special ids); vocab is the real (unpadded) one."""
    vocab = config.real_vocab_size
    eot, end = gpt2.special_ids(config, tok)
    return {
        "architectures": [NANOCHAT_HF.architecture],
        "model_type": NANOCHAT_HF.model_type,
        "vocab_size": vocab,
        "hidden_size": config.n_embd,
        "intermediate_size": 4 * config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_head,
        "max_position_embeddings": config.block_size,
        "hidden_act": "relu2" if config.mlp_act == "relu2" else "gelu_pytorch_tanh",
        "attention_dropout": config.attn_pdrop,
        "rms_norm_eps": config.layer_norm_epsilon,
        "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "final_logit_softcapping": config.logit_softcap or None,
        "attention_bias": False,
        "bos_token_id": eot,
        "eos_token_id": end,
        # the embedding's padding_idx (a row fine-tuning leaves alone: never <|endoftext|>) and generate's pad
        "pad_token_id": gpt2.pad_id(config, tok),
        "tie_word_embeddings": False,  # ln_f's gain is folded into the head, so it is never wte
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    }


def to_nanochat_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """gpt2lab model (one NanoChat computes: NANOCHAT_HF.needs) -> NanoChatForCausalLM tensors, padded
    vocab rows dropped."""
    c, V = model.config, model.config.real_vocab_size
    sd = {k: t.detach().cpu() for k, t in model.state_dict().items()}
    C, out = c.n_embd, {"model.embed_tokens.weight": sd["transformer.wte.weight"][:V]}
    for i in range(c.n_layer):
        h, o = f"transformer.h.{i}.", LAYER.format(i)
        q, k, v = (sd[h + "attn.c_attn.weight"] * sd[h + "ln_1.weight"]).split(C)
        out[o + "self_attn.q_proj.weight"] = flip_halves(q, c.n_head)
        out[o + "self_attn.k_proj.weight"] = flip_halves(k, c.n_head)
        out[o + "self_attn.v_proj.weight"] = v
        out[o + "self_attn.o_proj.weight"] = sd[h + "attn.c_proj.weight"]
        out[o + "mlp.fc1.weight"] = sd[h + "mlp.c_fc.weight"] * sd[h + "ln_2.weight"]
        out[o + "mlp.fc2.weight"] = sd[h + "mlp.c_proj.weight"]
    out["lm_head.weight"] = sd["lm_head.weight"][:V] * sd["transformer.ln_f.weight"]
    return {k: t.contiguous().clone() for k, t in out.items()}


# ---------------------------------------------------------------- loading


def config_from_nanochat(cfg: dict) -> GPTConfig:
    """GPTConfig for a NanoChat config.json; a ValueError naming the first field gpt2lab cannot compute."""
    get = lambda name: cfg.get(name, HF_DEFAULTS.get(name))  # noqa: E731
    C, heads = get("hidden_size"), get("num_attention_heads")
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    checks = (
        (
            "num_key_value_heads",
            cfg.get("num_key_value_heads") in (None, heads),
            f"gpt2lab has one key/value head per query head ({heads}), not grouped-query attention",
        ),
        ("intermediate_size", get("intermediate_size") == 4 * C, f"gpt2lab's MLP is 4 x hidden_size = {4 * C} wide"),
        ("attention_bias", get("attention_bias") is False, "gpt2lab's NanoChat block has no attention biases"),
        ("hidden_act", get("hidden_act") in ACTS, f"gpt2lab has {', '.join(ACTS)}"),
        ("rope_parameters", rope.get("rope_type", "default") == "default", "gpt2lab has the default RoPE only"),
        ("rope_scaling", cfg.get("rope_scaling") is None, "gpt2lab has the default RoPE only"),
        (
            "head_dim",
            cfg.get("head_dim") in (None, C // heads),
            f"gpt2lab's head size is hidden_size / heads = {C // heads}",
        ),
    )
    for name, ok, why in checks:
        if not ok:
            value = rope if name == "rope_parameters" else cfg.get(name, HF_DEFAULTS.get(name))
            raise ValueError(f"{name}={value!r} is not supported by gpt2lab ({why})")
    return GPTConfig(
        n_layer=get("num_hidden_layers"),
        n_head=heads,
        n_embd=C,
        block_size=get("max_position_embeddings"),
        vocab_size=get("vocab_size"),
        layer_norm_epsilon=get("rms_norm_eps"),
        attn_pdrop=get("attention_dropout"),
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        pos_emb="rotary",
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm="rmsnorm",
        qk_norm=True,
        mlp_act=ACTS[get("hidden_act")],
        bias=False,
        embed_norm=True,
        tie_embeddings=bool(get("tie_word_embeddings")),
        logit_softcap=float(get("final_logit_softcapping") or 0.0),
    )


def from_nanochat_state_dict(sd: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """NanoChatForCausalLM tensors -> gpt2lab names (every norm's gain one; a tied head left out).

    A tensor this does not place is kept under its own name, so read.model_from_state_dict names it as unexpected.
    """
    sd = dict(sd)
    wte = sd.pop("model.embed_tokens.weight", None)
    out: dict[str, torch.Tensor] = {} if wte is None else {"transformer.wte.weight": wte}
    ones = torch.ones(config.n_embd, dtype=wte.dtype if wte is not None else torch.float32)
    for i in range(config.n_layer):
        h, o = f"transformer.h.{i}.", LAYER.format(i)
        names = [o + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if all(n in sd for n in names):
            q, k, v = (sd.pop(n) for n in names)
            out[h + "attn.c_attn.weight"] = torch.cat((flip_halves(q, config.n_head), flip_halves(k, config.n_head), v))
        for mine, theirs in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            if o + theirs + ".weight" in sd:
                out[h + mine + ".weight"] = sd.pop(o + theirs + ".weight")
        out[h + "ln_1.weight"], out[h + "ln_2.weight"] = ones.clone(), ones.clone()
    out["transformer.ln_f.weight"] = ones.clone()
    head = sd.pop("lm_head.weight", None)
    if head is not None and not config.tie_embeddings:
        out["lm_head.weight"] = head
    return {**out, **sd}

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
weights/load.py turns into one line naming the file.
"""

from __future__ import annotations

import torch

from gpt2lab.data.tokenizer import Tokenizer
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.weights import gpt2
from gpt2lab.weights.targets import NANOCHAT_HF

# config.json key -> (GPTConfig field, transformers' NanoChatConfig default: its save_pretrained leaves out
# every value equal to one)
NANOCHAT_FIELDS = {
    "vocab_size": ("vocab_size", 50304),
    "hidden_size": ("n_embd", 768),
    "num_hidden_layers": ("n_layer", 12),
    "num_attention_heads": ("n_head", 6),
    "max_position_embeddings": ("block_size", 2048),
    "attention_dropout": ("attn_pdrop", 0.0),
    "rms_norm_eps": ("layer_norm_epsilon", 1e-6),
    "tie_word_embeddings": ("tie_embeddings", False),
}
# and of the keys read otherwise
IMPLIED = {"intermediate_size": 8192, "hidden_act": "relu2", "final_logit_softcapping": 15.0, "attention_bias": False}
ACTS = {"relu2": "relu2", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}  # hidden_act -> mlp_act
LAYER = "model.layers.{}."
# a block's matrices NanoChat names otherwise (fc1 carries ln_2's gain, folded in on export)
RENAMED = (
    ("attn.c_proj.weight", "self_attn.o_proj.weight"),
    ("mlp.c_fc.weight", "mlp.fc1.weight"),
    ("mlp.c_proj.weight", "mlp.fc2.weight"),
)


def flip_halves(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``w`` (n_head * head_size, C) with the second half of every head's rows negated (its own inverse)."""
    w = w.reshape(n_head, 2, -1, w.size(-1)).clone()
    w[:, 1].neg_()
    return w.reshape(-1, w.size(-1))


# ---------------------------------------------------------------- export


def config_to_nanochat(config: GPTConfig, dtype: torch.dtype, tok: Tokenizer) -> dict:
    """The config.json transformers' NanoChatForCausalLM reads (``tok``: the model's tokenizer, for its
    special ids)."""
    return {
        **gpt2.config_json(NANOCHAT_HF, NANOCHAT_FIELDS, config, tok),
        "intermediate_size": 4 * config.n_embd,
        "num_key_value_heads": config.n_head,
        "hidden_act": "relu2" if config.mlp_act == "relu2" else "gelu_pytorch_tanh",
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "final_logit_softcapping": config.logit_softcap or None,
        "attention_bias": False,
        # the embedding's padding_idx (a row fine-tuning leaves alone: never <|endoftext|>) and generate's pad
        "pad_token_id": gpt2.pad_id(config, tok),
        "tie_word_embeddings": False,  # ln_f's gain is folded into the head, so it is never wte
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
        for mine, theirs in RENAMED:
            out[o + theirs] = sd[h + mine]
        out[o + "mlp.fc1.weight"] = out[o + "mlp.fc1.weight"] * sd[h + "ln_2.weight"]
    out["lm_head.weight"] = sd["lm_head.weight"][:V] * sd["transformer.ln_f.weight"]
    return {k: t.contiguous().clone() for k, t in out.items()}


# ---------------------------------------------------------------- loading


def config_from_nanochat(cfg: dict) -> GPTConfig:
    """GPTConfig for a NanoChat config.json; a ValueError naming the first option gpt2lab cannot compute."""
    get = lambda name: cfg.get(name, IMPLIED.get(name))  # noqa: E731
    fields = gpt2.read_fields(NANOCHAT_FIELDS, cfg)
    C, heads = fields["n_embd"], fields["n_head"]
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    checks = {
        "num_key_value_heads": (cfg.get("num_key_value_heads"), (None, heads)),  # no grouped-query attention
        "intermediate_size": (get("intermediate_size"), (4 * C,)),
        "attention_bias": (get("attention_bias"), (False,)),
        "hidden_act": (get("hidden_act"), tuple(ACTS)),
        "rope_parameters": (rope.get("rope_type", "default"), ("default",)),
        "rope_scaling": (cfg.get("rope_scaling"), (None,)),
        "head_dim": (cfg.get("head_dim"), (None, C // heads)),
    }
    gpt2.check_options(checks, "NanoChat")
    return GPTConfig(
        **{field: value for field, (value, _) in NANOCHAT_HF.needs.items()},  # positions, norms, no biases
        **fields,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        mlp_act=ACTS[get("hidden_act")],
        logit_softcap=float(get("final_logit_softcapping") or 0.0),
    )


def from_nanochat_state_dict(sd: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """NanoChatForCausalLM tensors -> gpt2lab names (every norm's gain one; a tied head left out).

    A tensor this does not place is kept under its own name, so load.model_from_state_dict names it as unexpected.
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
        for mine, theirs in RENAMED:
            if o + theirs in sd:
                out[h + mine] = sd.pop(o + theirs)
        out[h + "ln_1.weight"], out[h + "ln_2.weight"] = ones.clone(), ones.clone()
    out["transformer.ln_f.weight"] = ones.clone()
    head = sd.pop("lm_head.weight", None)
    if head is not None and not config.tie_embeddings:
        out["lm_head.weight"] = head
    return {**out, **sd}

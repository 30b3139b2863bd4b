"""Hugging Face GPT-2 (``GPT2LMHeadModel``) <-> gpt2lab: tensors and config.json.

HF's GPT-2 stores its four projection matrices as ``Conv1D`` weights, (in, out), where
``nn.Linear`` keeps (out, in); every other tensor has the same name and shape in both.
So converting is: strip/add the ``transformer.`` prefix, transpose four weights, drop
HF's causal-mask buffers, and let the tied lm_head follow wte. Pure mapping: no I/O.
(NanoChat's mapping is weights/nanochat.py.)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from gpt2lab.data.tokenizer import Tokenizer
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.weights.targets import GPT2_HF, HFClass

# Weights HF keeps as Conv1D (in, out); nn.Linear wants (out, in).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers older transformers versions saved with the weights; not parameters.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
# config.json key -> (GPTConfig field, transformers' GPT2Config default where the file leaves the key out);
# the dropouts are the model's own on export (pretraining presets: 0.0), never transformers' default 0.1
GPT2_FIELDS = {
    "vocab_size": ("vocab_size", 50257),
    "n_positions": ("block_size", 1024),
    "n_embd": ("n_embd", 768),
    "n_layer": ("n_layer", 12),
    "n_head": ("n_head", 12),
    "layer_norm_epsilon": ("layer_norm_epsilon", 1e-5),
    **{k: (k, 0.1) for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop")},
    "tie_word_embeddings": ("tie_embeddings", True),
}


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel/GPT2Model tensors -> gpt2lab names and layouts (a tied lm_head excluded)."""
    out = {}
    for key, t in sd.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight":
            if not config.tie_embeddings:  # a tied lm_head is wte
                out[name] = t
        elif not name.endswith(MASK_BUFFERS):  # buffers are rebuilt by the model
            out["transformer." + name] = t.t() if name.endswith(CONV1D) else t
    return out


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """gpt2lab model -> HF GPT2LMHeadModel tensors, contiguous, padded vocab rows dropped.

    A tied lm_head is left out: HF saves the shared matrix once, as transformer.wte. An
    untied one (tie_embeddings false) is saved as lm_head.weight, which HF's GPT-2 loads
    when its config says tie_word_embeddings false. Without biases (``bias`` false) every bias
    GPT-2 has is written as zeros: the same model. Training-only weights (the multi-token prediction
    heads, weights/targets.py) are not written.
    """
    c, sd = model.config, model.state_dict()
    with torch.device("meta"):  # GPT-2's tensors: every bias, and no training-only heads (mtp_heads)
        hf = GPT(replace(c, bias=True, mtp_heads=0)).state_dict()
    out = {}
    for key, like in hf.items():
        if key == "lm_head.weight" and c.tie_embeddings:
            continue
        t = sd[key].detach() if key in sd else torch.zeros(like.shape, dtype=model.transformer.wte.weight.dtype)
        if key.endswith(CONV1D):
            t = t.t()
        elif key in ("transformer.wte.weight", "lm_head.weight"):
            t = t[: c.real_vocab_size]
        out[key] = t.contiguous().clone().cpu()
    return out


def read_fields(fields: dict, cfg: dict) -> dict:
    """GPTConfig's arguments a format's ``fields`` table (config.json key -> (field, default)) reads from ``cfg``."""
    return {field: cfg.get(key, default) for key, (field, default) in fields.items()}


def check_options(checks: dict, model: str) -> None:
    """A ValueError naming the first config.json key of ``checks`` (key -> (its value, the values gpt2lab's
    ``model`` computes)) whose value is not one of them."""
    for key, (value, allowed) in checks.items():
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is not supported by gpt2lab's {model} (needs one of {allowed})")


def config_from_gpt2(cfg: dict) -> GPTConfig:
    """GPTConfig for an HF GPT-2 config dict; a ValueError names an option gpt2lab's model does not have."""
    checks = {
        "activation_function": (cfg.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (cfg.get("n_inner"), (None, 4 * cfg.get("n_embd", 768))),
        "scale_attn_weights": (cfg.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (cfg.get("scale_attn_by_inverse_layer_idx", False), (False,)),
    }
    check_options(checks, "GPT-2")
    return GPTConfig(**read_fields(GPT2_FIELDS, {"n_positions": cfg.get("n_ctx", 1024), **cfg}))  # older files: n_ctx


def special_ids(config: GPTConfig, tok: Tokenizer) -> tuple[Optional[int], Optional[int]]:
    """(<|endoftext|>'s id, the end token's) of a model, in its tokenizer ``tok``: a chat model ends at
    <|im_end|>; tiny test vocabularies have neither (None)."""
    eot = tok.eot_id if config.real_vocab_size > tok.eot_id else None
    return eot, (tok.im_end_id if config.chat_template else eot)


# A byte no UTF-8 text holds. A byte-level BPE (GPT-2's, or one gpt2lab trained) has a token for each
# byte, and no text encodes to this one: no prompt holds it, nor any training document.
NOT_IN_TEXT = b"\xff"


def pad_id(config: GPTConfig, tok: Tokenizer) -> Optional[int]:
    """The id an export pads with: the token of NOT_IN_TEXT, so never one a prompt holds (transformers'
    ``generate``, given input ids without an attention mask, masks every pad id it finds in them: a
    chat prompt's leading <|endoftext|> would be masked if that were the pad). None when the model's
    vocabulary has no such token (tiny test vocabularies)."""
    for i in range(min(config.real_vocab_size, tok.n_vocab)):  # the byte tokens come first
        if tok.decode_single_token_bytes(i) == NOT_IN_TEXT:
            return i
    return None


def config_json(target: HFClass, fields: dict, config: GPTConfig, tok: Tokenizer) -> dict:
    """The config.json keys every export writes: ``target``'s class, the fields of ``fields`` (vocab: the
    real, unpadded one) and the special ids in ``tok``, the model's tokenizer."""
    eot, end = special_ids(config, tok)
    return {
        "architectures": [target.architecture],
        "model_type": target.model_type,
        **{key: getattr(config, field) for key, (field, _) in fields.items()},
        "vocab_size": config.real_vocab_size,
        "initializer_range": 0.02,
        "bos_token_id": eot,
        "eos_token_id": end,
        "use_cache": True,
    }


def config_to_hf(config: GPTConfig, dtype: torch.dtype, tok: Tokenizer) -> dict:
    """The config.json transformers' GPT2LMHeadModel reads."""
    return {
        **config_json(GPT2_HF, GPT2_FIELDS, config, tok),
        "n_ctx": config.block_size,
        "n_inner": None,
        "activation_function": "gelu_new",
        "scale_attn_weights": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }

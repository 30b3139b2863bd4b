"""Writing a Hugging Face directory (``gpt2lab export``, ``gpt2lab.save_pretrained``) that transformers'
AutoModelForCausalLM and AutoTokenizer load unchanged: the weights in the class weights/targets.py names,
config.json, generation_config.json, the tokenizer's files (GPT-2's, or a trained tokenizer.json) and the
export marker. Written whole into a temporary sibling and renamed into place; only an empty directory or
an earlier export is ever replaced.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from gpt2lab.data import chat
from gpt2lab.data.tokenizer import EOT_TOKEN, TOKENIZER_FILE, TrainedBPE, asset_path, for_config, gpt2_tokenizer
from gpt2lab.model.gpt import GPT
from gpt2lab.system import rundir
from gpt2lab.system.files import atomic_dir, write_json
from gpt2lab.weights import gpt2, nanochat
from gpt2lab.weights.targets import GPT2_HF, check_exportable

# What an export writes; the marker file tells a directory gpt2lab exported (safe to replace) apart
# from anything else, such as a run directory or a model fine-tuned in place.
EXPORT_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    rundir.EXPORT_MARKER,
)


def write_tokenizer(
    out: str, block_size: int, chat_template: Optional[str] = None, tokenizer: Optional[TrainedBPE] = None
) -> list[str]:
    """A model's tokenizer files in HF layout; returns their names. GPT-2's: its vocab.json is OpenAI's
    encoder.json, merges.txt its vocab.bpe. A trained ``tokenizer``: its tokenizer.json as it is (the
    file whose sha256 names it) with tokenizer_config.json naming PreTrainedTokenizerFast.

    A chat model's (``chat_template``, data/chat.py), and a trained tokenizer's always, add the turn
    tokens as special added tokens at their ids; a chat model's the template in Jinja
    (``apply_chat_template``) and ``<|im_end|>`` as the end token. The tokenizer's pad token is
    ``<|endoftext|>``: its padding comes with an attention mask, and the pad id ``generate`` reads
    without one is generation_config.json's (gpt2.pad_id), which cannot be a tokenizer's pad token
    (its text, "ÿ", would be read out of a message as that token).
    """
    gpt2s = tokenizer is None
    if gpt2s:
        shutil.copyfile(asset_path("encoder.json"), os.path.join(out, "vocab.json"))
        shutil.copyfile(asset_path("vocab.bpe"), os.path.join(out, "merges.txt"))
    else:
        with open(os.path.join(out, TOKENIZER_FILE), "w", encoding="utf-8") as f:
            f.write(tokenizer.text)
    special = {
        "bos_token": EOT_TOKEN,
        "eos_token": chat.IM_END if chat_template else EOT_TOKEN,
        **({"unk_token": EOT_TOKEN} if gpt2s else {}),
        **({"pad_token": EOT_TOKEN} if chat_template or not gpt2s else {}),
    }
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer" if gpt2s else "PreTrainedTokenizerFast",
        "model_max_length": block_size,
        **({"add_prefix_space": False} if gpt2s else {}),
        **special,
    }
    if chat_template or not gpt2s:
        flags = dict.fromkeys(("lstrip", "rstrip", "normalized", "single_word"), False)
        ids = chat.special_tokens(tokenizer or gpt2_tokenizer())
        tok_config["added_tokens_decoder"] = {str(i): {"content": t, "special": True, **flags} for t, i in ids.items()}
    if chat_template:
        tok_config["chat_template"] = chat.CHAT_TEMPLATE
    write_json(os.path.join(out, "tokenizer_config.json"), tok_config)
    write_json(os.path.join(out, "special_tokens_map.json"), special)
    names = ["vocab.json", "merges.txt"] if gpt2s else [TOKENIZER_FILE]
    return [*names, "tokenizer_config.json", "special_tokens_map.json"]


def check_target(out_dir: str) -> rundir.Found:
    """What ``out_dir`` is when an export may be written there (system/rundir.py's rule), else raise."""
    # a model with its own tokenizer (data/tokenizer.py) writes its tokenizer.json in place of GPT-2's files
    replaces = (*EXPORT_FILES, TOKENIZER_FILE)
    return rundir.check(out_dir, rundir.EXPORT, "", "choose a new or empty OUT_DIR", replaces=replaces)


def save_pretrained(model: GPT, out_dir: str) -> str:
    """Write ``out_dir`` so transformers' AutoModelForCausalLM / AutoTokenizer load it unchanged; returns
    the architecture written (``export_target``: GPT2LMHeadModel or NanoChatForCausalLM).

    Everything is written into a temporary sibling directory first and renamed into place,
    so a crash never leaves a half-written export. An existing ``out_dir`` is replaced only
    when it is empty or an earlier gpt2lab export; anything else (a run, a parent folder,
    someone's model) is refused before a byte is written.
    """
    from safetensors.torch import save_file

    target = check_exportable(model.config).name
    check_target(out_dir)  # what is there may be replaced
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    with atomic_dir(out_dir) as tmp:
        dtype = model.transformer.wte.weight.dtype
        tok = for_config(model.config, model.tokenizer)
        nano = target != GPT2_HF.architecture
        sd = (nanochat.to_nanochat_state_dict if nano else gpt2.to_hf_state_dict)(model)
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config = (nanochat.config_to_nanochat if nano else gpt2.config_to_hf)(model.config, dtype, tok)
        write_json(os.path.join(tmp, "config.json"), config)
        eot, end = gpt2.special_ids(model.config, tok)
        # generate stops where gpt2lab does: a chat model at <|im_end|> (its turn), else at <|endoftext|>;
        # a chat model pads (batched chats) with a token no prompt holds (gpt2.pad_id)
        pad = gpt2.pad_id(model.config, tok) if model.config.chat_template else None
        write_json(
            os.path.join(tmp, "generation_config.json"),
            {"bos_token_id": eot, "eos_token_id": end, **({"pad_token_id": pad} if pad is not None else {})},
        )
        trained = tok if model.config.tokenizer else None
        names = write_tokenizer(tmp, model.config.block_size, model.config.chat_template, trained)
        files = ["model.safetensors", "config.json", "generation_config.json", *names, rundir.EXPORT_MARKER]
        write_json(
            os.path.join(tmp, rundir.EXPORT_MARKER),
            {
                "format": rundir.EXPORT_FORMAT,
                "version": 1,
                "files": files,
                **({"tokenizer": trained.identity} if trained else {}),
            },
        )
    return target

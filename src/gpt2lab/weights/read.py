"""Reading Hugging Face model directories and the hub: config.json, weights files, the tokenizer beside them.

A directory of model_type gpt2 (weights/gpt2.py maps it) or nanochat (weights/nanochat.py) becomes a GPT
holding exactly its tensors, with the trained tokenizer beside it (a gpt2lab export's, or one saved again
by transformers) or none (GPT-2's BPE). The hub is reached only for GPT-2's names and owner/repo ids, and
not at all under HF_HUB_OFFLINE. huggingface_hub and safetensors are imported inside the functions that
need them, so ``import gpt2lab`` stays cheap.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch

from gpt2lab.data import chat
from gpt2lab.data.tokenizer import (
    EOT_TOKEN,
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerError,
    TrainedBPE,
    gpt2_tokenizer,
    is_gpt2_vocabulary,
    load_tokenizer,
)
from gpt2lab.model.config import HUB_NAMES
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system import env, rundir
from gpt2lab.system.errors import DataError
from gpt2lab.system.files import read_json_object
from gpt2lab.weights import gpt2, nanochat
from gpt2lab.weights.targets import GPT2_HF, NANOCHAT_HF

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
MODEL_TYPES = (GPT2_HF.model_type, NANOCHAT_HF.model_type)  # the config.json model_types that load


class WeightsError(DataError):
    """A model source (an HF directory or file, a hub download, or anything weights.load is given)
    that cannot become a GPT; the message names it and says why."""


def model_from_state_dict(
    config: GPTConfig, sd: dict[str, torch.Tensor], where: str, tokenizer: Optional[Tokenizer] = None
) -> GPT:
    """A GPT holding exactly the tensors of ``sd`` (gpt2lab names), without a random init first, with
    ``tokenizer`` (its own, where it has one)."""
    with torch.device("meta"):
        model = GPT(config, tokenizer)  # no memory, no init: every tensor comes from sd
    tied = config.tie_embeddings
    expected = {k for k in model.state_dict() if k != "lm_head.weight" or not tied}
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise WeightsError(
            f"{where}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, t in model.state_dict().items():
        if key in sd and sd[key].shape != t.shape:
            raise WeightsError(f"{where}: {key} has shape {tuple(sd[key].shape)}, config needs {tuple(t.shape)}")
    model.load_state_dict({k: v.contiguous() for k, v in sd.items()}, assign=True, strict=not tied)  # checked above
    if tied:  # the head is wte's matrix: tie it to the Parameter assigned there
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if path.endswith(".safetensors"):
        return load_file(path)
    if path.endswith(".index.json"):
        with open(path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        sd: dict[str, torch.Tensor] = {}
        for shard in shards:
            sd.update(load_file(os.path.join(os.path.dirname(path), shard)))
        return sd
    # weights_only: a pickle from the internet must not be able to run code.
    return torch.load(path, map_location="cpu", weights_only=True)


def hf_config(config_path: str) -> tuple[GPTConfig, Optional[TrainedBPE]]:
    """An HF directory's architecture, from its config.json (GPT-2's or NanoChat's; an option gpt2lab's
    model does not have is a WeightsError naming the file), naming the tokenizer beside it and its chat
    template; and that tokenizer where it is a trained one (``dir_tokenizer``), else None: GPT-2's."""
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightsError(
            f"{config_path}: not a readable JSON config ({e}); restore the file (download or export the model again)"
        ) from e
    if not isinstance(cfg, dict):
        raise WeightsError(f"{config_path}: holds {type(cfg).__name__}, not a JSON object; restore the file")
    kind = cfg.get("model_type", GPT2_HF.model_type)
    if kind not in MODEL_TYPES:
        raise WeightsError(f"{config_path}: model_type {kind!r} is not gpt2 or nanochat")
    try:
        config = nanochat.config_from_nanochat(cfg) if kind == NANOCHAT_HF.model_type else gpt2.config_from_gpt2(cfg)
    except (ValueError, TypeError) as e:
        raise WeightsError(f"{config_path}: {e}") from e
    path = os.path.dirname(config_path)
    tok = dir_tokenizer(path, config.real_vocab_size)
    if tok is not None:
        config = dataclasses.replace(config, tokenizer=tok.identity)
    template = chat_template_of(path, trained=tok is not None)
    if template:  # the tokenizer's turn tokens: a chat model (its vocabulary holds them)
        config = dataclasses.replace(config, chat_template=template)
    return config, tok


def from_files(config: GPTConfig, tok: Optional[TrainedBPE], weights_path: str) -> GPT:
    """A GPT of ``config`` holding ``tok`` from an HF weights file (.safetensors, index, or .bin)."""
    try:
        sd = _read_weights(weights_path)
    except Exception as e:  # safetensors' SafetensorError shares no base with OSError/ValueError
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise WeightsError(
            f"{weights_path}: cannot be read ({why}); the file is damaged or cut short: "
            "download or export the model again"
        ) from e
    # NanoChat's config always sets embed_norm (config_from_nanochat), GPT-2's never
    ours = nanochat.from_nanochat_state_dict if config.embed_norm else gpt2.from_hf_state_dict
    return model_from_state_dict(config, ours(sd, config), weights_path, tok)


def dir_tokenizer(path: str, vocab: int) -> Optional[TrainedBPE]:
    """The tokenizer of an HF directory that transformers' AutoTokenizer reads there too: its tokenizer.json
    (checked against the identity gpt2lab's export marker names, where it names one), loaded, unless that
    file is GPT-2's own BPE; None: GPT-2's BPE (no tokenizer.json, or GPT-2's). A tokenizer.json that is
    neither GPT-2's nor one gpt2lab reads, or has more tokens than the model, is refused naming it."""
    file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(file):
        return None
    named = (read_json_object(os.path.join(path, rundir.EXPORT_MARKER)) or {}).get("tokenizer")
    if isinstance(named, str):
        return load_tokenizer(file, named, what_next="export the model again")
    if is_gpt2_vocabulary(file):
        return None
    fix = "put the model's own tokenizer.json back (or GPT-2's vocab.json and merges.txt alone), or export it again"
    try:
        tok = load_tokenizer(file)
    except TokenizerError as e:
        why = str(e).removeprefix(f"{file}: ")
        raise TokenizerError(f"{file}: neither GPT-2's BPE nor a tokenizer gpt2lab reads ({why}); {fix}") from e
    if tok.n_vocab > vocab:
        raise TokenizerError(f"{file}: has {tok.n_vocab:,} tokens, more than the model's {vocab:,}; {fix}")
    return tok


def chat_template_of(path: str, trained: bool = False) -> Optional[str]:
    """The chat template of an HF directory's tokenizer: "chatml" when its tokenizer_config.json adds
    <|im_start|> and <|im_end|> at gpt2lab's ids (data/chat.py), as a chat export writes them; for a
    ``trained`` tokenizer (which always has them) when it carries gpt2lab's template; else None."""
    tok = read_json_object(os.path.join(path, "tokenizer_config.json")) or {}
    if trained:
        return chat.TEMPLATE if tok.get("chat_template") == chat.CHAT_TEMPLATE else None
    added = tok.get("added_tokens_decoder")
    if not isinstance(added, dict):
        return None
    have = {str(v.get("content")): k for k, v in added.items() if isinstance(v, dict)}
    ours = all(have.get(t) == str(i) for t, i in chat.special_tokens(gpt2_tokenizer()).items() if t != EOT_TOKEN)
    return chat.TEMPLATE if ours else None


def hub_files(name: str) -> tuple[str, str]:
    """Local paths of a hub model's config.json and model.safetensors (downloaded or cached)."""
    from huggingface_hub import hf_hub_download

    repo = f"openai-community/{name}" if name in HUB_NAMES else name
    offline = env.hub_offline()
    try:
        config_path = hf_hub_download(repo, "config.json", local_files_only=offline)
        weights_path = hf_hub_download(repo, "model.safetensors", local_files_only=offline)
    except Exception as e:  # the hub raises many types (HTTP, offline, not cached, not found)
        how = "offline (HF_HUB_OFFLINE is set) and not in the cache" if offline else "could not be downloaded"
        raise WeightsError(
            f"{repo}: {how} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"Pass a local directory instead, e.g. one made on a connected machine with "
            f"`gpt2lab export {name} DIR` or `hf download {repo} --local-dir DIR`, "
            "holding config.json and model.safetensors (or pytorch_model.bin)."
        ) from e
    return config_path, weights_path

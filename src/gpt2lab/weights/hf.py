"""Hugging Face weights in and out: GPT-2 here, NanoChat's mapping in weights/nanochat.py.

An export is GPT2LMHeadModel for a model GPT-2 computes (``bias`` false: GPT-2 with zero biases),
NanoChatForCausalLM for one NanoChat computes (``export_target``), else refused in one line naming
each field neither computes. HF directories of either model_type load.

HF's GPT-2 stores its four projection matrices as ``Conv1D`` weights, (in, out), where
``nn.Linear`` keeps (out, in); every other tensor has the same name and shape in both.
So converting is: strip/add the ``transformer.`` prefix, transpose four weights, drop
HF's causal-mask buffers, and let the tied lm_head follow wte.

huggingface_hub and safetensors are imported inside the functions that need them, so
``import gpt2lab`` stays cheap.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, replace
from typing import Optional

import torch

from gpt2lab.model.config import HUB_NAMES
from gpt2lab.system import rundir
from gpt2lab.system.errors import DataError, UsageError
from gpt2lab.system.files import atomic_dir, read_json_object, write_json
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.data import chat
from gpt2lab.data.tokenizer import (CHAT_VOCAB_SIZE, EOT_TOKEN, GPT2_VOCAB_SIZE, TOKENIZER_FILE, TokenizerError,
                                    TrainedBPE, asset_path, for_config, load_tokenizer)
from gpt2lab.weights import nanochat

# Weights HF keeps as Conv1D (in, out); nn.Linear wants (out, in).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers older transformers versions saved with the weights; not parameters.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
PDROP = ("embd_pdrop", "attn_pdrop", "resid_pdrop")  # GPTConfig and HF config.json share these names
HUB_REPOS = {name: f"openai-community/{name}" for name in HUB_NAMES}
GPT2 = "GPT2LMHeadModel"
MODEL_TYPES = ("gpt2", nanochat.MODEL_TYPE)  # the config.json model_types that load
# What an export writes; the marker file tells a directory gpt2lab exported (safe to replace) apart
# from anything else, such as a run directory or a model fine-tuned in place.
EXPORT_MARKER = rundir.EXPORT_MARKER  # the directory's owner mark (system.rundir)
EXPORT_FILES = ("model.safetensors", "config.json", "generation_config.json", "vocab.json", "merges.txt",
                "tokenizer_config.json", "special_tokens_map.json", EXPORT_MARKER)
# ... and of a model with its own tokenizer (data/tokenizer.py): its tokenizer.json in place of GPT-2's files
TRAINED_EXPORT_FILES = ("model.safetensors", "config.json", "generation_config.json", TOKENIZER_FILE,
                        "tokenizer_config.json", "special_tokens_map.json", EXPORT_MARKER)


class WeightsError(DataError):
    """A model source (an HF directory or file, a hub download, or anything weights.load is given)
    that cannot become a GPT; the message names it and says why."""


# ---------------------------------------------------------------- state dict conversion

def from_hf_state_dict(sd: dict[str, torch.Tensor], tied: bool = True) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel/GPT2Model tensors -> gpt2lab names and layouts (a tied lm_head excluded)."""
    out = {}
    for key, t in sd.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight" and not tied:
            out[name] = t
            continue
        if name.endswith(MASK_BUFFERS) or name == "lm_head.weight":
            continue  # buffers are rebuilt by the model; a tied lm_head is wte
        out["transformer." + name] = t.t() if name.endswith(CONV1D) else t
    return out


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """gpt2lab model -> HF GPT2LMHeadModel tensors, contiguous, padded vocab rows dropped.

    A tied lm_head is left out: HF saves the shared matrix once, as transformer.wte. An
    untied one (tie_embeddings false) is saved as lm_head.weight, which HF's GPT-2 loads
    when its config says tie_word_embeddings false. Without biases (``bias`` false) every bias
    GPT-2 has is written as zeros: the same model.
    """
    real_vocab = model.config.real_vocab_size
    out = {}
    if not model.config.bias:
        with torch.device("meta"):
            full = GPT(replace(model.config, bias=True)).state_dict()
        dtype = model.transformer.wte.weight.dtype
        out = {k: torch.zeros(t.shape, dtype=dtype) for k, t in full.items() if k.endswith(".bias")}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_embeddings:
            continue
        t = t.detach()
        if key.endswith(CONV1D):
            t = t.t()
        elif key in ("transformer.wte.weight", "lm_head.weight"):
            t = t[:real_vocab]
        out[key] = t.contiguous().clone().cpu()
    return out


# ---------------------------------------------------------------- config.json

def config_from_hf(cfg: dict, where: str = "config.json") -> GPTConfig:
    """GPTConfig for an HF GPT-2 or NanoChat config dict; refuses options gpt2lab's model does not have."""
    if cfg.get("model_type", "gpt2") == nanochat.MODEL_TYPE:
        try:
            return nanochat.config_from_nanochat(cfg)
        except (ValueError, TypeError) as e:
            raise WeightsError(f"{where}: {e}") from e
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise WeightsError(f"{where}: model_type {cfg.get('model_type')!r} is not gpt2 or nanochat")
    checks = {
        "activation_function": (cfg.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (cfg.get("n_inner"), (None, 4 * cfg.get("n_embd", 768))),
        "scale_attn_weights": (cfg.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (cfg.get("scale_attn_by_inverse_layer_idx", False), (False,)),
    }
    for field, (value, allowed) in checks.items():
        if value not in allowed:
            raise WeightsError(f"{where}: {field}={value!r} is not supported by gpt2lab's GPT-2 (needs one of {allowed})")
    try:
        return GPTConfig(
            block_size=cfg.get("n_positions", cfg.get("n_ctx", 1024)),
            vocab_size=cfg.get("vocab_size", 50257),
            n_layer=cfg.get("n_layer", 12),
            n_head=cfg.get("n_head", 12),
            n_embd=cfg.get("n_embd", 768),
            layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            **{k: cfg.get(k, 0.1) for k in PDROP},  # transformers' GPT2Config default is 0.1
        )
    except ValueError as e:
        raise WeightsError(f"{where}: {e}") from e


def special_ids(config: GPTConfig) -> tuple[Optional[int], Optional[int]]:
    """(<|endoftext|>'s id, the end token's) of a model, in its tokenizer: a chat model ends at
    <|im_end|>; tiny test vocabularies have neither (None)."""
    tok = for_config(config)
    eot = tok.eot_id if config.real_vocab_size > tok.eot_id else None
    return eot, (tok.im_end_id if config.chat_template else eot)


def config_to_hf(config: GPTConfig, dtype: torch.dtype) -> dict:
    """The config.json transformers' GPT2LMHeadModel reads; vocab is the real (unpadded) one."""
    vocab = config.real_vocab_size
    eot, end = special_ids(config)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.layer_norm_epsilon,
        # the model's own dropout (pretraining presets: 0.0), never transformers' default 0.1
        **{k: getattr(config, k) for k in PDROP},
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "bos_token_id": eot,
        "eos_token_id": end,
        "tie_word_embeddings": config.tie_embeddings,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------- loading

def build_model(config: GPTConfig, sd: dict[str, torch.Tensor], where: str) -> GPT:
    """A GPT holding exactly the tensors of ``sd`` (gpt2lab names), without a random init first."""
    with torch.device("meta"):
        model = GPT(config)  # no memory, no init: every tensor comes from sd
    tied = config.tie_embeddings
    expected = {k for k in model.state_dict() if k != "lm_head.weight" or not tied}
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise WeightsError(f"{where}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, t in model.state_dict().items():
        if key in sd and sd[key].shape != t.shape:
            raise WeightsError(f"{where}: {key} has shape {tuple(sd[key].shape)}, config needs {tuple(t.shape)}")
    full = {k: v.contiguous() for k, v in sd.items()}
    if tied:
        full["lm_head.weight"] = full["transformer.wte.weight"]
    model.load_state_dict(full, assign=True)
    if tied:  # assign=True installs two separate Parameters for the tied pair; tie them again.
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


def load_files(config_path: str, weights_path: str) -> GPT:
    """A GPT from an HF config.json and a weights file (.safetensors, index, or .bin)."""
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightsError(f"{config_path}: not a readable JSON config ({e}); restore the file (download or "
                           "export the model again)") from e
    if not isinstance(cfg, dict):
        raise WeightsError(f"{config_path}: holds {type(cfg).__name__}, not a JSON object; restore the file")
    try:
        sd = _read_weights(weights_path)
    except Exception as e:  # safetensors' SafetensorError shares no base with OSError/ValueError
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise WeightsError(f"{weights_path}: cannot be read ({why}); the file is damaged or cut short: "
                           "download or export the model again") from e
    config = dir_config(cfg, config_path)
    if cfg.get("model_type") == nanochat.MODEL_TYPE:
        return build_model(config, nanochat.from_nanochat_state_dict(sd, config), weights_path)
    return build_model(config, from_hf_state_dict(sd, config.tie_embeddings), weights_path)


def dir_config(cfg: dict, config_path: str) -> GPTConfig:
    """The GPTConfig of an HF directory: its config.json's, with the tokenizer beside it (a trained one,
    loaded: ``dir_tokenizer``) and its chat template."""
    config = config_from_hf(cfg, config_path)
    path = os.path.dirname(config_path)
    tok = dir_tokenizer(path, config.real_vocab_size)
    if tok is not None:
        config = dataclasses.replace(config, tokenizer=tok.identity)
    template = chat_template_of(path, trained=tok is not None)
    if template:  # the tokenizer's turn tokens: a chat model (its vocabulary holds them)
        config = dataclasses.replace(config, chat_template=template)
    return config


def dir_tokenizer(path: str, vocab: int) -> Optional[TrainedBPE]:
    """The trained tokenizer of an HF directory, loaded: its tokenizer.json where gpt2lab's export marker
    names it, or where the model's vocabulary is not GPT-2's and that file is a gpt2lab tokenizer (one a
    directory saved again by transformers keeps). None: GPT-2's BPE (its HF files, if any, are GPT-2's)."""
    file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(file):
        return None
    named = (read_json_object(os.path.join(path, EXPORT_MARKER)) or {}).get("tokenizer")
    if isinstance(named, str):
        return load_tokenizer(file, named, what_next="export the model again")
    if vocab in (GPT2_VOCAB_SIZE, CHAT_VOCAB_SIZE):
        return None
    try:
        return load_tokenizer(file)
    except TokenizerError:  # someone else's tokenizer: gpt2lab reads text with GPT-2's, as it always did
        return None


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
    ours = all(have.get(t) == str(i) for t, i in chat.SPECIAL_TOKENS.items() if t != EOT_TOKEN)
    return chat.TEMPLATE if ours else None


def from_hf_dir(path: str) -> GPT:
    """A GPT from a local HF GPT-2 or NanoChat directory (config.json + model.safetensors or pytorch_model.bin)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise WeightsError(f"{path}: no config.json; is this a Hugging Face model directory?")
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return load_files(config_path, os.path.join(path, name))
    raise WeightsError(f"{path}: no weights file (looked for {', '.join(WEIGHT_FILES)})")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def from_hub(name: str) -> GPT:
    """gpt2 / gpt2-medium / gpt2-large / gpt2-xl (or an owner/repo id) from the Hugging Face hub.

    Downloads config.json and model.safetensors into the hub cache (HF_HOME), or reads
    them from it when HF_HUB_OFFLINE is set.
    """
    return load_files(*hub_files(name))


def hub_files(name: str) -> tuple[str, str]:
    """Local paths of a hub model's config.json and model.safetensors (downloaded or cached)."""
    from huggingface_hub import hf_hub_download

    repo = HUB_REPOS.get(name, name)
    offline = _hub_offline()
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


# ---------------------------------------------------------------- export

# What a model must be for HF's GPT-2 to compute it: field -> (value, what GPT-2 has). An untied
# head it has (tie_word_embeddings false), biases of zero stand for none; zero_init_proj and
# zero_init_head only set the initial weights, rope_theta matters only with rotary positions.
GPT2_NEEDS = {
    "pos_emb": ("learned", "learned positions only"),
    "norm": ("layernorm", "LayerNorm only"),
    "qk_norm": (False, "no QK-norm"),
    "mlp_act": ("gelu", "tanh GELU only"),
    "embed_norm": (False, "no norm of the embeddings"),
    "logit_softcap": (0.0, "no logit softcap"),
    "value_embeds": (0, "no value embeddings"),
    "unet_skips": (False, "no skips between blocks"),
}


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def gaps(config: GPTConfig, needs: dict) -> list[str]:
    """The fields of ``config`` a target with ``needs`` does not compute, as ``field=value``."""
    return [f"{k}={_show(getattr(config, k))}" for k, (v, _) in needs.items() if getattr(config, k) != v]


@dataclass(frozen=True)
class ExportTarget:
    """What ``gpt2lab export`` writes for a model: ``name`` (GPT2LMHeadModel, NanoChatForCausalLM) or
    None, and then ``why``: each field that keeps it from both, and what the nearer one would need."""
    name: Optional[str]
    why: str = ""

    def describe(self) -> str:
        return f"Hugging Face {self.name}" if self.name else f"none ({self.why})"


def export_target(config: GPTConfig) -> ExportTarget:
    """The Hugging Face model that computes ``config``'s logits (GPT-2 first), or why none does."""
    g, n = gaps(config, GPT2_NEEDS), gaps(config, nanochat.NEEDS)
    if not g or not n:
        return ExportTarget(GPT2 if not g else nanochat.ARCHITECTURE)
    neither = [x for x in g if x in n]
    parts = [f"{x} (GPT-2 and NanoChat: {GPT2_NEEDS[x.split('=')[0]][1]})" for x in neither]
    name, needs, missing = (GPT2, GPT2_NEEDS, g) if len(g) < len(n) else (nanochat.ARCHITECTURE, nanochat.NEEDS, n)
    rest = [x.split("=")[0] for x in missing if x not in neither]
    if rest:
        wants = ", ".join(f"{k}={_show(needs[k][0])} ({needs[k][1]})" for k in rest)
        parts.append(f"{name} would {'also ' if neither else ''}need {wants}")
    return ExportTarget(None, "; ".join(parts))


def unexportable(config: GPTConfig) -> list[str]:
    """The fields (``field=value``) that keep both GPT-2 and NanoChat from computing this model, else
    GPT-2's gaps; empty when either computes it."""
    g, n = gaps(config, GPT2_NEEDS), gaps(config, nanochat.NEEDS)
    return [] if not g or not n else [x for x in g if x in n] or g


def check_exportable(config: GPTConfig) -> ExportTarget:
    """The export target; one line (a UsageError, exit 2) when neither GPT-2 nor NanoChat computes this model."""
    target = export_target(config)
    if target.name is None:
        raise UsageError(f"export writes Hugging Face GPT-2 or NanoChat, and neither computes this model: "
                         f"{target.why}; nothing was written. sample, serve and eval run it natively; to export, "
                         "train without those fields")
    return target


def write_tokenizer(out: str, block_size: int, chat_template: Optional[str] = None,
                    tokenizer: Optional[TrainedBPE] = None) -> list[str]:
    """A model's tokenizer files in HF layout; returns their names. GPT-2's: its vocab.json is OpenAI's
    encoder.json, merges.txt its vocab.bpe. A trained ``tokenizer``: its tokenizer.json as it is (the
    file whose sha256 names it) with tokenizer_config.json naming PreTrainedTokenizerFast.

    A chat model's (``chat_template``, data/chat.py) add its two turn tokens as special added tokens
    at their ids, the template in Jinja (``apply_chat_template``) and ``<|im_end|>`` as the end token.
    """
    if tokenizer is not None:
        return _write_trained(out, block_size, chat_template, tokenizer)
    shutil.copyfile(asset_path("encoder.json"), os.path.join(out, "vocab.json"))
    shutil.copyfile(asset_path("vocab.bpe"), os.path.join(out, "merges.txt"))
    special = {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "unk_token": EOT_TOKEN}
    tok_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": block_size,
                  "add_prefix_space": False, **special}
    if chat_template:
        special = {**special, "eos_token": chat.IM_END, "pad_token": EOT_TOKEN}
        added = {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                          "single_word": False} for t, i in chat.SPECIAL_TOKENS.items()}
        tok_config = {**tok_config, **special, "added_tokens_decoder": added,
                      "chat_template": chat.CHAT_TEMPLATE}
    write_json(os.path.join(out, "tokenizer_config.json"), tok_config)
    write_json(os.path.join(out, "special_tokens_map.json"), special)
    return ["vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"]


def _write_trained(out: str, block_size: int, chat_template: Optional[str], tokenizer: TrainedBPE) -> list[str]:
    with open(os.path.join(out, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        f.write(tokenizer.text)
    special = {"bos_token": EOT_TOKEN, "eos_token": chat.IM_END if chat_template else EOT_TOKEN,
               "pad_token": EOT_TOKEN}
    added = {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False} for t, i in chat.special_tokens(tokenizer).items()}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size, **special,
                  "added_tokens_decoder": added, **({"chat_template": chat.CHAT_TEMPLATE} if chat_template else {})}
    write_json(os.path.join(out, "tokenizer_config.json"), tok_config)
    write_json(os.path.join(out, "special_tokens_map.json"), special)
    return [TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"]


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
    out_dir = os.path.abspath(out_dir)
    replace_dir = _check_export_target(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    with atomic_dir(out_dir, replace=replace_dir) as tmp:
        dtype = model.transformer.wte.weight.dtype
        if target == GPT2:
            sd, config = to_hf_state_dict(model), config_to_hf(model.config, dtype)
        else:
            sd, config = nanochat.to_nanochat_state_dict(model), nanochat.config_to_nanochat(model.config, dtype)
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        write_json(os.path.join(tmp, "config.json"), config)
        eot, end = special_ids(model.config)
        # generate stops where gpt2lab does: a chat model at <|im_end|> (its turn), else at <|endoftext|>
        write_json(os.path.join(tmp, "generation_config.json"),
                   {"bos_token_id": eot, "eos_token_id": end, **({"pad_token_id": eot} if model.config.chat_template
                                                                 else {})})
        trained = for_config(model.config) if model.config.tokenizer else None
        names = write_tokenizer(tmp, model.config.block_size, model.config.chat_template, trained)
        files = ["model.safetensors", "config.json", "generation_config.json", *names, EXPORT_MARKER]
        write_json(os.path.join(tmp, EXPORT_MARKER), {"format": rundir.EXPORT_FORMAT, "version": 1, "files": files,
                                                       **({"tokenizer": trained.identity} if trained else {})})
    return target


def _check_export_target(out_dir: str) -> bool:
    """Whether ``out_dir`` exists and may be replaced; raises if it must not be touched (system.rundir's rule)."""
    found = rundir.inspect(out_dir)
    if found.kind == "file":
        raise UsageError(f"{out_dir} exists and is not a directory; choose another output path")
    if found.kind in ("missing", "empty"):
        return found.kind == "empty"
    if found.kind == rundir.EXPORT and set(found.entries) <= {*EXPORT_FILES, *TRAINED_EXPORT_FILES}:
        return True  # an earlier export: it holds nothing an export does not write again
    raise UsageError(f"{out_dir} is not empty ({len(found.entries)} entries: {found.shown()}) and is not an earlier "
                     f"gpt2lab export: it holds {rundir.what(found)}; nothing was written. Choose a new or "
                     "empty OUT_DIR")

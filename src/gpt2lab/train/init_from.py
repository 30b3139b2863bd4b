"""``train --init-from SRC``: start a new run from existing GPT-2 weights.

SRC is a hub name (gpt2 ... gpt2-xl), a local HF GPT-2 directory, a gpt2lab run directory
(its newest checkpoint) or one checkpoint directory. Only the weights are taken: the run
gets a new optimizer, step 0, its own LR schedule and data order. The architecture comes
from SRC (``source_arch``, which the run plan applies); the run may pad the vocabulary (50257 -> 50304) and keep
fewer positions (a smaller ``--block-size``). Every problem with SRC is an ``InitFromError``
naming it, raised before any training work.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Mapping, Optional

import torch

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.data.tokenizer import GPT2_VOCAB_SIZE
from gpt2lab.model.config import CHAT_VOCAB_SIZES, model_from_config
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system.files import read_json_object, sha256_file
from gpt2lab.train.config import ConfigError
from gpt2lab.weights import read
from gpt2lab.weights.load import CHECKPOINT, HF_DIR, from_checkpoint, source_kind

# What the source decides: every field that sets a parameter shape or what the weights compute
# (the modern block's switches), but the vocabulary (a run may pad it).
ARCH_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.metadata["arch"] and f.name != "vocab_size")


class InitFromError(ConfigError):
    """An --init-from source that cannot start this run; the message names it and says what to do."""


@dataclass
class Source:
    spec: str  # SRC as the user gave it
    kind: str  # source_kind's reading: HUB, HF_DIR or CHECKPOINT (weights.load)
    config: GPTConfig  # its architecture
    weights: str  # the weights file (a checkpoint's model.safetensors; checkpoint.weights_file)
    config_path: str
    step: Optional[int] = None  # steps the checkpoint had completed
    flag: str = "--init-from"  # how the user named it, for messages
    verified: bool = False  # a checkpoint whose checksums were checked when it was found

    def _fail(self, what: str) -> InitFromError:
        return InitFromError(f"{self.flag} {self.spec}: {what}")


def find_source(spec: str) -> Source:
    """Resolve SRC and read its architecture (config only, the weights file's header checked)."""
    try:
        src = _find(spec)
    except read.WeightsError as e:
        then = " Then train with --init-from DIR." if "local directory" in str(e) else ""
        raise InitFromError(f"--init-from {spec}: {e}{then}") from e
    template = src.config.chat_template
    tokens = CHAT_VOCAB_SIZES[template] if template else GPT2_VOCAB_SIZE
    if src.config.tokenizer is None and src.config.real_vocab_size != tokens:  # its own tokenizer says its vocabulary
        raise src._fail(
            f"its vocabulary has {src.config.real_vocab_size} tokens, not GPT-2's "
            f"{GPT2_VOCAB_SIZE}, and no gpt2lab tokenizer.json is beside it; pass a GPT-2 model or "
            "one gpt2lab trained (its tokenizer travels with it)"
        )
    _check_readable(src)
    return src


def _find(spec: str) -> Source:
    kind = source_kind(spec)  # the loader's reading; a file or an unknown name: WeightsError (find_source)
    if kind == HF_DIR:
        config_path = os.path.join(spec, "config.json")
        weights = next(os.path.join(spec, f) for f in read.WEIGHT_FILES if os.path.isfile(os.path.join(spec, f)))
        return Source(spec, kind, _hf_config(config_path), weights, config_path)
    if kind == CHECKPOINT:
        return _checkpoint_source(spec)
    config_path, weights = read.hub_files(spec)  # offline: WeightsError saying how to pass a local dir
    return Source(spec, kind, _hf_config(config_path), weights, config_path)


def _hf_config(path: str) -> GPTConfig:
    try:
        with open(path) as f:
            return read.dir_config(json.load(f), path)[0]
    except (OSError, ValueError) as e:  # WeightsError is a ValueError
        raise read.WeightsError(f"cannot read {path}: {e}") from e


def _checkpoint_source(spec: str) -> Source:
    config = read_json_object(os.path.join(spec, "config.json"))
    if config is not None and config.get("model_type") in read.MODEL_TYPES:  # is_hf_dir found no weights
        raise InitFromError(
            f"--init-from {spec}: an HF {config['model_type']} config.json without a weights file "
            f"(looked for {', '.join(read.WEIGHT_FILES)}); copy the weights beside it"
        )
    if config is not None and "model_type" in config:  # an HF directory of another kind
        raise InitFromError(
            f"--init-from {spec}: model_type {config['model_type']!r} is not GPT-2 or NanoChat; "
            "pass a model of model_type gpt2 or nanochat"
        )
    verified = False
    if ckpt.has_weights(spec):
        where = spec
    else:  # the run's newest intact checkpoint: the one rule of resume (train.gather.find_resume) too
        where, verified = ckpt.find_intact(spec), True
        if where is None and ckpt.find_latest(spec):
            raise InitFromError(f"--init-from {spec}: every checkpoint of this run is damaged; pass another source")
        if where is None:
            raise InitFromError(
                f"--init-from {spec}: neither an HF GPT-2 directory (config.json + "
                "model.safetensors) nor a run directory with a complete checkpoint "
                "(checkpoints/step_*/) nor a checkpoint directory; check the path"
            )
    weights = ckpt.weights_file(where)
    needed = (os.path.basename(weights), "state.pt", "config.json")
    missing = [f for f in needed if not os.path.isfile(os.path.join(where, f))]
    config = read_json_object(os.path.join(where, "config.json"))
    if missing or config is None:
        what = "it is" if where == spec else f"{where} is"  # the source named once
        raise InitFromError(
            f"--init-from {spec}: {what} an incomplete checkpoint (missing or unreadable: "
            f"{', '.join(missing) or 'config.json'}); pass its run directory (newest complete "
            "checkpoint) or another step_* directory"
        )
    ckpt.check_format(where)  # one of another gpt2lab's format version: refused as such (CheckpointError)
    try:
        model_config = model_from_config(config)
        step = int(torch.load(os.path.join(where, "state.pt"), weights_only=True, map_location="cpu")["step"])
    except (KeyError, TypeError, ValueError, RuntimeError, OSError) as e:
        what = "the checkpoint" if where == spec else f"the checkpoint {where}"
        raise InitFromError(f"--init-from {spec}: cannot read {what} ({e}); pass another step_* directory") from e
    return Source(spec, CHECKPOINT, model_config, weights, os.path.join(where, "config.json"), step, verified=verified)


def _check_readable(src: Source) -> None:
    """Open a safetensors file's header: a truncated or foreign file fails here, not mid-load."""
    if not src.weights.endswith(".safetensors"):
        return
    from safetensors import safe_open

    try:
        with safe_open(src.weights, framework="pt") as f:
            keys = set(f.keys())
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise src._fail(f"{src.weights} is damaged or half-written ({e}); pass a complete copy") from e
    if not any(k.endswith(("wte.weight", "embed_tokens.weight")) for k in keys):
        raise src._fail(
            f"{src.weights} holds no token embedding (wte.weight, or NanoChat's embed_tokens.weight); "
            "pass a GPT-2 or NanoChat model"
        )


def source_arch(spec: str, explicit: Mapping[str, object], flag: str = "--init-from") -> dict[str, object]:
    """SRC's ARCH_FIELDS (n_layer ... block_size, the modern block's), checked against the values the user gave."""
    src = find_source(spec)
    src.flag = flag
    return check_arch(src, explicit)


def check_arch(src: Source, explicit: Mapping[str, object]) -> dict[str, object]:
    """``src``'s ARCH_FIELDS, checked against the values the user gave.

    Each value in ``explicit`` must agree with SRC, except a smaller block_size (the run
    keeps SRC's first positions); values from elsewhere (a preset's) simply give way.
    """
    arch = {name: getattr(src.config, name) for name in ARCH_FIELDS}
    for name, theirs in arch.items():
        ours = explicit.get(name, theirs)
        if ours == theirs:
            continue
        if name == "block_size" and ours < theirs:
            arch[name] = ours
            continue
        option = "--" + name.replace("_", "-")
        raise src._fail(
            f"it has {name} {theirs} but {option} {ours} was given; the architecture comes "
            f"from the source, so drop {option}" + (" or lower it" if name == "block_size" else "")
        )
    return arch


def digest(src: Source) -> str:
    """sha256 of SRC's weights file, computed once: a checkpoint's from its verified checksums.json."""
    if src.kind == CHECKPOINT:
        where = os.path.dirname(src.weights)
        if not src.verified:
            ckpt.verify(where)
            src.verified = True
        sums = read_json_object(os.path.join(where, ckpt.CHECKSUMS)) or {}
        name = os.path.basename(src.weights)
        if name in sums:
            return str(sums[name])
    return sha256_file(src.weights)


def load_source(model: GPT, src: Source) -> None:
    """Copy SRC's weights into ``model`` (already built from the adapted config).

    Vocabulary rows past SRC's are padding (never sampled, dropped on export): they start
    as the mean of the real rows, whose logit is an average one, so the loss at step 0 is
    within ~0.1% of SRC's. So do the tokens the run has and SRC has not (a chat template's turn
    tokens, on a base model): SRC's padding rows there were trained never to be predicted.
    Position rows past the run's block_size are dropped.
    """
    try:
        loaded = (
            from_checkpoint(os.path.dirname(src.weights), verified=src.verified)
            if src.kind == CHECKPOINT
            else read.load_files(src.config_path, src.weights)
        )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise src._fail(f"cannot load its weights ({e}); pass a complete copy") from e
    theirs = dict(loaded.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied lm_head comes once, as wte
            _copy_param(src, name, p, theirs[name], model.config.real_vocab_size)


def _copy_param(src: Source, name: str, p: torch.Tensor, w: torch.Tensor, real_vocab: int) -> None:
    if name in ("transformer.wte.weight", "lm_head.weight") and p.shape[1:] == w.shape[1:]:  # untied: its own rows
        rows, theirs = min(len(p), len(w)), src.config.real_vocab_size
        p[:rows] = w[:rows]
        p[rows:] = w[:theirs].mean(0)
        if real_vocab > theirs:  # tokens new to the model: from the mean row too
            p[theirs:real_vocab] = w[:theirs].mean(0)
    elif name == "transformer.wpe.weight" and p.shape[1:] == w.shape[1:] and len(p) <= len(w):
        p.copy_(w[: len(p)])
    elif p.shape == w.shape:
        p.copy_(w)
    else:
        raise src._fail(
            f"{name} has shape {tuple(w.shape)}, the run needs {tuple(p.shape)}; "
            "let the architecture come from the source (drop --n-layer/--n-head/--n-embd)"
        )

"""``train --init-from SRC``: start a new run from existing GPT-2 weights.

SRC is anything ``--model`` takes (weights.load): a hub name, a local HF GPT-2 or NanoChat directory, a run directory
(its newest intact checkpoint) or one checkpoint directory. Only the weights are taken: the run
gets a new optimizer, step 0, its own LR schedule and data order. The architecture comes
from SRC (``check_arch``, which the run plan applies); the run may pad the vocabulary (50257 -> 50304) and keep
fewer positions (a smaller ``--block-size``). Every problem with SRC is an ``InitFromError``
naming it, raised before any training work.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Mapping

import torch

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system.files import read_json_object, sha256_file
from gpt2lab.train.config import ConfigError
from gpt2lab.weights.load import CHECKPOINT_DIR, Source, WeightsError, model_of, model_source, named

# What the source decides: every field that sets a parameter shape or what the weights compute
# (the modern block's switches), but the vocabulary (a run may pad it).
ARCH_FIELDS = tuple(
    f.name for f in fields(GPTConfig) if (f.metadata.get("arch") or f.metadata.get("shape")) and f.name != "vocab_size"
)


class InitFromError(ConfigError):
    """An --init-from source that cannot start this run; the message names it and says what to do."""


def fail(src: Source, what: str) -> InitFromError:
    return InitFromError(f"{src.flag} {src.spec}: {what}")


def find_source(spec: str) -> Source:
    """SRC as the loader reads it (weights.load.model_source: a run directory's newest intact checkpoint),
    checked to start a run: a vocabulary gpt2lab has a tokenizer for, a weights file whose header reads."""
    try:
        src = model_source(spec, "--init-from")
    except WeightsError as e:
        then = " Then train with --init-from DIR." if "local directory" in str(e) else ""
        raise InitFromError(named("--init-from", spec, e) + then) from e
    # its own tokenizer says its vocabulary
    gpt2 = src.config.template_vocab  # GPT-2's, with a chat model's turn tokens
    if src.config.tokenizer is None and src.config.real_vocab_size != gpt2:
        raise fail(
            src,
            f"its vocabulary has {src.config.real_vocab_size} tokens, not GPT-2's {gpt2}, and no gpt2lab "
            "tokenizer.json is beside it; pass a GPT-2 model or one gpt2lab trained (its tokenizer travels with it)",
        )
    if not src.weights.endswith(".safetensors"):
        return src
    from safetensors import safe_open

    try:  # the header: a truncated or foreign file fails here, not mid-load
        with safe_open(src.weights, framework="pt") as f:
            keys = set(f.keys())
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise fail(src, f"{src.weights} is damaged or half-written ({e}); pass a complete copy") from e
    if not any(k.endswith(("wte.weight", "embed_tokens.weight")) for k in keys):
        raise fail(
            src,
            f"{src.weights} holds no token embedding (wte.weight, or NanoChat's embed_tokens.weight); "
            "pass a GPT-2 or NanoChat model",
        )
    return src


def check_arch(src: Source, explicit: Mapping[str, object]) -> dict[str, object]:
    """``src``'s ARCH_FIELDS, checked against the values the user gave.

    Each value in ``explicit`` must agree with SRC, except a smaller block_size (the run
    keeps SRC's first positions); values from elsewhere (a preset's) simply give way.
    """
    arch = {name: getattr(src.config, name) for name in ARCH_FIELDS}
    for name, theirs in arch.items():
        ours, option = explicit.get(name, theirs), "--" + name.replace("_", "-")
        if name == "block_size" and ours < theirs:
            arch[name] = ours
        elif ours != theirs:
            raise fail(
                src,
                f"it has {name} {theirs} but {option} {ours} was given; the architecture comes "
                f"from the source, so drop {option}" + (" or lower it" if name == "block_size" else ""),
            )
    return arch


def digest(src: Source) -> str:
    """sha256 of SRC's weights file, computed once: a checkpoint's from its checksums.json (verified when
    it was resolved)."""
    sums = (read_json_object(os.path.join(src.where, ckpt.CHECKSUMS)) or {}) if src.kind == CHECKPOINT_DIR else {}
    name = os.path.basename(src.weights)
    return str(sums[name]) if name in sums else sha256_file(src.weights)


def load_source(model: GPT, src: Source) -> None:
    """Copy SRC's weights into ``model`` (already built from the adapted config).

    Vocabulary rows past SRC's are padding (never sampled, dropped on export): they start
    as the mean of the real rows, whose logit is an average one, so the loss at step 0 is
    within ~0.1% of SRC's. So do the tokens the run has and SRC has not (a chat template's turn
    tokens, on a base model): SRC's padding rows there were trained never to be predicted.
    Position rows past the run's block_size are dropped.
    """
    try:
        loaded = model_of(src)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise fail(src, f"cannot load its weights ({e}); pass a complete copy") from e
    theirs, vocab, real = dict(loaded.named_parameters()), src.config.real_vocab_size, model.config.real_vocab_size
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied lm_head comes once, as wte
            w = theirs[name]
            if name in ("transformer.wte.weight", "lm_head.weight") and p.shape[1:] == w.shape[1:]:  # untied: its own
                rows, mean = min(len(p), len(w)), w[:vocab].mean(0)
                p[:rows] = w[:rows]
                p[rows:] = mean
                p[vocab:real] = mean  # tokens new to the model (none unless real > vocab): the mean row too
            elif name == "transformer.wpe.weight" and p.shape[1:] == w.shape[1:] and len(p) <= len(w):
                p.copy_(w[: len(p)])
            elif p.shape == w.shape:
                p.copy_(w)
            else:
                raise fail(
                    src,
                    f"{name} has shape {tuple(w.shape)}, the run needs {tuple(p.shape)}; "
                    "let the architecture come from the source (drop --n-layer/--n-head/--n-embd)",
                )

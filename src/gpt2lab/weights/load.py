"""Loading for inference: a model source (a hub name, an HF directory, a run dir or a checkpoint) -> a GPT
that carries its own tokenizer, read from the same source.

One reading of a source for all who take one: every command's ``--model``, export's ``SRC``,
train's ``--init-from`` (``source_kind``) and the Python API's ``gpt2lab.from_pretrained`` and
``gpt2lab.get_tokenizer`` (``load_model`` and ``source_tokenizer`` themselves).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from gpt2lab.checkpoint import store
from gpt2lab.data.tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerError,
    for_config,
    for_data,
    gpt2_tokenizer,
    load_tokenizer,
)
from gpt2lab.model.config import HUB_NAMES, config_value, model_from_config
from gpt2lab.model.gpt import GPT
from gpt2lab.system import rundir
from gpt2lab.system.errors import CheckpointError, ConfigError
from gpt2lab.weights import read
from gpt2lab.weights.read import MODEL_TYPES, WEIGHT_FILES, WeightsError

HUB, HF_DIR, CHECKPOINT = "hub", "hf_dir", "checkpoint"  # what source_kind says a source is


def is_hf_dir(path: str) -> bool:
    """An HF GPT-2 or NanoChat directory: its config.json says model_type gpt2 or nanochat and a weights
    file is there.

    gpt2lab checkpoints also hold config.json + model.safetensors, so the files alone do
    not tell the two apart; the config's model_type does.
    A config.json that cannot be read (cut short, not an object) beside a weights file counts
    as HF when no state.pt is there (every gpt2lab checkpoint has one), so that the loader's
    error names that config.json instead of calling the directory a damaged checkpoint.
    """
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config) or not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        return False
    try:
        with open(config) as f:
            return json.load(f).get("model_type") in MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return not os.path.exists(os.path.join(path, "state.pt"))


def source_kind(spec: str) -> str:
    """What the model source ``spec`` is: ``HF_DIR`` (a directory is_hf_dir accepts), ``CHECKPOINT``
    (any other directory: a run directory or one checkpoint, either layout) or ``HUB`` (a GPT-2
    name, gpt2 ... gpt2-xl or openai-community/...).

    A file, or a name that is neither a directory nor a hub name, raises WeightsError; its message
    does not repeat ``spec``: each caller puts the source first, as its user named it.
    """
    if os.path.isdir(spec):
        return HF_DIR if is_hf_dir(spec) else CHECKPOINT
    if os.path.exists(spec):
        raise WeightsError(
            "is a file; pass its directory (an HF model directory, a run directory or a checkpoint directory)"
        )
    if spec in HUB_NAMES or spec.startswith("openai-community/"):
        return HUB
    raise WeightsError(
        f"no such directory, and not a GPT-2 hub name ({', '.join(HUB_NAMES)}); pass an HF "
        "GPT-2 or NanoChat directory (config.json + model.safetensors), a run directory or a "
        "checkpoint directory"
    )


def load_model(spec: str, device: Optional[torch.device | str] = None, arg: Optional[str] = "--model") -> GPT:
    """The model named by ``spec``, in eval mode, on ``device`` (default cpu), holding its own tokenizer
    (``model.tokenizer``) where it has one.

    ``spec`` is anything ``source_kind`` names: a GPT-2 hub name, a local directory in HF layout,
    a gpt2lab run directory (its newest checkpoint) or checkpoint directory, full or sharded (put
    together in this process). A source that cannot become a GPT raises WeightsError (a DataError:
    the CLI prints one line, exit 1) naming it as the argument ``arg`` that gave it (``--model``,
    ``SRC`` for export's positional; ``None``: the source alone, as the Python API names it); a
    damaged checkpoint raises its own CheckpointError (exit 3), which names the checkpoint.
    """
    try:
        model = _load(spec, source_kind(spec))
    except CheckpointError:  # already one line naming the checkpoint; its own exit code
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # WeightsError is a ValueError
        what = _unnamed(str(e), spec)
        raise WeightsError(f"{arg} {spec}: {what}" if arg else f"{spec}: {what}") from e
    return model.to(device or "cpu").eval()


def _unnamed(message: str, spec: str) -> str:
    """``message`` without a leading ``spec: `` (a lower layer that named the source itself), so the
    source is named once, as the caller names it."""
    return message[len(spec) + 2 :] if message.startswith(f"{spec}: ") else message


def from_pretrained(source: str, device: Optional[torch.device | str] = None) -> GPT:
    """``gpt2lab.from_pretrained``: the model of anything ``gpt2lab sample --model`` takes, by the same
    loader (load_model): a GPT-2 hub name, an HF directory, a run directory, a checkpoint (full or
    sharded); in eval mode on ``device`` (default cpu), carrying its tokenizer. A bad source raises
    WeightsError naming it (CheckpointError for a damaged checkpoint), never SystemExit."""
    _check_source("from_pretrained", source)
    return load_model(os.fspath(source), device, arg=None)


def get_tokenizer(source: Optional[str] = None) -> Tokenizer:
    """``gpt2lab.get_tokenizer``: the tokenizer of anything ``from_pretrained`` takes, read from that same
    source without its weights (a trained tokenizer.json beside them, checked against the identity the
    model names; GPT-2's BPE, with its chat turn tokens for a chat model, otherwise); also of a prepared
    data directory or a ``gpt2lab tokenizer train`` directory or its tokenizer.json. No ``source``: GPT-2's BPE."""
    if source is None:
        return gpt2_tokenizer()
    _check_source("get_tokenizer", source)
    spec = os.fspath(source)
    try:
        return source_tokenizer(spec)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError) as e:  # WeightsError and TokenizerError are ValueErrors
        raise WeightsError(f"{spec}: {_unnamed(str(e), spec)}") from e


def _check_source(func: str, source: object) -> None:
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"{func}(source): a path or a hub name (str or os.PathLike), got {type(source).__name__}")
    if not os.fspath(source):
        raise WeightsError(f"{func}(''): an empty path; pass a path or a hub name")


def source_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of the model source (or prepared data, or tokenizer directory) ``spec``."""
    found = rundir.inspect(spec).kind
    if found == rundir.DATA:
        return for_data(spec)
    if found in (rundir.TOKENIZER, "file"):  # gpt2lab tokenizer train --out, or its tokenizer.json
        return load_tokenizer(spec)
    kind = source_kind(spec)
    if kind == HUB:
        return gpt2_tokenizer()
    if kind == HF_DIR:
        config_path = os.path.join(spec, "config.json")
        with open(config_path) as f:
            config, own = read.dir_config(json.load(f), config_path)
        return for_config(config, own)
    ckpt = store.checkpoint_in(spec)
    config = _checkpoint_config(ckpt)
    return for_config(config, _checkpoint_tokenizer(ckpt, config.tokenizer))


def from_checkpoint(path: str, verified: bool = False) -> GPT:
    """The GPT of a run directory (newest checkpoint) or of one checkpoint directory, either layout,
    with the tokenizer.json the checkpoint holds where the model has its own.

    A LoRA run's adapters are merged into the weights (a plain GPT comes back).
    ``verified``: its checksums were just checked (train's plan, which hashes once).
    """
    ckpt = store.checkpoint_in(path)
    if not verified:
        store.verify(ckpt)
    store.read_state(ckpt)  # its format version (config.json's is read with it)
    config = _checkpoint_config(ckpt)
    model = GPT(config, _checkpoint_tokenizer(ckpt, config.tokenizer))
    saved = store.read_config(ckpt)
    if config_value(saved, "lora_rank"):
        from gpt2lab.model.lora import add_lora, lora_args, merge_lora

        adapted = add_lora(model, *lora_args(saved))
        store.load_weights(model, ckpt, verified=True)
        return merge_lora(adapted)
    store.load_weights(model, ckpt, verified=True)
    return model


def _checkpoint_config(ckpt: str):
    try:
        return model_from_config(store.read_config(ckpt), f"{ckpt}/config.json")
    except ConfigError as e:
        raise store.damaged(ckpt, f"config.json describes no valid model ({e})") from e


def _checkpoint_tokenizer(ckpt: str, identity: Optional[str]):
    """A checkpoint's own tokenizer (its tokenizer.json, checked to be ``identity``); None for GPT-2's."""
    if identity is None:
        return None
    try:
        return load_tokenizer(os.path.join(ckpt, TOKENIZER_FILE), identity)
    except TokenizerError as e:
        raise store.damaged(ckpt, str(e)) from e


def _load(spec: str, kind: str) -> GPT:
    if kind == HF_DIR:
        return read.from_hf_dir(spec)
    if kind == CHECKPOINT:
        return from_checkpoint(spec)
    return read.from_hub(spec)

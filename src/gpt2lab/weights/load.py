"""Turn a model source into a GPT: a hub name, an HF directory, a run dir or a checkpoint.

One reading of a source for all who take one: every command's ``--model``, export's ``SRC``,
train's ``--init-from`` (``source_kind``) and the Python API's ``gpt2lab.from_pretrained``
(``load_model`` itself).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from gpt2lab.model.config import HUB_NAMES
from gpt2lab.weights import hf
from gpt2lab.weights.hf import MODEL_TYPES, WEIGHT_FILES, WeightsError
from gpt2lab.model.gpt import GPT
from gpt2lab.system.errors import CheckpointError

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
        raise WeightsError("is a file; pass its directory (an HF model directory, a run directory or a "
                           "checkpoint directory)")
    if spec in HUB_NAMES or spec.startswith("openai-community/"):
        return HUB
    raise WeightsError(f"no such directory, and not a GPT-2 hub name ({', '.join(HUB_NAMES)}); pass an HF "
                       "GPT-2 or NanoChat directory (config.json + model.safetensors), a run directory or a "
                       "checkpoint directory")


def load_model(spec: str, device: Optional[torch.device | str] = None, arg: Optional[str] = "--model") -> GPT:
    """The model named by ``spec``, in eval mode, on ``device`` (default cpu).

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
    return message[len(spec) + 2:] if message.startswith(f"{spec}: ") else message


def from_pretrained(source: str, device: Optional[torch.device | str] = None) -> GPT:
    """``gpt2lab.from_pretrained``: the model of anything ``gpt2lab sample --model`` takes, by the same
    loader (load_model): a GPT-2 hub name, an HF directory, a run directory, a checkpoint (full or
    sharded); in eval mode on ``device`` (default cpu). A bad source raises WeightsError naming it
    (CheckpointError for a damaged checkpoint), never SystemExit."""
    return load_model(source, device, arg=None)


def _load(spec: str, kind: str) -> GPT:
    if kind == HF_DIR:
        return hf.from_hf_dir(spec)
    if kind == CHECKPOINT:
        from gpt2lab.checkpoint import store as checkpoint

        return checkpoint.load_model(spec)
    return hf.from_hub(spec)

"""Turn a ``--model`` argument into a GPT: a hub name, an HF directory, a run dir or a checkpoint."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from gpt2lab.model.config import HUB_NAMES
from gpt2lab.weights.hf import WEIGHT_FILES
from gpt2lab.model.gpt import GPT



def is_hf_dir(path: str) -> bool:
    """An HF GPT-2 directory: its config.json says model_type gpt2 and a weights file is there.

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
            return json.load(f).get("model_type") == "gpt2"
    except (OSError, ValueError, AttributeError):
        return not os.path.exists(os.path.join(path, "state.pt"))


def load_model(spec: str, device: Optional[torch.device | str] = None, arg: str = "--model") -> GPT:
    """The model named by ``spec``, in eval mode, on ``device`` (default cpu).

    ``spec`` is an HF GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a local
    directory in HF layout, a gpt2lab run directory (newest checkpoint) or checkpoint dir.
    Anything else, or a source that cannot be read, exits with a message naming it as the
    command-line argument ``arg`` that gave it (``--model``, or ``SRC`` for export's positional).
    """
    from gpt2lab.system.errors import CheckpointError

    try:
        model = _load(spec, arg)
    except CheckpointError:  # already one line naming the checkpoint; its own exit code
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # includes hf.WeightsError
        raise SystemExit(f"{arg} {spec}: {e}") from e
    return model.to(device or "cpu").eval()


def _load(spec: str, arg: str) -> GPT:
    from gpt2lab.weights import hf

    if os.path.isdir(spec):
        if is_hf_dir(spec):
            return hf.from_hf_dir(spec)
        from gpt2lab.checkpoint import store as checkpoint

        return checkpoint.load_model(spec)
    if os.path.exists(spec):
        raise SystemExit(f"{arg} {spec}: is a file; pass its directory (an HF model dir, a run dir or a checkpoint dir)")
    if spec in HUB_NAMES or spec.startswith("openai-community/"):
        return hf.from_hub(spec)
    raise SystemExit(
        f"{arg} {spec}: no such directory, and not a GPT-2 hub name ({', '.join(HUB_NAMES)}). "
        "Pass an HF model directory (config.json + model.safetensors), a run directory or a checkpoint."
    )

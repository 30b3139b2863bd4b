"""Turn a ``--model`` argument into a GPT: a hub name, an HF directory, a run dir or a checkpoint."""
from __future__ import annotations

import os
from typing import Optional

import torch

from gpt2lab.model import GPT

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "pytorch_model.bin")
    )


def load_model(spec: str, device: Optional[torch.device | str] = None) -> GPT:
    """The model named by ``spec``, in eval mode, on ``device`` (default cpu).

    ``spec`` is an HF GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a local
    directory in HF layout, a gpt2lab run directory (newest checkpoint) or checkpoint dir.
    """
    from gpt2lab import hf

    if os.path.isdir(spec):
        if is_hf_dir(spec):
            model = hf.from_hf_dir(spec)
        else:
            from gpt2lab import checkpoint

            model = checkpoint.load_model(spec)
    elif os.path.exists(spec):
        raise SystemExit(f"--model {spec}: is a file; pass its directory (an HF model dir, a run dir or a checkpoint dir)")
    elif spec in HUB_NAMES or spec.startswith("openai-community/"):
        model = hf.from_hub(spec)
    else:
        raise SystemExit(
            f"--model {spec}: no such directory, and not a GPT-2 hub name ({', '.join(HUB_NAMES)}). "
            "Pass an HF model directory (config.json + model.safetensors), a run directory or a checkpoint."
        )
    return model.to(device or "cpu").eval()

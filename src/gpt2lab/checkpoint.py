"""Checkpoints: ``RUN/checkpoints/step_NNNNNN/`` holding everything to continue bit for bit.

Layout of one checkpoint (NNNNNN = optimizer steps completed):
  model.safetensors  weights (the tied lm_head is stored once, as wte)
  optimizer.pt       AdamW state (torch.save; read with weights_only=True)
  state.pt           step, tokens seen, loader state, RNG states (python, numpy, torch, cuda),
                     fp16 GradScaler state (None otherwise)
  config.json        the run's resolved TrainConfig
A checkpoint is written under a temporary name and renamed when complete, so any
``step_*`` directory is whole; the newest K are kept.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from gpt2lab.model import GPT, GPTConfig
from gpt2lab.tokenizer import GPT2_VOCAB_SIZE

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers


def clean_state_dict(state: dict) -> dict:
    """Drop wrapper prefixes and the tied lm_head copy; contiguous tensors for safetensors."""
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        if key != "lm_head.weight":
            out[key] = value.detach().contiguous()
    return out


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def save_checkpoint(run_dir: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    step: int, tokens: int, loader_state: dict, config: dict, keep: int = 0,
                    scaler_state: Optional[dict] = None) -> str:
    """Write the checkpoint for ``step`` completed steps atomically; prune to the newest ``keep``."""
    final = checkpoint_dir(run_dir, step)
    tmp = os.path.join(os.path.dirname(final), f".tmp_{os.path.basename(final)}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(clean_state_dict(model.state_dict()), os.path.join(tmp, "model.safetensors"))
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    torch.save({"step": step, "tokens": tokens, "loader": loader_state, "rng": rng_state(),
                "scaler": scaler_state}, os.path.join(tmp, "state.pt"))
    with open(os.path.join(tmp, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    if os.path.exists(final):  # the same step saved again (e.g. SIGTERM right after a save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints of a run, oldest first (temporary directories never match)."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    paths = [os.path.join(root, name) for _, name in sorted(found)]
    return [p for p in paths if os.path.isfile(os.path.join(p, "state.pt"))]


def find_latest(run_dir: str) -> Optional[str]:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resolve(path: str) -> str:
    """A checkpoint directory, given it or a run directory (then its newest checkpoint)."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    latest = find_latest(path)
    if latest is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint (no model.safetensors) nor a run "
                                "directory with checkpoints/step_*/; train first or pass a checkpoint dir")
    return latest


def model_config(config: dict) -> GPTConfig:
    return GPTConfig(block_size=config["block_size"], vocab_size=config["vocab_size"],
                     n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
                     token_vocab_size=min(GPT2_VOCAB_SIZE, config["vocab_size"]),
                     **{k: config.get(k, 0.0) for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop")})


def load_weights(model: torch.nn.Module, ckpt: str) -> None:
    state = clean_state_dict(load_file(os.path.join(ckpt, "model.safetensors")))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to wte, restored with it
    if missing or unexpected:
        raise ValueError(f"{ckpt}/model.safetensors does not fit the model in its config.json: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")


def read_config(ckpt: str) -> dict:
    """The run config saved with a checkpoint."""
    with open(os.path.join(ckpt, "config.json")) as fh:
        return json.load(fh)


def load_model(path: str) -> GPT:
    """The GPT of a run directory (newest checkpoint) or of one checkpoint directory.

    A LoRA run's adapters are merged into the weights (a plain GPT comes back).
    """
    ckpt = resolve(path)
    config = read_config(ckpt)
    model = GPT(model_config(config))
    if config.get("lora_rank"):
        from gpt2lab.lora import add_lora, lora_args, merge_lora

        adapted = add_lora(model, *lora_args(config))
        load_weights(model, ckpt)
        return merge_lora(adapted)
    load_weights(model, ckpt)
    return model


def load_training_state(ckpt: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore the optimizer; return step, tokens, loader state, RNG states and scaler state."""
    optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True,
                                         map_location="cpu"))
    return torch.load(os.path.join(ckpt, "state.pt"), weights_only=True, map_location="cpu")

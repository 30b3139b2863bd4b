"""Checkpoints: ``RUN/checkpoints/step_NNNNNN/`` holding everything to continue bit for bit.

Layout of one checkpoint (NNNNNN = optimizer steps completed):
  model.safetensors  weights (the tied lm_head is stored once, as wte)
  optimizer.pt       AdamW state (torch.save; read with weights_only=True)
  state.pt           step, tokens seen, loader state, RNG states (python, numpy, torch, cuda),
                     fp16 GradScaler state (None otherwise)
  config.json        the run's resolved TrainConfig, the architecture under "model" (files
                     written before it was nested are flat: config.model_from_config reads both)
  checksums.json     sha256 of each file above, verified when the checkpoint is loaded
A checkpoint is written under a temporary name and renamed when complete, so any
``step_*`` directory is whole; the newest K are kept. Bytes that change afterwards (a bad
disk, a copy cut short) fail the checksum: loading says the checkpoint is damaged.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from gpt2lab.errors import CheckpointError
from gpt2lab.files import atomic_dir, write_json
from gpt2lab.config import ConfigError, model_from_config
from gpt2lab.model import GPT

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers
CHECKSUMS = "checksums.json"
FILES = ("model.safetensors", "optimizer.pt", "state.pt", "config.json")
_DISK_FULL_NEXT = ("free some space (or lower --keep-checkpoints), then continue from the last "
                   "checkpoint with --resume auto")


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
                    scaler_state: Optional[dict] = None, extra: Optional[dict] = None) -> str:
    """Write the checkpoint for ``step`` completed steps atomically; prune to the newest ``keep``.

    ``extra`` (plain values) is stored in state.pt beside the step and comes back from
    ``load_training_state``. A full disk raises DiskFullError and leaves no temporary behind.
    """
    final = checkpoint_dir(run_dir, step)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with atomic_dir(final, what_next=_DISK_FULL_NEXT, replace=True) as tmp:  # replace: same step saved again
        save_file(clean_state_dict(model.state_dict()), os.path.join(tmp, "model.safetensors"))
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save({"step": step, "tokens": tokens, "loader": loader_state, "rng": rng_state(),
                    "scaler": scaler_state, **(extra or {})}, os.path.join(tmp, "state.pt"))
        write_json(os.path.join(tmp, "config.json"), config)
        write_json(os.path.join(tmp, CHECKSUMS), {name: sha256(os.path.join(tmp, name)) for name in FILES})
    if keep:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def verify(ckpt: str) -> None:
    """Raise CheckpointError unless every file matches the checksum written at save.

    Checkpoints from before checksums existed have no checksums.json and pass unchecked.
    """
    path = os.path.join(ckpt, CHECKSUMS)
    if not os.path.exists(path):
        return
    try:
        with open(path) as fh:
            expected = json.load(fh)
    except (OSError, ValueError) as e:
        raise damaged(ckpt, f"{CHECKSUMS} unreadable ({e})") from e
    for name, digest in expected.items():
        file = os.path.join(ckpt, name)
        if not os.path.isfile(file):
            raise damaged(ckpt, f"{name} is missing")
        if sha256(file) != digest:
            raise damaged(ckpt, f"{name} does not match its checksum (its bytes changed after saving)")


def damaged(ckpt: str, why: str) -> CheckpointError:
    """The one-line error for a damaged checkpoint, pointing at the intact ones before it."""
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    earlier = [p for p in list_checkpoints(run_dir) if step_of(p) < step_of(ckpt)]
    hint = (f"use an earlier one: --resume {earlier[-1]} (or --model {earlier[-1]})" if earlier
            else "no earlier checkpoint in this run; start again with a new --out")
    err = CheckpointError(f"checkpoint {ckpt} is damaged: {why}; {hint}")
    err.why = why
    return err


def step_of(path: str) -> int:
    """N of a ``step_N`` checkpoint directory (-1 for any other path)."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else -1


def find_intact(run_dir: str, report=None) -> Optional[str]:
    """The newest checkpoint that passes ``verify``; ``report(line)`` hears of each one skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify(path)
            return path
        except CheckpointError as e:
            if report is not None:
                report(f"checkpoint {path} is damaged ({getattr(e, 'why', e)}); trying the one before it")
    return None


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


def read_config(ckpt: str) -> dict:
    try:
        with open(os.path.join(ckpt, "config.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise damaged(ckpt, f"config.json unreadable ({e})") from e


def load_weights(model: torch.nn.Module, ckpt: str, verified: bool = False) -> None:
    """Load the checkpoint's weights into ``model``, checking checksums unless ``verified``.

    A model of another shape gets one line naming both shapes, not torch's size-mismatch list.
    """
    if not verified:
        verify(ckpt)
    try:
        state = clean_state_dict(load_file(os.path.join(ckpt, "model.safetensors")))
    except Exception as e:  # SafetensorError (truncated, bad header) has no common base with OSError
        raise damaged(ckpt, f"model.safetensors cannot be read ({_first_line(e)})") from e
    mine = {k: tuple(v.shape) for k, v in clean_state_dict(model.state_dict()).items()}
    theirs = {k: tuple(v.shape) for k, v in state.items()}
    if mine != theirs:
        raise CheckpointError(_mismatch(ckpt, model, mine, theirs))
    model.load_state_dict(state, strict=False)  # lm_head is tied to wte, restored with it


def _mismatch(ckpt: str, model: torch.nn.Module, mine: dict, theirs: dict) -> str:
    cfg = getattr(model, "config", None)
    want = ", ".join(f"{k} {v}" for k, v in cfg.shape().items()) if hasattr(cfg, "shape") else "unknown"
    try:
        have = ", ".join(f"{k} {v}" for k, v in model_from_config(read_config(ckpt)).shape().items())
    except (CheckpointError, ConfigError):
        have = "unknown (config.json unreadable)"
    diff = sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k] != theirs.get(k)]
    k = diff[0]
    return (f"checkpoint {ckpt} holds another model shape ({have}) than this one ({want}): e.g. {k} "
            f"is {theirs.get(k, 'absent')} there, {mine.get(k, 'absent')} here; resume with the "
            "checkpoint's model settings, or train this shape into a new --out")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def load_model(path: str) -> GPT:
    """The GPT of a run directory (newest checkpoint) or of one checkpoint directory.

    A LoRA run's adapters are merged into the weights (a plain GPT comes back).
    """
    ckpt = resolve(path)
    verify(ckpt)
    config = read_config(ckpt)
    try:
        model = GPT(model_from_config(config, f"{ckpt}/config.json"))
    except ConfigError as e:
        raise damaged(ckpt, f"config.json describes no valid model ({e})") from e
    if config.get("lora_rank"):
        from gpt2lab.lora import add_lora, lora_args, merge_lora

        adapted = add_lora(model, *lora_args(config))
        load_weights(model, ckpt, verified=True)
        return merge_lora(adapted)
    load_weights(model, ckpt, verified=True)
    return model


def load_training_state(ckpt: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore the optimizer; return step, tokens, loader state, RNG states and scaler state."""
    try:
        opt = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True, map_location="cpu")
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True, map_location="cpu")
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise damaged(ckpt, _first_line(e)) from e
    try:
        optimizer.load_state_dict(opt)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: its optimizer state does not fit this run "
                              f"({_first_line(e)}); resume with the checkpoint's settings") from e
    return state

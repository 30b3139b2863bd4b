"""Checkpoints: ``RUN/checkpoints/step_NNNNNN/`` holding everything to continue bit for bit.

A checkpoint is a dictionary of stateful parts, each with ``state_dict``/``load_state_dict``:
model, optimizer, loader, rng, scaler (None unless fp16) and trainer (step, tokens seen,
spike guard, skipped data). ``save`` and ``load`` handle every run the same way; only
where model and optimizer go depends on the model. Layout of one checkpoint (NNNNNN =
optimizer steps completed):

  full (a model every rank holds whole: one process, DDP), written by rank 0:
    model.safetensors  weights (the tied lm_head is stored once, as wte); with --ema-decay
                       their running average, the model every reader gets (sample, serve,
                       eval, export, --init-from)
    training.safetensors  only with --ema-decay: the weights as trained, which a resume continues
    optimizer.pt       AdamW state (torch.save; read with weights_only=True)
  sharded (an FSDP model), every rank writing its shard through torch.distributed.checkpoint:
    .metadata          DCP's index: which slice of which tensor lies in which file
    __R_0.distcp       rank R's slices of the weights ("model.*") and AdamW state ("optimizer.*")
  both:
    state.pt           the checkpoint's format_version (system/formats.py: CHECKPOINT), the
                       trainer's step, tokens, guard, skips and the record of the weights the
                       run began from (--init-from; train.gather reads it back) at the top
                       level, and "loader", "rng" (python, numpy, torch, cuda) and "scaler" entries
    config.json        the run's resolved TrainConfig, nested by section, with the run format's
                       format_version (system/formats.py: RUN)
    tokenizer.json     only for a model with its own tokenizer (GPTConfig.tokenizer): so the
                       checkpoint alone loads
    checksums.json     sha256 of each file above, verified when the checkpoint is loaded

A checkpoint is written under a temporary name and renamed when complete (a sharded one
by rank 0, after every rank has written), so any ``step_*`` directory is whole; the newest
K are kept. Bytes that change afterwards (a bad disk, a copy cut short) fail the checksum:
loading says the checkpoint is damaged. A sharded checkpoint resumes on any number of
ranks, and weights/load.py consolidates it in one process for sample, eval and export.
Every reader (``read_config``, ``read_state``) refuses a checkpoint of
another format version in one line (CheckpointError).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from gpt2lab.checkpoint import sharded
from gpt2lab.distributed import dist, parallel
from gpt2lab.model.config import model_from_config
from gpt2lab.system import formats
from gpt2lab.system.errors import CheckpointError, ConfigError
from gpt2lab.system.files import atomic_dir, read_json_object, sha256_file, write_json

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_WRAPPERS = re.compile(r"^(?:_orig_mod\.|module\.)+")  # torch.compile and DDP wrappers' prefixes
CHECKSUMS = "checksums.json"
_UNNAMED_PARTS = ("model", "optimizer", "trainer")  # the parts not under their own name in state.pt
TRAINING = "training.safetensors"  # beside model.safetensors when it holds the weight average
_DISK_FULL_NEXT = (
    "free some space (or lower --keep-checkpoints), then continue from the last checkpoint with --resume auto"
)


def clean_state_dict(state: dict) -> dict:
    """Drop wrapper prefixes and the tied lm_head copy (an untied head, its own tensor, stays);
    contiguous tensors for safetensors."""
    out = {_WRAPPERS.sub("", key): value for key, value in state.items()}
    head, wte = out.get("lm_head.weight"), out.get("transformer.wte.weight")
    if head is not None and wte is not None and head.data_ptr() == wte.data_ptr() and head.shape == wte.shape:
        del out["lm_head.weight"]
    return {key: value.detach().contiguous() for key, value in out.items()}


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


class RNG:
    """The process's random generators (python, numpy, torch, cuda) as a checkpoint part."""

    def state_dict(self) -> dict:
        kind, keys, *rest = np.random.get_state()
        state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), *rest], "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, *rest = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def save(
    run_dir: str, step: int, parts: Mapping[str, Any], config: dict, keep: int = 0, files: Sequence[str] = ()
) -> str:
    """Write ``parts`` as the checkpoint of ``step`` completed steps; prune to the newest ``keep``.

    Called on every rank. ``parts["model"]`` and ``parts["optimizer"]`` go to the backend:
    "full" (model.safetensors + optimizer.pt, written by rank 0) for a model every rank
    holds whole, "sharded" (DCP, every rank its shard) for an FSDP-sharded one. The other
    parts (None for one this run lacks) go to state.pt, written by rank 0 in both layouts.
    A weight average (``parts["average"]``, full layout only) takes model.safetensors; the
    model's own weights go to training.safetensors. ``files`` are copied in as they are (the model's
    tokenizer.json), checksummed like the rest.

    Every rank writes into rank 0's temporary directory; once all are done, the ranks hash the files
    between them, rank 0 writes checksums.json and renames. Any rank's failure makes every rank raise
    (none is left waiting); the temporary goes. A full disk raises DiskFullError.
    """
    final = checkpoint_dir(run_dir, step)
    model, optimizer, average = parts["model"], parts["optimizer"], parts.get("average")
    main, shards = dist.rank() == 0, parallel.is_sharded(model)
    done, error = False, None
    try:
        with contextlib.ExitStack() as stack:
            mine = None
            if main:
                try:
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    mine = stack.enter_context(atomic_dir(final, what_next=_DISK_FULL_NEXT))
                except Exception as e:  # re-raised below, once every rank knows
                    error = e
            tmp = dist.broadcast(mine)
            try:
                if tmp is not None and shards:
                    sharded.save(tmp, model, optimizer)  # collective: DCP raises on every rank if one fails
                if tmp is not None and main:
                    if not shards:
                        _save_full(tmp, model, optimizer, average)
                    # state.pt: the trainer's entries at the top, every other part under its name
                    plain = {k: p if p is None else p.state_dict() for k, p in parts.items() if k not in _UNNAMED_PARTS}
                    state = {**parts["trainer"].state_dict(), **plain}
                    torch.save(formats.stamp(state, formats.CHECKPOINT), os.path.join(tmp, "state.pt"))
                    write_json(os.path.join(tmp, "config.json"), formats.stamp(config, formats.RUN))
                    for path in files:
                        shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
            except Exception as e:
                error = e
            if dist.agree(error is not None):
                raise error or CheckpointError(f"checkpoint {final}: another rank failed to write it")
            digests = _digests(tmp)
            if main:
                write_json(os.path.join(tmp, CHECKSUMS), digests)
        done = True
    finally:
        failed = dist.agree(not done)  # reached by every rank: rank 0's rename is done or failed
    if failed:  # only ranks that did not raise themselves get here
        raise CheckpointError(f"checkpoint {final}: rank 0 could not complete it (see its error)")
    if main and keep:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _save_full(tmp: str, model, optimizer, average) -> None:
    """model.safetensors (the weight average where there is one; the weights as trained then go to
    training.safetensors) and optimizer.pt."""
    if average is not None:
        save_file(clean_state_dict(model.state_dict()), os.path.join(tmp, TRAINING))
    shown = model if average is None else average.module
    save_file(clean_state_dict(shown.state_dict()), os.path.join(tmp, "model.safetensors"))
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))


def _digests(folder: str) -> dict[str, str]:
    """sha256 of every file in ``folder``, the files spread over the ranks (each hashes 1/world)."""
    names = dist.broadcast(sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n))))
    mine = {n: sha256_file(os.path.join(folder, n)) for n in names[dist.rank() :: dist.world()]}
    return dict(sorted(item for part in dist.from_every_rank(mine) for item in part.items()))


def verify(ckpt: str) -> None:
    """Raise CheckpointError unless checksums.json lists every file of the checkpoint and every file
    matches the checksum written at save. One rule for every reader: a checksums.json missing (every
    checkpoint of this format has one), unreadable or leaving a file out makes the checkpoint damaged,
    named so (train then passes it over for the one before it, saying so; the others refuse it).
    """
    try:
        with open(os.path.join(ckpt, CHECKSUMS)) as fh:
            expected = json.load(fh)
    except (OSError, ValueError) as e:
        raise damaged(ckpt, f"{CHECKSUMS} unreadable ({getattr(e, 'strerror', None) or e})") from e
    held = sorted(n for n in os.listdir(ckpt) if n != CHECKSUMS and os.path.isfile(os.path.join(ckpt, n)))
    unlisted = [n for n in held if n not in expected] if isinstance(expected, dict) else held
    if unlisted or not isinstance(expected, dict):
        raise damaged(ckpt, f"{CHECKSUMS} leaves out {', '.join(unlisted) or 'every file'}")
    for name, digest in expected.items():
        file = os.path.join(ckpt, name)
        if not os.path.isfile(file):
            raise damaged(ckpt, f"{name} is missing")
        if sha256_file(file) != digest:
            raise damaged(ckpt, f"{name} does not match its checksum (its bytes changed after saving)")


def damaged(ckpt: str, why: str, flag: Optional[str] = "--resume") -> CheckpointError:
    """The one-line error for a damaged checkpoint, pointing at the one before it, as ``flag`` (the
    command's own, which named the checkpoint; None: the path alone) would name it."""
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    earlier = [p for p in list_checkpoints(run_dir) if step_of(p) < step_of(ckpt)]
    hint = (
        f"use an earlier one: {flag + ' ' if flag else ''}{earlier[-1]}"
        if earlier
        else "no earlier checkpoint in this run; start again with a new --out"
    )
    err = CheckpointError(f"checkpoint {ckpt} is damaged: {why}; {hint}")
    err.why = why
    return err


def step_of(path: str) -> int:
    """N of a ``step_N`` checkpoint directory (-1 for any other path)."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else -1


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints of a run, oldest first (temporary directories never match)."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    paths = [os.path.join(root, name) for _, name in sorted(found)]
    # whole: state.pt and what stands for its weights (for a sharded one the checksums written last, so a
    # sharded directory copied or written only in part never counts)
    return [p for p in paths if os.path.isfile(os.path.join(p, "state.pt")) and os.path.isfile(weights_file(p))]


def find_latest(run_dir: str) -> Optional[str]:
    return next(reversed(list_checkpoints(run_dir)), None)


def has_weights(path: str) -> bool:
    """Whether ``path`` is a checkpoint directory of either layout (not a run directory)."""
    return os.path.isfile(os.path.join(path, "model.safetensors")) or sharded.is_sharded_checkpoint(path)


def weights_file(ckpt: str) -> str:
    """The file that stands for a checkpoint's weights: model.safetensors, or for a sharded
    one checksums.json, which holds the sha256 of every shard (what --init-from records)."""
    return os.path.join(ckpt, CHECKSUMS if sharded.is_sharded_checkpoint(ckpt) else "model.safetensors")


def read_config(ckpt: str) -> dict:
    """The checkpoint's config.json, nested, without its format_version (one of another version is refused)."""
    path = os.path.join(ckpt, "config.json")
    config = read_json_object(path)
    if config is None:
        raise damaged(ckpt, "config.json is missing, unreadable or not a JSON object")
    return formats.unstamp(config, path, formats.RUN, CheckpointError)


def load_weights(model: torch.nn.Module, ckpt: str, verified: bool = False, name: str = "model.safetensors") -> None:
    """Load the checkpoint's weights (either layout) into ``model``, checking checksums unless ``verified``.

    A model of another shape gets one line naming both shapes, not torch's size-mismatch list.
    A sharded checkpoint is consolidated here, in this process alone. ``name``: the file of a
    full checkpoint (training.safetensors: the weights as trained, where model.safetensors
    holds their average).
    """
    if not verified:
        verify(ckpt)
    model.load_state_dict(_read_weights(ckpt, name, model), strict=False)  # a tied lm_head is wte, restored with it


def _read(ckpt: str, what: str, read):
    try:
        return read(ckpt)
    except Exception as e:  # SafetensorError, DCP's CheckpointException: no common base with OSError
        raise damaged(ckpt, f"{what} cannot be read ({_first_line(e)})") from e


def _read_weights(ckpt: str, name: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's weights as whole tensors (a full one's file ``name``; a sharded one's shards, consolidated),
    checked to fit ``model``'s shape."""
    if sharded.is_sharded_checkpoint(ckpt):
        state = _read(ckpt, "its shards", sharded.read_model)
    else:
        state = _read(ckpt, name, lambda c: clean_state_dict(load_file(os.path.join(c, name))))
    _check_shape(model, ckpt, {k: tuple(v.shape) for k, v in state.items()})
    return state


def _check_shape(model: torch.nn.Module, ckpt: str, theirs: dict) -> None:
    mine = {k: tuple(v.shape) for k, v in clean_state_dict(model.state_dict()).items()}  # DTensor: global shape
    if mine == theirs:
        return
    # one line: the shape fields that differ (only those), or, when the configs agree, a tensor that does not
    try:
        have = model_from_config(read_config(ckpt)).shape()
    except (CheckpointError, ConfigError):
        have = None
    want = model.config.shape() if have is not None else {}  # a GPT's (compiled, sharded or not)
    k = (sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k] != theirs.get(k)])[0]
    tensor = f"{k} is {theirs.get(k, 'absent')} there, {mine.get(k, 'absent')} here"
    fields = [
        f"{name} {have[name]} there, {value} here" for name, value in want.items() if have.get(name, value) != value
    ]
    # same config, other tensors: the config.json was written over (or the weights)
    config = "is unreadable, and" if have is None else "names this model's shape but its weights do not fit it:"
    what = "; ".join(fields) or f"its config.json {config} {tensor}"
    raise CheckpointError(
        f"checkpoint {ckpt} holds another model shape than this one: {what}; resume with the "
        "checkpoint's model settings, or train this shape into a new --out"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def read_state(ckpt: str) -> dict:
    """The checkpoint's state.pt (plain values only: weights_only), without its format_version
    (a checkpoint of another version is refused)."""
    state = _torch_load(ckpt, "state.pt")
    if not isinstance(state, dict):
        raise damaged(ckpt, f"state.pt holds no dict ({type(state).__name__})")
    return formats.unstamp(state, os.path.join(ckpt, "state.pt"), formats.CHECKPOINT, CheckpointError)


def _torch_load(ckpt: str, name: str):
    """A torch.save'd file of ``ckpt`` (plain values only: weights_only); unreadable: damaged."""
    try:
        return torch.load(os.path.join(ckpt, name), weights_only=True, map_location="cpu")
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise damaged(ckpt, _first_line(e)) from e


def load(ckpt: str, parts: Mapping[str, Any], verified: bool = False) -> None:
    """Restore every part from ``ckpt``: either layout, written by any number of ranks.

    Called on every rank. A sharded checkpoint is resharded to this run's ranks by DCP
    (onto a plain model too); a full one loads whole, or each rank keeps its slices of it
    when the model is sharded. ``verified``: its checksums were just checked (weights.load.checkpoint_of).
    The model continues from the weights as trained (training.safetensors where the
    checkpoint holds a weight average); a weight average part from model.safetensors, or,
    from a checkpoint without one, starts again from the model.
    """
    if not verified:  # on rank 0, its verdict on every rank
        dist.decided_on_rank_0(lambda: verify(ckpt))
    model, optimizer, average = parts["model"], parts["optimizer"], parts.get("average")
    state = read_state(ckpt)
    read_config(ckpt)  # its format version too (the run plan read its settings)
    averaged = os.path.isfile(os.path.join(ckpt, TRAINING))
    trained = TRAINING if averaged else "model.safetensors"
    if sharded.is_sharded_checkpoint(ckpt):
        meta = _read(ckpt, f"its index ({sharded.METADATA})", sharded.saved_model)
        _check_shape(model, ckpt, {name: shape for name, (shape, _) in meta.items()})
        sharded.load(ckpt, model, optimizer)
    elif parallel.is_sharded(model):  # a one-process or DDP checkpoint continued under FSDP
        weights = _read_weights(ckpt, trained, model)
        _load_optimizer(ckpt, lambda adam: sharded.load_full(model, optimizer, weights, adam))
    else:
        load_weights(model, ckpt, verified=True, name=trained)
        _load_optimizer(ckpt, optimizer.load_state_dict)
    if average is not None and averaged:
        load_weights(average.module, ckpt, verified=True)
    elif average is not None:  # none saved (--ema-decay added on resume): the next step starts it again
        average.module.load_state_dict(model.state_dict())
        average.load_state_dict({"n_averaged": 0})
        state.pop("average", None)
    own = {k: v for k, v in state.items() if k not in parts}  # the trainer's entries sit at the top
    for name, part in parts.items():
        value = own if name == "trainer" else state.get(name)
        if name not in ("model", "optimizer") and part is not None and value is not None:
            part.load_state_dict(value)


def _load_optimizer(ckpt: str, apply: Callable[[dict], None]) -> None:
    """optimizer.pt, handed to ``apply`` (one fitting error for both of its callers)."""
    opt = _torch_load(ckpt, "optimizer.pt")
    try:
        apply(opt)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt}: its optimizer state does not fit this run "
            f"({_first_line(e)}); resume with the checkpoint's settings"
        ) from e

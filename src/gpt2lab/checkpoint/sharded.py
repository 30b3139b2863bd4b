"""The sharded checkpoint backend: model and optimizer through torch.distributed.checkpoint (DCP).

Every rank writes its own shard of the weights and AdamW moments (``__R_0.distcp``);
DCP's coordinator (rank 0) writes ``.metadata``, the index of which slice of which tensor
lies where. Loading asks DCP for the slices this process holds now, so a checkpoint written
by N ranks loads on M (resharding), on one process without a process group too. The
state dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict``, which
names FSDP's DTensors and a plain module's tensors alike (``transformer.h.0...``): the
same calls serve a sharded and an unsharded model.

The checkpoint directory is written under rank 0's temporary name, completed by rank 0
(checksums, then the rename) after every rank has finished: a checkpoint killed half-way
stays a ``.tmp_*`` directory that nothing ever chooses.
"""

from __future__ import annotations

import os
import warnings

import torch

from gpt2lab.system.errors import CheckpointError

METADATA = ".metadata"  # DCP's index file; its presence marks a sharded checkpoint
TIED = "lm_head.weight"  # the same tensor as transformer.wte.weight: stored once, as wte
WTE = "transformer.wte.weight"


def is_sharded_checkpoint(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, METADATA))


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, bool]:
    """Model and optimizer state dicts keyed by parameter name, as this process holds them;
    the tied lm_head taken out of the model's (and whether it was there)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    # an untied head (GPTConfig.tie_embeddings false) is a tensor of its own: it stays
    tied = getattr(getattr(model, "config", None), "tie_embeddings", True)
    return msd, osd, tied and msd.pop(TIED, None) is not None


def save(tmp: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: write its shard of the model and optimizer into the directory ``tmp``."""
    import torch.distributed.checkpoint as dcp

    msd, osd, _ = _state_dicts(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp)


def saved_model(ckpt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (global shape, dtype) of every model tensor in a sharded checkpoint (from its index)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return {
        k.removeprefix("model."): (tuple(v.size), v.properties.dtype)
        for k, v in meta.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


def read_model(ckpt: str) -> dict[str, torch.Tensor]:
    """The whole model state of a sharded checkpoint as plain tensors, read by this process alone.

    This is the consolidation ``sample``, ``eval`` and ``export`` use: no process group,
    every shard read (the optimizer's entries are not).
    """
    state = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in saved_model(ckpt).items()}
    _dcp_load({"model": state}, ckpt, no_dist=True)
    return state


def _dcp_load(state: dict, ckpt: str, **options) -> None:
    """DCP's load of ``state`` from ``ckpt``, without its warning in one process ("assuming the intent is
    to load in a single process")."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=ckpt, **options)


def load(ckpt: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: load model and optimizer from a sharded checkpoint, resharded to this world.

    The model's shape was checked against ``saved_model`` by the caller; an optimizer
    that does not fit (another set of trained parameters) is a CheckpointError.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    msd, osd, tied = _state_dicts(model, optimizer)
    try:
        _dcp_load({"model": msd, "optimizer": osd}, ckpt)
    except Exception as e:  # CheckpointException: DCP's errors have no common base with OSError
        text = str(e).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {ckpt}: cannot load its model and optimizer shards "
            f"({text[-1] if text else type(e).__name__}); resume with the checkpoint's settings"
        ) from e
    if tied:
        msd[TIED] = msd[WTE]  # the tie: one tensor under both names, as get_state_dict gave it
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def load_full(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict, adam: dict) -> None:
    """Every rank: a full checkpoint's whole tensors into a sharded model, each rank keeping its slices.

    ``adam`` is ``optimizer.state_dict()`` as a one-process or DDP run saved it (parameters
    by index); the same model and parameter groups give the indices their names.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {p: name for name, p in model.named_parameters()}
    groups, state = [], {}
    for ours, theirs in zip(optimizer.param_groups, adam["param_groups"], strict=True):
        for p, index in zip(ours["params"], theirs["params"], strict=True):
            if index in adam["state"]:
                state[names[p]] = adam["state"][index]
        groups.append({**theirs, "params": [names[p] for p in ours["params"]]})
    if WTE in weights and TIED not in weights:  # tied: stored once, as wte
        weights = {**weights, TIED: weights[WTE]}
    adam = {"state": state, "param_groups": groups}
    options = StateDictOptions(full_state_dict=True)
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=adam, options=options)

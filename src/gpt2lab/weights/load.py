"""Model sources: what a source is, which checkpoint of a run is read, and the GPT it becomes.

The one reading of a model source for everyone who takes one: every command's ``--model``, export's
``SRC``, train's ``--init-from`` and ``--resume`` (train.gather.find_resume), and the Python API
(``gpt2lab.from_pretrained``, ``GPT.from_pretrained``, ``gpt2lab.get_tokenizer``). A source is a GPT-2
hub name (``HUB``), a Hugging Face GPT-2 or NanoChat directory (``HF_DIR``), or a gpt2lab run directory
or one of its checkpoints, either layout (``CHECKPOINT_DIR``). ``model_source`` reads what it is, its architecture
and its own tokenizer, without its weights; ``model_of`` reads the weights into a GPT.

One checkpoint rule (``checkpoint_of``): a run directory is read at its newest intact checkpoint
(checksums verified), each damaged one passed over named in one line (a warning, which the CLI prints
as one line on stderr; ``train`` prints its own); a checkpoint directory named itself must be intact,
else it is refused, naming the flag that named it and the intact checkpoint before it.

An HF directory of model_type gpt2 (weights/gpt2.py maps it) or nanochat (weights/nanochat.py) becomes a GPT
holding exactly its tensors, with the trained tokenizer beside it (a gpt2lab export's, or one saved again
by transformers) or none (GPT-2's BPE). The hub is reached only for GPT-2's names and owner/repo ids, and
not at all under HF_HUB_OFFLINE. huggingface_hub and safetensors are imported inside the functions that
need them, so ``import gpt2lab`` stays cheap.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from gpt2lab.checkpoint import store
from gpt2lab.data import chat
from gpt2lab.data.bpe import open_dir, tokenizer_in
from gpt2lab.data.tokenizer import (
    EOT_TOKEN,
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerError,
    TrainedBPE,
    for_config,
    for_data,
    gpt2_tokenizer,
    load_tokenizer,
)
from gpt2lab.model.config import HUB_NAMES, GPTConfig, config_value, model_from_config
from gpt2lab.model.gpt import GPT
from gpt2lab.model.lora import add_lora, merge_lora  # peft is imported only where a run used it
from gpt2lab.system import env, rundir
from gpt2lab.system.errors import CheckpointError, ConfigError, DataError
from gpt2lab.system.files import read_json_object
from gpt2lab.weights import gpt2, nanochat
from gpt2lab.weights.targets import GPT2_HF, NANOCHAT_HF

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
MODEL_TYPES = (GPT2_HF.model_type, NANOCHAT_HF.model_type)  # the config.json model_types that load


class WeightsError(DataError):
    """A model source (an HF directory or file, a hub download, or anything weights.load is given)
    that cannot become a GPT; the message names it and says why."""


def model_from_state_dict(
    config: GPTConfig, sd: dict[str, torch.Tensor], where: str, tokenizer: Optional[Tokenizer] = None
) -> GPT:
    """A GPT holding exactly the tensors of ``sd`` (gpt2lab names), without a random init first, with
    ``tokenizer`` (its own, where it has one)."""
    with torch.device("meta"):
        model = GPT(config, tokenizer)  # no memory, no init: every tensor comes from sd
    tied = config.tie_embeddings
    expected = {k for k in model.state_dict() if k != "lm_head.weight" or not tied}
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise WeightsError(
            f"{where}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, t in model.state_dict().items():
        if key in sd and sd[key].shape != t.shape:
            raise WeightsError(f"{where}: {key} has shape {tuple(sd[key].shape)}, config needs {tuple(t.shape)}")
    model.load_state_dict({k: v.contiguous() for k, v in sd.items()}, assign=True, strict=not tied)  # checked above
    if tied:  # the head is wte's matrix: tie it to the Parameter assigned there
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if path.endswith(".safetensors"):
        return load_file(path)
    if path.endswith(".index.json"):
        with open(path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return {k: t for shard in shards for k, t in load_file(os.path.join(os.path.dirname(path), shard)).items()}
    # weights_only: a pickle from the internet must not be able to run code.
    return torch.load(path, map_location="cpu", weights_only=True)


def hf_config(config_path: str) -> tuple[GPTConfig, Optional[TrainedBPE]]:
    """An HF directory's architecture, from its config.json (GPT-2's or NanoChat's; an option gpt2lab's
    model does not have is a WeightsError naming the file), naming the tokenizer beside it and its chat
    template; and that tokenizer where it is a trained one (``tokenizer_in``), else None: GPT-2's."""
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightsError(
            f"{config_path}: not a readable JSON config ({e}); restore the file (download or export the model again)"
        ) from e
    if not isinstance(cfg, dict):
        raise WeightsError(f"{config_path}: holds {type(cfg).__name__}, not a JSON object; restore the file")
    kind = cfg.get("model_type", GPT2_HF.model_type)
    if kind not in MODEL_TYPES:
        raise WeightsError(f"{config_path}: model_type {kind!r} is not gpt2 or nanochat")
    try:
        config = nanochat.config_from_nanochat(cfg) if kind == NANOCHAT_HF.model_type else gpt2.config_from_gpt2(cfg)
    except (ValueError, TypeError) as e:
        raise WeightsError(f"{config_path}: {e}") from e
    path = os.path.dirname(config_path)
    fix = "put the model's own tokenizer.json back (or GPT-2's vocab.json and merges.txt alone), or export it again"
    tok = tokenizer_in(path, fix, config.real_vocab_size)
    template = chat_template_of(path, trained=tok is not None)  # the tokenizer's turn tokens: a chat model
    return replace(config, tokenizer=tok.identity if tok else None, chat_template=template), tok


def chat_template_of(path: str, trained: bool = False) -> Optional[str]:
    """The chat template of an HF directory's tokenizer: "chatml" when its tokenizer_config.json adds
    <|im_start|> and <|im_end|> at gpt2lab's ids (data/chat.py), as a chat export writes them; for a
    ``trained`` tokenizer (which always has them) when it carries gpt2lab's template; else None."""
    tok = read_json_object(os.path.join(path, "tokenizer_config.json")) or {}
    if trained:
        return chat.TEMPLATE if tok.get("chat_template") == chat.CHAT_TEMPLATE else None
    added = tok.get("added_tokens_decoder")
    if not isinstance(added, dict):
        return None
    have = {str(v.get("content")): k for k, v in added.items() if isinstance(v, dict)}
    ours = all(have.get(t) == str(i) for t, i in chat.special_tokens(gpt2_tokenizer()).items() if t != EOT_TOKEN)
    return chat.TEMPLATE if ours else None


def hub_files(name: str) -> tuple[str, str]:
    """Local paths of a hub model's config.json and model.safetensors (downloaded or cached)."""
    from huggingface_hub import hf_hub_download

    repo = f"openai-community/{name}" if name in HUB_NAMES else name
    offline = env.hub_offline()
    try:
        config_path = hf_hub_download(repo, "config.json", local_files_only=offline)
        weights_path = hf_hub_download(repo, "model.safetensors", local_files_only=offline)
    except Exception as e:  # the hub raises many types (HTTP, offline, not cached, not found)
        how = "offline (HF_HUB_OFFLINE is set) and not in the cache" if offline else "could not be downloaded"
        raise WeightsError(
            f"{repo}: {how} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"Pass a local directory instead, e.g. one made on a connected machine with "
            f"`gpt2lab export {name} DIR` or `hf download {repo} --local-dir DIR`, "
            "holding config.json and model.safetensors (or pytorch_model.bin)."
        ) from e
    return config_path, weights_path


HUB, HF_DIR, CHECKPOINT_DIR = "hub", "hf_dir", "checkpoint"  # what source_kind says a source is


@dataclass
class Source:
    """A model source as ``model_source`` read it: everything but its weights."""

    spec: str  # as the user gave it
    kind: str  # HUB, HF_DIR or CHECKPOINT_DIR
    config: GPTConfig  # its architecture
    tokenizer: Optional[TrainedBPE]  # its own tokenizer, read beside it; None: GPT-2's BPE
    weights: str  # the weights file (a checkpoint's model.safetensors; a sharded one's checksums.json)
    step: Optional[int] = None  # steps the checkpoint had completed
    flag: Optional[str] = "--model"  # how the user named it, for messages (None: the source alone)

    @property
    def where(self) -> str:
        """The directory read: the HF directory, the hub's cache folder, or the checkpoint (verified)."""
        return os.path.dirname(self.weights)


def source_kind(spec: str) -> str:
    """What the model source ``spec`` is: ``HF_DIR``, ``CHECKPOINT_DIR`` (any other directory: a run
    directory or one checkpoint, either layout) or ``HUB`` (a GPT-2 name, gpt2 ... gpt2-xl or
    openai-community/...).

    An HF directory is one whose config.json says model_type gpt2 or nanochat, with a weights file beside
    it (gpt2lab checkpoints also hold config.json + model.safetensors: the model_type tells the two apart).
    A config.json that cannot be read beside a weights file counts as HF when no state.pt is there (every
    gpt2lab checkpoint has one), so that the loader's error names that config.json.

    A file, a name that is neither a directory nor a hub name, an HF config.json without weights or one of
    another model_type raises WeightsError; its message does not repeat ``spec``: each caller puts the
    source first, as its user named it.
    """
    if os.path.isdir(spec):
        config = read_json_object(os.path.join(spec, "config.json"))
        kind = (config or {}).get("model_type")
        weights = any(os.path.isfile(os.path.join(spec, f)) for f in WEIGHT_FILES)
        if kind is not None and kind not in MODEL_TYPES:
            raise WeightsError(
                f"model_type {kind!r} is not GPT-2 or NanoChat; pass a model of model_type gpt2 or nanochat"
            )
        if kind is not None and not weights:
            raise WeightsError(
                f"an HF {kind} config.json without a weights file (looked for {', '.join(WEIGHT_FILES)}); "
                "copy the weights beside it"
            )
        unreadable = config is None and os.path.isfile(os.path.join(spec, "config.json"))
        hf = kind is not None or (unreadable and weights and not os.path.exists(os.path.join(spec, "state.pt")))
        return HF_DIR if hf else CHECKPOINT_DIR
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


def _warn(line: str) -> None:
    warnings.warn(line, stacklevel=3)


def checkpoint_of(path: str, flag: Optional[str] = "--model", report: Callable[[str], None] = _warn) -> str:
    """The checkpoint the directory ``path`` stands for, by the one rule (module docstring), checksums
    verified: ``path`` itself when it is a checkpoint, refused when damaged (advice in ``flag``, how the
    user named it); a run directory's newest intact checkpoint, ``report`` hearing of each damaged one
    passed over. Neither, or a run whose every checkpoint is damaged: WeightsError / CheckpointError."""
    if store.has_weights(path):
        missing = [f for f in ("state.pt", "config.json") if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise WeightsError(
                f"it is an incomplete checkpoint (missing: {', '.join(missing)}); pass its run directory "
                "(its newest complete checkpoint) or another step_* directory"
            )
        try:
            store.verify(path)
        except CheckpointError as e:
            raise store.damaged(path, e.why, flag) from None
        return path
    checkpoints = store.list_checkpoints(path)
    for found in reversed(checkpoints):  # the newest that passes verify
        try:
            store.verify(found)
            return found
        except CheckpointError as e:
            report(f"checkpoint {found} is damaged ({e.why}); trying the one before it")
    if checkpoints:
        raise CheckpointError(
            f"{path}: every checkpoint is damaged (each named above); train again, or pass another source"
        )
    raise WeightsError(
        "neither a checkpoint (model.safetensors or a sharded .metadata, with state.pt), a run directory "
        "with a complete checkpoint (checkpoints/step_*/) nor an HF model directory (config.json + "
        "model.safetensors); check the path, or train first"
    )


def model_source(spec: str, flag: Optional[str] = "--model", report: Callable[[str], None] = _warn) -> Source:
    """The source ``spec`` read without its weights: its kind, architecture and own tokenizer, and which
    files hold it (a run directory: its newest intact checkpoint, ``checkpoint_of``). A source that is
    none of the three raises WeightsError, a damaged checkpoint CheckpointError (its own exit code)."""
    kind = source_kind(spec)
    if kind == CHECKPOINT_DIR:
        ckpt = checkpoint_of(spec, flag, report)
        step, path = store.read_state(ckpt).get("step"), os.path.join(ckpt, "config.json")  # its format version too
        try:
            config = model_from_config(store.read_config(ckpt), path)
            tok = load_tokenizer(os.path.join(ckpt, TOKENIZER_FILE), config.tokenizer) if config.tokenizer else None
        except TokenizerError as e:  # its own tokenizer.json, checked to be the one config.json names
            raise store.damaged(ckpt, str(e)) from e
        except ConfigError as e:
            raise store.damaged(ckpt, f"config.json describes no valid model ({e})") from e
        return Source(spec, kind, config, tok, store.weights_file(ckpt), step, flag)
    if kind == HF_DIR:
        path = os.path.join(spec, "config.json")
        weights = next(os.path.join(spec, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(spec, f)))
    else:
        path, weights = hub_files(spec)  # offline: WeightsError saying how to pass a local directory
    return Source(spec, kind, *hf_config(path), weights, flag=flag)


def model_of(src: Source) -> GPT:
    """The GPT of a resolved source, holding its tokenizer; a LoRA run's adapters merged (a plain GPT)."""
    if src.kind != CHECKPOINT_DIR:  # an HF weights file (.safetensors, index, or .bin)
        try:
            sd = _read_weights(src.weights)
        except Exception as e:  # safetensors' SafetensorError shares no base with OSError/ValueError
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise WeightsError(
                f"{src.weights}: cannot be read ({why}); the file is damaged or cut short: "
                "download or export the model again"
            ) from e
        # NanoChat's config always sets embed_norm (config_from_nanochat), GPT-2's never
        ours = nanochat.from_nanochat_state_dict if src.config.embed_norm else gpt2.from_hf_state_dict
        return model_from_state_dict(src.config, ours(sd, src.config), src.weights, src.tokenizer)
    model, saved = GPT(src.config, src.tokenizer), store.read_config(src.where)
    rank, alpha, targets = (config_value(saved, name) for name in ("lora_rank", "lora_alpha", "lora_targets"))
    adapted = add_lora(model, int(rank), float(alpha), targets) if rank else None
    store.load_weights(model, src.where, verified=True)  # a LoRA run's weights: the base's and its adapters
    return merge_lora(adapted) if adapted is not None else model


def named(flag: Optional[str], spec: str, error: Exception) -> str:
    """``error``'s message about the source ``spec``, naming it once, as ``flag`` did (None: the source alone)."""
    what = str(error).removeprefix(f"{spec}: ")
    return f"{flag} {spec}: {what}" if flag else f"{spec}: {what}"


def load_model(spec: str, device: Optional[torch.device | str] = None, arg: Optional[str] = "--model") -> GPT:
    """The model named by ``spec`` (anything ``model_source`` reads), in eval mode, on ``device`` (default cpu),
    holding its own tokenizer (``model.tokenizer``) where it has one.

    A source that cannot become a GPT raises WeightsError (a DataError: the CLI prints one line, exit 1)
    naming it as the argument ``arg`` that gave it (``--model``, ``SRC`` for export's positional;
    ``None``: the source alone, as the Python API names it); a damaged checkpoint raises its own
    CheckpointError (exit 3), which names the checkpoint.
    """
    try:
        model = model_of(model_source(spec, arg))
    except CheckpointError:  # already one line naming the checkpoint; its own exit code
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # WeightsError is a ValueError
        raise WeightsError(named(arg, spec, e)) from e
    return model.to(device or "cpu").eval()


def from_pretrained(source: str, device: Optional[torch.device | str] = None) -> GPT:
    """``gpt2lab.from_pretrained`` (and ``GPT.from_pretrained``): the model of anything ``gpt2lab sample
    --model`` takes, by the same loader (load_model): a GPT-2 hub name, an HF directory, a run directory,
    a checkpoint (full or sharded); in eval mode on ``device`` (default cpu), carrying its tokenizer. A
    bad source raises WeightsError naming it (CheckpointError for a damaged checkpoint), never SystemExit."""
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
        found = rundir.inspect(spec).kind
        if found == rundir.DATA:
            return for_data(spec)
        if found in (rundir.TOKENIZER, "file"):  # gpt2lab tokenizer train --out, or its tokenizer.json
            return open_dir(spec, None)
        if source_kind(spec) == HUB:  # GPT-2's, with no download
            return gpt2_tokenizer()
        src = model_source(spec, None)
        return for_config(src.config, src.tokenizer)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError) as e:  # WeightsError and TokenizerError are ValueErrors
        raise WeightsError(named(None, spec, e)) from e


def _check_source(func: str, source: object) -> None:
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"{func}(source): a path or a hub name (str or os.PathLike), got {type(source).__name__}")
    if not os.fspath(source):
        raise WeightsError(f"{func}(''): an empty path; pass a path or a hub name")

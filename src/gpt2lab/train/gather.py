"""What a run's plan is made from, read from the outside world once, into plain data.

``gather`` is the only part of planning that touches files, checksums or the hub; train.plan then
decides from its result alone. It reads, in this order:

- the checkpoint to resume (one rule, the newest intact one: ``find_resume``, checksums verified),
  its config.json, and, for a run that began from other weights, that checkpoint read as a source
  (its architecture) and the record of the weights it began from (its state.pt's ``init_from``);
- the ``--init-from`` source of a fresh run, resolved (the Hugging Face cache or hub for a name),
  its config read and its weights hashed once (``InitFrom``);
- the data's manifest, and the tokenizer.json it names (present and the one named).

``detect_machine`` reads this machine's facts (``MachineFacts``); ``GPT2LAB_FAKE_FACTS=FILE.json``
replaces them (for ``--dry-run`` only: ``fake_machine``) to see the plan of a machine one does not
have, e.g. ``{"device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "cuda_bf16": true,
"world_size": 8, "device_gib": 79.1}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.distributed import parallel
from gpt2lab.model.config import config_value
from gpt2lab.system import env, runtime
from gpt2lab.system.errors import ConfigError
from gpt2lab.train import init_from
from gpt2lab.weights.load import WeightsError, checkpoint_of, named


# -- the machine ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MachineFacts:
    """What the plan depends on about the machine (``detect_machine``, ``fake_machine``, or made up in tests)."""

    device: runtime.Facts  # device type and name, CPU flags, bf16, compiler, probe
    world_size: int = 1  # processes of the run (torchrun's WORLD_SIZE)
    device_bytes: Optional[int] = None  # memory of one accelerator; None for a CPU (shared RAM)
    faked: Optional[str] = None  # the GPT2LAB_FAKE_FACTS file these came from
    host_bytes: Optional[int] = None  # a CPU run's share of this machine's RAM per process; None: unknown

    def describe(self) -> str:
        d = self.device
        mem = f", {self.device_bytes / 2**30:.1f} GiB each" if self.device_bytes else ""
        return f"{d.device_type} x {self.world_size} ({d.device_name or 'unknown'}{mem})" + (
            f" [faked by {env.FAKE_FACTS}={self.faked}]" if self.faked else ""
        )

    def memory(self) -> tuple[Optional[int], str]:
        """The memory one process of the run may fill, in bytes (None: unknown) and in words: a GPU's, else
        the process's share of this machine's RAM (what the plan predicts against, train.plan.check_memory)."""
        cuda = self.device.device_type == "cuda"
        limit = self.device_bytes if cuda else self.host_bytes
        gib = f"{(limit or 0) / 2**30:.1f} GiB"
        each = f" per process ({self.world_size})" if self.world_size > 1 else ""
        gpu = f"the {gib} of {self.device.device_name or 'the GPU'}"
        return limit, gpu if cuda else f"this machine's {gib} of RAM{each}"


def detect_machine(device, world_size: int = 1, dtype: str = "auto") -> MachineFacts:
    """This machine's facts for a run on ``device`` (the CPU probe only when ``dtype`` needs it)."""
    import torch

    dev = torch.device(device)
    facts = runtime.detect(dev, probe=str(dtype) in ("auto", "bfloat16"))
    host = host_share(world_size) if dev.type == "cpu" else None
    return MachineFacts(facts, world_size, parallel.device_bytes(dev), host_bytes=host)


def host_share(world_size: int) -> Optional[int]:
    """A CPU process's share of this machine's RAM (None where the OS does not say): the processes of this
    node (torchrun's LOCAL_WORLD_SIZE) share it."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return total // max(1, env.launch().local_world_size or world_size)


def fake_machine(path: str) -> MachineFacts:
    """Facts from a JSON file (GPT2LAB_FAKE_FACTS): device_type, device_name, cpu_flags, cuda_bf16,
    can_compile, probe {fp32_gflops, bf16_gflops}, world_size, device_gib or device_bytes, host_gib."""
    try:
        with open(path) as fh:
            raw = json.load(fh)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        extra = ("world_size", "device_gib", "device_bytes", "host_gib")
        known = sorted({f.name for f in dataclasses.fields(runtime.Facts)}.union(extra))
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        world, gib, host_gib = int(raw.pop("world_size", 1)), raw.pop("device_gib", None), raw.pop("host_gib", None)
        mem = raw.pop("device_bytes", None if gib is None else int(float(gib) * 2**30))
        probe = raw.pop("probe", None)
        raw["cpu_flags"] = tuple(raw.get("cpu_flags", ()))
        dev = runtime.Facts(**raw, probe=runtime.Probe(**probe) if probe else None)
        if dev.device_type not in ("cpu", "cuda", "mps") or world < 1:
            raise ValueError(f"device_type {dev.device_type!r} (cpu, cuda or mps), world_size {world} (>= 1)")
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{env.FAKE_FACTS}={path}: cannot use it ({e}); see gpt2lab.train.gather") from e
    host = None if host_gib is None else int(float(host_gib) * 2**30 / world)
    return MachineFacts(dev, world, None if mem is None else int(mem), faked=path, host_bytes=host)


# -- what the files hold -------------------------------------------------------------------------
@dataclass(frozen=True)
class InitFrom:
    """The resolved --init-from source and its provenance (hashed once, by ``gather``)."""

    source: init_from.Source
    sha256: str

    @property
    def id(self) -> str:
        s = self.source
        return f"sha256:{self.sha256}" if s.step is None else f"step {s.step}, sha256:{self.sha256}"

    def record(self) -> dict:
        s = self.source
        return {
            "source": s.spec,
            "kind": s.kind,
            "weights": os.path.abspath(s.weights),
            "sha256": self.sha256,
            "step": s.step,
            "id": self.id,
        }


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run continues from, as read."""

    where: str  # its directory (checksums verified)
    saved: dict  # its config.json, either form
    source: Optional[init_from.Source] = None  # a run begun from other weights: the checkpoint read as a source
    began: Optional[dict] = None  # and the record of the weights it began from (its state.pt's)


@dataclass(frozen=True)
class Gathered:
    """Everything train.plan decides from besides the request: plain data, made up freely in tests."""

    machine: MachineFacts
    resumed: Optional[Resumed] = None
    skipped: tuple[str, ...] = ()  # damaged checkpoints passed over, one line each
    init: Optional[InitFrom] = None  # --init-from of a fresh run
    manifest: Mapping = field(default_factory=dict)  # the data's manifest.json ({}: none, or no data here)
    val_start: Optional[str] = None  # the start of the first validation document (asked for: ``val_start``)


def gather(
    machine: MachineFacts,
    *,
    out: str,
    resume: Optional[str],
    source: Optional[str],
    data: str,
    report: Callable[[str], None],
    resume_with: str = "--resume auto",
    prompt_from_data: bool = False,
) -> Gathered:
    """Read what a run's plan needs (the module docstring's list): ``out`` the run directory, ``resume``
    as ``--resume`` gave it, ``source`` the --init-from value asked for, ``data`` the data directory.
    ``report`` hears of each damaged checkpoint passed over as it is found; ``resume_with`` is how the
    user continues the run (advice in errors); ``prompt_from_data``: read the start of the data's first
    validation document (the samples' prompt, train.plan.sample_prompt). Raises the first problem found."""
    from gpt2lab.data.shards import read_manifest
    from gpt2lab.data.tokenizer import data_tokenizer, for_data

    skipped: list[str] = []

    def skip(line: str) -> None:
        skipped.append(line)
        report(line)

    resumed, init = None, None
    where = find_resume(out, resume, skip, resume_with)
    if where is not None:
        saved = ckpt.read_config(where)
        src = began = None
        if config_value(saved, "init_from"):  # begun from other weights: the architecture is the checkpoint's
            src = init_from.find_source(where)
            src.flag = "--resume"
            began = ckpt.read_state(where).get("init_from") or None  # the record the Trainer saved in state.pt
        if source:  # the command that began it, repeated: the same weights, or refused naming both
            same_source(str(source), where, config_value(saved, "init_from"), began)
        resumed = Resumed(where, saved, src, began)
    elif source:
        src = init_from.find_source(str(source))
        init = InitFrom(src, init_from.digest(src))
    manifest = read_manifest(data)
    if data_tokenizer(manifest):  # its tokenizer.json is there and is the one named
        for_data(data)
    start = val_start(data, manifest) if prompt_from_data and manifest else None
    return Gathered(machine, resumed, tuple(skipped), init, manifest, start)


# Tokens of a text prompt taken from the data: the start of a line or a sentence, enough to show what
# the text is and leave the rest to the model; a count of tokens, so the same on any text.
PROMPT_TOKENS = 8


def val_start(data: str, manifest: Mapping) -> Optional[str]:
    """The start of ``data``'s first validation document, decoded with the data's tokenizer: its first
    PROMPT_TOKENS tokens, or for conversations its first user message; None without a validation split
    (or an empty first document)."""
    from gpt2lab.data.shards import list_shards, open_shard
    from gpt2lab.data.tokenizer import for_data
    from gpt2lab.system.errors import DataError

    try:
        shards = list_shards(data, "val")
    except DataError:
        return None
    if not shards:
        return None
    enc = for_data(data)
    ids = [int(t) for t in open_shard(shards[0])[:4096]]
    while ids and ids[0] == enc.eot_id:  # every document starts with <|endoftext|>
        ids = ids[1:]
    doc = ids[: ids.index(enc.eot_id)] if enc.eot_id in ids else ids
    if "chat_template" not in manifest:
        return enc.decode(doc[:PROMPT_TOKENS]) or None
    user = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", enc.decode(doc), re.S)  # role\ncontent, in turns
    return user.group(1) if user and user.group(1).strip() else None


def same_source(source: str, where: str, began_as: Optional[str], began: Optional[dict]) -> None:
    """A resume given ``--init-from SOURCE`` too (the command that began the run, with --resume auto):
    fine when SOURCE is the weights the run began from (``began``, the checkpoint ``where``'s record:
    the same spelling resolving to the same file, else the same sha256); else refused naming both."""
    if not began_as:
        raise ConfigError(
            f"--init-from {source}: the checkpoint {where} belongs to a run that began from scratch; "
            "resume it without --init-from, or start a new run in another --out"
        )
    src = init_from.find_source(source)
    if began and source == began.get("source") and os.path.abspath(src.weights) == began.get("weights"):
        return
    now = InitFrom(src, init_from.digest(src))  # its weights hashed once
    if began and now.sha256 == began.get("sha256"):
        return
    was = f"{began_as} ({began['id']})" if began and began.get("id") else began_as
    raise ConfigError(
        f"--init-from {source} ({now.id}): the run of {where} began from {was}, other weights; "
        f"resume it with --init-from {began_as} (or without --init-from), or start a new run in another --out"
    )


def find_resume(out: str, resume: Optional[str], report: Callable[[str], None], resume_with: str) -> Optional[str]:
    """The checkpoint a run continues from, by the loader's one rule (weights.load.checkpoint_of: the
    newest intact one, checksums verified).

    ``resume`` None: none, and a run directory that already has checkpoints is refused (naming
    ``resume_with``, how to continue it); "auto": ``out``'s (None if it has none); a run directory or a
    checkpoint directory: its. A path that is not there is a usage error. ``report`` hears of each
    damaged checkpoint passed over.
    """
    if resume is None:
        if ckpt.find_latest(out):
            raise ConfigError(f"{out} already has checkpoints; continue it with {resume_with} or choose another --out")
        return None
    if resume == "auto":
        return checkpoint_of(out, "--resume", report) if ckpt.find_latest(out) else None
    if not os.path.isdir(resume):
        raise ConfigError(
            f"--resume {resume}: no such directory; pass auto (the newest checkpoint in --out), a run "
            "directory or a checkpoint directory"
        )
    try:
        return checkpoint_of(resume, "--resume", report)
    except WeightsError as e:
        raise ConfigError(named("--resume", resume, e)) from None

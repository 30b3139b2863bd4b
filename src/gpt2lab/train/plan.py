"""The run plan: every start-up decision of ``gpt2lab train``, made once.

``make_plan(request, facts)`` is a pure function of what the user asked for (preset values,
flags, ``--resume``) and the machine's facts (device, its bf16 and compiler, the number of
processes, one device's memory). It decides, each with its reason where there is one:

- the checkpoint to resume: one rule, the newest intact one (``find_resume``); the run's
  architecture comes from that same checkpoint when it began from other weights;
- the ``--init-from`` source, found once and hashed once (``InitFrom``), and for a resumed run
  the record of the weights it began from, read back from its checkpoint (``began_from``);
- the final ``TrainConfig`` (the source's architecture); a resume whose settings differ from its
  checkpoint's in anything that changes what it trains (``resume_fields``: the fields marked
  ``keep`` in train.config, the architecture's) is refused here, from the checkpoint's config read once;
- the memory per rank it predicts (``check_memory``, a start's check, refuses what does not fit);
- dtype and compile (``system.runtime``), strategy (``distributed.parallel.choose_strategy``
  with DDP's memory from ``distributed.memplan``), the loss path (``choose_loss``);
- accumulation steps, peak FLOP/s for MFU, the predicted memory per rank.

Under torchrun, rank 0 makes the plan and hands it to the others in one broadcast
(``train.run``); the Trainer builds from it and decides nothing. The plan is printed at
start, written to ``run_info.json`` and is all that ``gpt2lab train --dry-run`` shows.

``detect_facts`` reads the facts of this machine; ``GPT2LAB_FAKE_FACTS=FILE.json`` replaces
them (for ``--dry-run`` only) to see the plan of a machine one does not have, e.g.
``{"device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "cuda_bf16": true,
"world_size": 8, "device_gib": 79.1}``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.distributed import memplan, parallel
from gpt2lab.model.config import GPTConfig, padded_vocab
from gpt2lab.model.loss import used_for
from gpt2lab.system import hardware, runtime
from gpt2lab.system.errors import CheckpointError, ConfigError
from gpt2lab.system.runtime import Choice
from gpt2lab.train import init_from
from gpt2lab.train.config import SECTIONS, TrainConfig, config_value, default_value, merge_config, nest_config
from gpt2lab.weights.targets import export_target

FAKE_FACTS_ENV = "GPT2LAB_FAKE_FACTS"
PLAN_VERSION = 1


# -- the inputs ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Facts:
    """What the plan depends on about the machine (``detect_facts``, or made up in tests)."""
    device: runtime.Facts                  # device type and name, CPU flags, bf16, compiler, probe
    world_size: int = 1                    # processes of the run (torchrun's WORLD_SIZE)
    device_bytes: Optional[int] = None     # memory of one accelerator; None for a CPU (shared RAM)
    faked: Optional[str] = None            # the GPT2LAB_FAKE_FACTS file these came from
    host_bytes: Optional[int] = None       # a CPU run's share of this machine's RAM per process; None: unknown

    def describe(self) -> str:
        d = self.device
        mem = f", {self.device_bytes / 2**30:.1f} GiB each" if self.device_bytes else ""
        return (f"{d.device_type} x {self.world_size} ({d.device_name or 'unknown'}{mem})"
                + (f" [faked by {FAKE_FACTS_ENV}={self.faked}]" if self.faked else ""))


@dataclass(frozen=True)
class Request:
    """What the user asked for: preset values with the flags over them (nested as config.json,
    any form accepted: ``nest_config``), not yet validated."""
    values: Mapping[str, object]
    # architecture values the user gave himself (and vocab_size, which otherwise follows the tokenizer)
    explicit: Mapping[str, object] = field(default_factory=dict)
    resume: Optional[str] = None           # None, "auto" or a run/checkpoint directory
    source: str = "config"                 # for messages: "preset 'x' with overrides"

    @classmethod
    def of(cls, cfg: TrainConfig, resume: Optional[str] = None) -> "Request":
        """A TrainConfig as a request: every architecture value counts as given (adapt_config's rule)."""
        explicit = {name: getattr(cfg.model, name) for name in (*init_from.ARCH_FIELDS, "vocab_size")}
        values = cfg.to_dict()
        if cfg.model.tokenizer is None:  # GPT-2's count, derived (train.config): the data's template may add to it
            values["model"].pop("token_vocab_size", None)
        return cls(values, explicit, resume)

    def get(self, name: str) -> object:
        """A field as asked for, by its flat name (``"dtype"``), else its default."""
        return config_value(self.values, name, default_value(name))

    @property
    def out(self) -> str:
        return str(self.get("out"))


@dataclass(frozen=True)
class InitFrom:
    """The resolved --init-from source and its provenance (hashed once, here)."""
    source: init_from.Source
    sha256: str

    @property
    def id(self) -> str:
        s = self.source
        return f"sha256:{self.sha256}" if s.step is None else f"step {s.step}, sha256:{self.sha256}"

    def record(self) -> dict:
        s = self.source
        return {"source": s.spec, "kind": s.kind, "weights": os.path.abspath(s.weights), "sha256": self.sha256,
                "step": s.step, "id": self.id}


# -- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunPlan:
    config: TrainConfig                    # final: the architecture filled in
    facts: Facts
    resume: Optional[str]                  # the checkpoint to continue from (checksums verified)
    skipped: tuple[str, ...]               # damaged checkpoints passed over, one line each
    init: Optional[InitFrom]               # --init-from of a fresh run (None when resuming)
    dtype: Choice
    compile: Choice
    strategy: Choice
    loss: Choice                           # value "chunked" or "fused"
    peak_flops: Choice                     # value: FLOP/s per device, or None
    accum: int                             # micro-steps per optimizer step
    params: int                            # parameters of the model (before LoRA)
    memory: Optional[dict]                 # memplan's prediction per rank, MiB by term
    ns_dtype: Optional[Choice] = None      # Muon's Newton-Schulz dtype (None: the run has no Muon)
    began: Optional[dict] = None           # a resumed run's init-from record, from its checkpoint (began_from)
    supervised: Optional[tuple[int, int]] = None  # conversations: (assistant tokens, all tokens) of train

    @property
    def choices(self) -> runtime.Resolved:
        return runtime.Resolved(self.dtype, self.compile, self.facts.device, self.ns_dtype)

    @property
    def export(self) -> str:
        """What ``gpt2lab export`` will write for this run's model, or why nothing (weights/targets.py)."""
        return export_target(self.config.model).describe()

    @property
    def init_record(self) -> Optional[dict]:
        """run_info.json's "init_from": this run's source, or the one a resumed run began from."""
        return self.init.record() if self.init is not None else self.began

    def record(self) -> dict:
        """run_info.json's "plan" entry (plain JSON)."""
        c = self.config
        choice = lambda ch: {"value": ch.value, "reason": ch.reason,  # noqa: E731
                             **({"warning": ch.warning} if ch.warning else {})}
        return {"version": PLAN_VERSION, "facts": {**self.choices.record(), "world_size": self.facts.world_size,
                                                   "device_bytes": self.facts.device_bytes,
                                                   "host_bytes": self.facts.host_bytes,
                                                   "faked": self.facts.faked},
                "resume": self.resume, "skipped_checkpoints": list(self.skipped), "init_from": self.init_record,
                "dtype": choice(self.dtype), "compile": choice(self.compile), "strategy": choice(self.strategy),
                "loss": choice(self.loss), "peak_flops": choice(self.peak_flops),
                "muon_ns_dtype": choice(self.ns_dtype) if self.ns_dtype else None,
                "activation_checkpointing": c.parallel.activation_checkpointing, "grad_accum_steps": self.accum,
                "params": self.params, "memory_mib": self.memory, "supervised": self.supervised,
                "export": self.export,
                "config": c.to_dict()}

    def lines(self) -> list[str]:
        """What start-up prints (and --dry-run shows), one decision a line."""
        c, m, ft = self.config, self.config.model, self.config.finetune
        on = lambda v: "on" if v else "off"  # noqa: E731
        mem = "no prediction for this device"
        if self.memory:
            f, have = self.facts, ""
            if f.device_bytes:
                have = f" of the device's {f.device_bytes / 2**30:.1f} GiB"
            elif f.host_bytes:
                have = f" of this machine's {f.host_bytes / 2**30:.1f} GiB of RAM" + (
                    " per process" if f.world_size > 1 else "")
            mem = f"{self.memory['total'] / 1024:.2f} GiB per rank predicted{have} (peak at {self.memory['phase']})"
        peak = self.peak_flops.value
        b = c.batch
        ramp = (f"; ramped from {b.batch_ramp_start:,} tokens ({c.accum_at(0, self.facts.world_size)} micro-steps) "
                f"at step 0 over {b.batch_ramp_steps} steps" if b.batch_ramp_steps else "")
        out = [f"out       {c.out}" + (f" (resume from {self.resume})" if self.resume else " (new run)"),
               f"machine   {self.facts.describe()}",
               f"model     {m.n_layer} layers, {m.n_head} heads, {m.n_embd} wide, block {m.block_size}, "
               f"{self.params:,} params" + (f", LoRA rank {ft.lora_rank} on {ft.lora_targets}" if ft.lora_rank else ""),
               f"export    {self.export}"]
        if m.tokenizer:
            out.append(f"tokenizer sha256:{m.tokenizer[:12]} (the data's): {m.token_vocab_size:,} tokens in "
                       f"{m.vocab_size:,} embedding rows")
        if self.supervised:
            n, total = self.supervised
            out.append(f"data      {c.data}: conversations in the {m.chat_template} template, supervised on "
                       f"{n:,} of {total:,} tokens ({n / max(total, 1):.0%}: the assistant's turns)")
        out += [f"skipped   {line}" for line in self.skipped]
        if self.init_record:
            r = self.init_record
            out.append(f"init from {r['source']} ({r.get('kind', 'recorded by the run')}, {r['id']})")
        out += [f"dtype     {self.dtype.value} ({self.dtype.reason})",
                f"compile   {on(self.compile.value)} ({self.compile.reason})",
                f"strategy  {self.strategy.value} ({self.strategy.reason})"
                + ("; activation checkpointing on" if c.parallel.activation_checkpointing else ""),
                f"loss      {self.loss.value} ({self.loss.reason})",
                f"optimizer {c.optim.optimizer}"
                + (f" ({c.optim.muon_variant})" if c.optim.muon_variant != "muon" else "") + f", {c.optim.lr_schedule} schedule"
                + (f"; Newton-Schulz in {self.ns_dtype.value} ({self.ns_dtype.reason})" if self.ns_dtype else "")
                + (f"; weight average (EMA) {c.optim.ema_decay}: evaluations and checkpoints hold it"
                   if c.optim.ema_decay else ""),
                f"batch     {c.batch.total_batch_tokens:,} tokens/step = micro-batch {c.batch.micro_batch_size} "
                f"x seq {c.batch.seq_len} x {self.facts.world_size} process(es) x {self.accum} micro-steps{ramp}; "
                f"steps to {c.optim.max_steps}",
                "peak      " + (f"{peak / 1e12:.0f} TFLOP/s per device ({self.peak_flops.reason})" if peak
                                 else f"unknown ({self.peak_flops.reason}); no MFU"),
                f"memory    {mem}"]
        out += [f"warning: {ch.warning}" for ch in (self.dtype, self.compile) if ch.warning]
        return out


# -- the decisions: pure functions of (request, facts) ---------------------------------------
def find_resume(out: str, resume: Optional[str], report: Callable[[str], None] = lambda line: None) -> Optional[str]:
    """The checkpoint a run continues from: the newest intact one (checksums verified here).

    ``resume`` None: none, and a run directory that already has checkpoints is refused;
    "auto": the newest intact checkpoint of ``out`` (None if it has none); a run directory:
    its newest intact one; a checkpoint directory: that one, which must be intact.
    ``report`` hears of each damaged checkpoint passed over.
    """
    if resume is None:
        if ckpt.find_latest(out):
            raise ConfigError(f"{out} already has checkpoints; continue it with --resume auto "
                              "or choose another --out")
        return None
    if ckpt.has_weights(resume):
        ckpt.verify(resume)
        return resume
    run_dir = out if resume == "auto" else resume
    found = ckpt.find_intact(run_dir, report=report)
    if found is None and ckpt.find_latest(run_dir):
        raise CheckpointError(f"{run_dir}: every checkpoint is damaged; start again with a new --out")
    if found is None and resume != "auto":
        raise CheckpointError(f"--resume {resume}: neither a checkpoint (no model.safetensors or sharded "
                              ".metadata) nor a run directory with checkpoints/step_*/; pass a checkpoint "
                              "directory or --resume auto")
    return found


def choose_loss(device_type: str, compiled: bool, sharded: bool) -> Choice:
    """The loss path: "chunked" (model.loss's chunked cross-entropy) or "fused" (logits +
    F.cross_entropy inside the compiled graph); model.loss.used_for is the rule."""
    if not used_for(device_type, compiled, sharded):
        return Choice("fused", "compiled on CUDA: inductor fuses the cross-entropy into the model's graph")
    if sharded and compiled and device_type == "cuda":
        return Choice("chunked", "FSDP: the root, which computes the loss, is not compiled, so the full "
                                 "logits would be held eagerly")
    if device_type == "cpu":
        return Choice("chunked", "CPU: never holding the fp32 logits measured faster")
    return Choice("chunked", f"{device_type}, not compiled: F.cross_entropy would hold the logits in fp32")


def choose_peak_flops(requested: Optional[float], facts: Facts) -> Choice:
    if requested:
        return Choice(float(requested), "asked for with --peak-flops")
    if facts.device.device_type != "cuda":
        return Choice(None, f"no datasheet figure for a {facts.device.device_type}")
    found = hardware.peak_flops(facts.device.device_name)
    if found is None:
        return Choice(None, f"{facts.device.device_name!r} is not in gpt2lab.system.hardware's table; "
                            "pass --peak-flops")
    return Choice(found, f"datasheet dense bf16 of {facts.device.device_name}")


def choose_strategy(cfg: TrainConfig, facts: Facts, dtype: str, accum: int, compiled: bool) -> Choice:
    """ddp or fsdp (parallel.choose_strategy); on GPUs DDP's per-rank memory from memplan."""
    ddp_bytes = None
    if facts.device_bytes is not None and facts.world_size > 1:
        ddp_bytes = _predict(cfg, facts, "ddp", dtype, accum, compiled).total
    return parallel.choose_strategy(cfg.parallel.strategy, world_size=facts.world_size,
                                    device_type=facts.device.device_type, dtype=dtype,
                                    lora=bool(cfg.finetune.lora_rank), ddp_bytes=ddp_bytes,
                                    device_bytes=facts.device_bytes)


def _predict(cfg: TrainConfig, facts: Facts, strategy: str, dtype: str, accum: int, compiled: bool):
    device = "cuda" if facts.device.device_type == "cuda" else "cpu"
    return memplan.predict(cfg.model, strategy=strategy, world_size=facts.world_size,
                           micro_batch=cfg.batch.micro_batch_size, seq_len=cfg.batch.seq_len, dtype=dtype,
                           activation_checkpointing=cfg.parallel.activation_checkpointing, accum=accum,
                           device=device, compiled=compiled, optimizer=cfg.optim.optimizer,
                           muon_variant=cfg.optim.muon_variant, average=bool(cfg.optim.ema_decay))


def make_plan(request: Request | TrainConfig, facts: Facts, resume: Optional[str] = None,
              report: Optional[Callable[[str], None]] = None) -> RunPlan:
    """Every start-up decision of a run (see the module docstring); raises the first problem found.

    A TrainConfig is taken as a request whose architecture values are all given (``Request.of``).
    ``report`` hears of damaged checkpoints passed over as they are found (default: stderr).
    """
    req = request if isinstance(request, Request) else Request.of(request, resume)
    skipped: list[str] = []

    def skip(line: str) -> None:
        skipped.append(line)
        (report or _to_stderr)(line)

    where = find_resume(req.out, req.resume, skip)
    values, init, began = nest_config(req.values, req.source), None, None
    if where is not None:
        saved = ckpt.read_config(where)
        source = config_value(saved, "init_from")
        if source:  # a run that began from other weights: its architecture is its checkpoint's
            arch = init_from.source_arch(where, req.explicit, flag="--resume")
            values = merge_config(values, {"init_from": source, "model": arch}, source=req.source)
            began = began_from(where)
    elif config_value(values, "init_from"):
        src = init_from.find_source(str(config_value(values, "init_from")))
        arch = init_from.check_arch(src, req.explicit)
        init = InitFrom(src, init_from.digest(src))
        values = merge_config(values, {"model": arch}, source=req.source)
    template = chat_template(values, init, saved if where is not None else None)
    if template:
        values = merge_config(values, {"model": {"chat_template": template}}, source=req.source)
    model = tokenizer_fields(values, req, init, (where, saved) if where is not None else None)
    if model:
        values = merge_config(values, {"model": model}, source=req.source)
    cfg = _config(values, req, init)
    if where is not None:
        check_resume_settings(cfg, saved, where)
    accum = cfg.grad_accum_steps(facts.world_size)
    cfg.accum_at(0, facts.world_size)  # the batch ramp's start divides evenly too (raises if not)
    muon = cfg.optim.optimizer == "muon"
    choices = runtime.resolve(facts.device.device_type, cfg.system.dtype, cfg.system.compile, facts=facts.device,
                              ns_dtype=cfg.optim.muon_ns_dtype if muon else None)
    dtype, compiled = str(choices.dtype.value), bool(choices.compile.value)
    strategy = choose_strategy(cfg, facts, dtype, accum, compiled)
    sharded = strategy.value == "fsdp" and facts.world_size > 1
    memory = None
    if facts.device.device_type in ("cuda", "cpu"):
        memory = _predict(cfg, facts, str(strategy.value), dtype, accum, compiled).to_dict()
    return RunPlan(config=cfg, facts=facts, resume=where, skipped=tuple(skipped), init=init,
                   dtype=choices.dtype, compile=choices.compile, strategy=strategy,
                   loss=choose_loss(facts.device.device_type, compiled, sharded),
                   peak_flops=choose_peak_flops(cfg.system.peak_flops, facts), accum=accum,
                   params=memplan.param_counts(cfg.model)["total"], memory=memory, ns_dtype=choices.ns_dtype,
                   began=began, supervised=supervised_tokens(cfg.data))


def check_memory(plan: RunPlan) -> None:
    """Refuse a run whose predicted peak (memplan, per process) exceeds this machine's memory: the GPU's,
    or a CPU run's share of the RAM; name the largest --micro-batch-size that fits. (A start's check,
    after the data's: the plan itself describes any machine.)"""
    cfg, facts = plan.config, plan.facts
    cuda = facts.device.device_type == "cuda"
    limit = facts.device_bytes if cuda else facts.host_bytes

    def total_at(B: int) -> int:
        c = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, micro_batch_size=B))
        return _predict(c, facts, str(plan.strategy.value), str(plan.dtype.value),
                        c.grad_accum_steps(facts.world_size), bool(plan.compile.value)).total

    if limit is None or not plan.memory or memplan.fits(total_at(cfg.batch.micro_batch_size), limit):
        return
    b, world = cfg.batch, facts.world_size
    rows = max(1, b.total_batch_tokens // (b.seq_len * world))  # a micro-batch must divide a step's rows
    fit = next((B for B in range(min(b.micro_batch_size - 1, rows), 0, -1)
                if rows % B == 0 and memplan.fits(total_at(B), limit)), None)
    have = (f"the {limit / 2**30:.1f} GiB of {facts.device.device_name or 'the GPU'}" if cuda
            else f"this machine's {limit / 2**30:.1f} GiB of RAM" + (f" per process ({world})" if world > 1 else ""))
    fix = (f"lower --micro-batch-size to {fit} ({total_at(fit) / 2**30:.1f} GiB predicted)" if fit
           else "not even a micro-batch of 1 fits: a smaller model or a larger machine")
    if not cfg.parallel.activation_checkpointing:
        fix += " or set --activation-checkpointing true"
    raise ConfigError(f"--micro-batch-size {b.micro_batch_size}: the run is predicted to need "
                      f"{total_at(b.micro_batch_size) / 2**30:.1f} GiB per process at its peak "
                      f"({plan.memory['phase']}), more than {have}; {fix}")


def resume_fields(cfg: TrainConfig) -> list[str]:
    """The settings a resumed run must keep, by flat name: each field marked ``keep`` (train.config)
    that applies to ``cfg``, and every architecture field that sets no shape (a checkpoint's shapes
    are checked when it loads, naming the shape fields that differ: exit 3)."""
    out = [f.name for f in dataclasses.fields(GPTConfig) if not (f.metadata["shape"] or f.metadata["derived"])]
    for owner in [TrainConfig, *(section for name, section in SECTIONS.items() if name != "model")]:
        for f in dataclasses.fields(owner):
            keep = f.metadata.get("keep")
            if keep is True or (callable(keep) and keep(cfg)):
                out.append(f.name)
    return out


_ABSENT = object()


def check_resume_settings(cfg: TrainConfig, saved: dict, where: str) -> None:
    """A resume whose settings differ from those its checkpoint trained with (``saved``: its config.json,
    either form) in anything that changes what the run trains (``resume_fields``) is refused in one
    line naming each such field, both values and the flags to resume with; config.json is never
    rewritten with another value. A field a config.json written before it existed lacks counts as
    its default, what that version trained with."""
    mine = cfg.to_dict()
    differ = []
    for name in resume_fields(cfg):
        theirs = config_value(saved, name, _ABSENT)
        theirs = default_value(name) if theirs is _ABSENT else theirs
        ours = config_value(mine, name)
        if theirs != ours:
            differ.append((name, theirs, ours))
    if not differ:
        return
    flags = lambda side: " ".join(f"--{n.replace('_', '-')} {_flag_text(v[side])}" for n, *v in differ)  # noqa: E731
    was = ", ".join(f"{n} {_flag_text(theirs)}" for n, theirs, _ in differ)
    raise ConfigError(f"{flags(1)}: the checkpoint {where} was trained with {was}; resume with {flags(0)}, "
                      "or start a new run in another --out")


def _flag_text(value) -> str:
    """A value as its flag takes it (true/false, none)."""
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def supervised_tokens(data: str) -> Optional[tuple[int, int]]:
    """(assistant tokens, all tokens) of a conversation directory's train split; None for text."""
    from gpt2lab.data.shards import read_manifest

    train = read_manifest(data).get("splits", {}).get("train", {})
    return (int(train["supervised"]), int(train["tokens"])) if "supervised" in train else None


def chat_template(values: dict, init: Optional[InitFrom], saved: Optional[dict]) -> Optional[str]:
    """The run's chat template: its data's (conversations prepared in one), else that of the model it
    began from (--init-from, or the resumed checkpoint's config), else None: a base model."""
    from gpt2lab.data.shards import read_manifest

    found = read_manifest(str(config_value(values, "data", default_value("data")))).get("chat_template")
    if found:
        return str(found)
    if init is not None:
        return init.source.config.chat_template
    return config_value(saved, "chat_template") if saved else None


def tokenizer_fields(values: dict, req: Request, init: Optional[InitFrom],
                     resumed: Optional[tuple[str, dict]]) -> dict:
    """The run's tokenizer as model fields (empty for GPT-2's): its data's (``gpt2lab prepare
    --tokenizer``), which must be the tokenizer of the model it continues (an --init-from source's, a
    resumed checkpoint's; refused in one line naming both); without data here (a dry run planning for
    another machine), that model's. The vocabulary follows it (padded to a multiple of 128) unless
    --vocab-size was given, or a resumed run had another."""
    from gpt2lab.data.shards import read_manifest
    from gpt2lab.data.tokenizer import GPT2, for_data, short

    data = str(config_value(values, "data", default_value("data")))
    manifest = read_manifest(data)
    theirs, n, whose = None, None, None  # the tokenizer, its vocabulary and the model it continues
    if init is not None:
        src = init.source
        theirs, n, whose = src.config.tokenizer, src.config.real_vocab_size, f"--init-from {src.spec}"
    elif resumed is not None:
        where, saved = resumed
        theirs, n = config_value(saved, "tokenizer"), config_value(saved, "token_vocab_size")
        whose = f"the checkpoint {where}"
    if manifest:
        found = manifest.get("tokenizer", GPT2)
        ours = None if found == GPT2 else str(found)
        if ours is not None:  # its tokenizer.json is there and is the one the manifest names
            for_data(data)
        if whose is not None and ours != theirs:
            fix = (f"prepare it with that model's tokenizer (gpt2lab prepare --tokenizer DIR, DIR holding its "
                   "tokenizer.json: the run, checkpoint or export)" if theirs else "prepare it without --tokenizer")
            raise ConfigError(f"--data {data} was prepared with {short(ours)}, but the model of {whose} uses "
                              f"{short(theirs)}; {fix}, or start from another model")
        theirs, n = ours, manifest.get("vocab_size")
    if theirs is None:
        return {}
    given = req.explicit.get("vocab_size")
    if isinstance(given, int) and given < int(n):
        raise ConfigError(f"--vocab-size {given} is smaller than the tokenizer's {n} tokens (of --data {data}); "
                          f"use {padded_vocab(int(n))}, or leave it out")
    fields = {"tokenizer": theirs, "token_vocab_size": int(n)}
    if resumed is not None and "vocab_size" not in req.explicit:
        fields["vocab_size"] = config_value(resumed[1], "vocab_size")
    elif "vocab_size" not in req.explicit:
        fields["vocab_size"] = padded_vocab(int(n))
    return fields


def began_from(where: str) -> Optional[dict]:
    """The init-from record of the run checkpoint ``where`` belongs to: the one its state.pt
    carries (the Trainer writes its plan's ``init_record`` there)."""
    record = ckpt.read_state(where).get("init_from")
    return dict(record) if record else None


def _config(values: dict, req: Request, init: Optional[InitFrom]) -> TrainConfig:
    try:
        return TrainConfig.from_dict(values, source=req.source)
    except ConfigError as e:
        if init is None:
            raise
        arch = {k: getattr(init.source.config, k) for k in init_from.ARCH_FIELDS}
        sizes = ", ".join(f"{k} {v}" for k, v in arch.items())
        raise init_from.InitFromError(f"--init-from {init.source.spec} ({sizes}): {e}") from e


def _to_stderr(line: str) -> None:
    print(f"gpt2lab train: {line}", file=sys.stderr, flush=True)


# -- the facts ---------------------------------------------------------------------------------
def detect_facts(device, world_size: int = 1, dtype: str = "auto") -> Facts:
    """This machine's facts for a run on ``device`` (the CPU probe only when ``dtype`` needs it)."""
    import torch

    dev = torch.device(device)
    return Facts(runtime.detect(dev, probe=str(dtype) in ("auto", "bfloat16")), world_size,
                 parallel.device_bytes(dev), host_bytes=host_share(world_size) if dev.type == "cpu" else None)


def host_bytes() -> Optional[int]:
    """This machine's RAM (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_share(world_size: int) -> Optional[int]:
    """A CPU process's share of the RAM: the processes of this node (torchrun's LOCAL_WORLD_SIZE) share it."""
    total = host_bytes()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or 1)
    return None if total is None else total // max(1, local)


def fake_facts(path: str) -> Facts:
    """Facts from a JSON file (GPT2LAB_FAKE_FACTS): device_type, device_name, cpu_flags, cuda_bf16,
    can_compile, probe {fp32_gflops, bf16_gflops}, world_size, device_gib or device_bytes."""
    try:
        with open(path) as fh:
            raw = json.load(fh)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        raw = dict(raw)
        world = int(raw.pop("world_size", 1))
        gib = raw.pop("device_gib", None)
        mem = raw.pop("device_bytes", None if gib is None else int(float(gib) * 2**30))
        probe = raw.pop("probe", None)
        host_gib = raw.pop("host_gib", None)
        known = {f.name for f in dataclasses.fields(runtime.Facts)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known | {'world_size', 'device_gib', 'device_bytes', 'host_gib'}))}")
        raw["cpu_flags"] = tuple(raw.get("cpu_flags", ()))
        dev = runtime.Facts(**raw, probe=runtime.Probe(**probe) if probe else None)
        if dev.device_type not in ("cpu", "cuda", "mps") or world < 1:
            raise ValueError(f"device_type {dev.device_type!r} (cpu, cuda or mps), world_size {world} (>= 1)")
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{FAKE_FACTS_ENV}={path}: cannot use it ({e}); see gpt2lab.train.plan") from e
    return Facts(dev, world, None if mem is None else int(mem), faked=path,
                 host_bytes=None if host_gib is None else int(float(host_gib) * 2**30 / world))

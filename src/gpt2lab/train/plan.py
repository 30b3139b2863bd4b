"""The run plan: every start-up decision of ``gpt2lab train``, made once, from plain data.

``decide_plan(request, gathered)`` is a pure function of what the user asked for (``Request``: preset
values, flags, ``--resume``) and what train.gather read from the outside world (``Gathered``: the
machine's facts, the checkpoint to resume and its config, the --init-from source and its hash,
the data's manifest); it reads no file. It decides, each with its reason where there is one:

- the run's architecture: a resumed run's from its checkpoint when it began from other weights,
  a fresh run's from its --init-from source, each checked against the values the user gave;
- the chat template and the tokenizer fields (the data's, which must be the model's it continues);
- the final ``TrainConfig``; a resume whose settings differ from its checkpoint's in anything that
  changes what it trains (``resume_fields``: the fields marked ``keep`` in train.config, the
  architecture's) is refused here;
- dtype and compile (``system.runtime``), strategy (``strategy_for``: distributed.parallel's rule
  with DDP's memory from ``train.memplan``), the loss path (``model.loss.choose_loss``);
- accumulation steps, peak FLOP/s for MFU, the predicted memory per rank (``check_memory``, a
  start's check, refuses what does not fit).

``make_plan(request, machine)`` is the two together: train.gather.gather, then ``decide_plan``. Under
torchrun, rank 0 makes the plan and hands it to the others in one broadcast (``train.run``); the
Trainer builds from it and decides nothing. The plan is printed at start, written to
``run_info.json`` and is all that ``gpt2lab train --dry-run`` shows (train/plan_text.py renders it).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from gpt2lab.checkpoint.store import step_of
from gpt2lab.distributed import parallel
from gpt2lab.model.config import config_value, flag_text, padded_vocab
from gpt2lab.model.loss import LossPath, choose_loss
from gpt2lab.system import hardware, runtime
from gpt2lab.system.errors import ConfigError
from gpt2lab.system.runtime import Choice
from gpt2lab.train import init_from, memplan
from gpt2lab.train.config import FIELDS, SECTION_OF, TrainConfig, default_value, merge_config
from gpt2lab.train.gather import Gathered, InitFrom, MachineFacts, Resumed, gather
from gpt2lab.train.schedule import accum_at, lr_at


# -- the inputs ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """What the user asked for: preset values with the flags over them (nested as config.json,
    any form accepted: ``nest_config``), not yet validated."""

    values: Mapping[str, object]
    # architecture values the user gave himself (and vocab_size, which otherwise follows the tokenizer)
    explicit: Mapping[str, object] = field(default_factory=dict)
    resume: Optional[str] = None  # None, "auto" or a run/checkpoint directory
    source: str = "config"  # for messages: "preset 'x' with overrides"
    command: Optional[str] = None  # the command line that continues this run (the commands build it)
    # the data the settings' sample_prompt was written for (settings.prompt_written_for); None: this run's
    prompt_for: Optional[str] = None

    @property
    def resume_advice(self) -> str:
        """How to continue this run, for messages: its command line, else the flag (the Python API)."""
        return f"`{self.command}`" if self.command else "--resume auto"

    @classmethod
    def of(cls, cfg: TrainConfig, resume: Optional[str] = None) -> "Request":
        """A TrainConfig as a request: every architecture value counts as given (each must agree with an
        --init-from source)."""
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


# -- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunPlan:
    config: TrainConfig  # final: the architecture filled in
    machine: MachineFacts  # what it plans for (train.gather)
    resume: Optional[str]  # the checkpoint to continue from (checksums verified)
    skipped: tuple[str, ...]  # damaged checkpoints passed over, one line each
    init: Optional[InitFrom]  # --init-from of a fresh run (None when resuming)
    choices: runtime.Resolved  # dtype, compile and Muon's Newton-Schulz dtype (system.runtime), with their reasons
    strategy: Choice
    loss: LossPath  # value "chunked" or "fused" (model.loss.choose_loss)
    peak_flops: Choice  # value: FLOP/s per device, or None
    accum: int  # micro-steps per optimizer step
    params: int  # parameters of the model (before LoRA)
    memory: Optional[dict]  # memplan's prediction per rank, MiB by term
    began: Optional[dict] = None  # a resumed run's init-from record, from its checkpoint's state.pt
    schedule_change: Optional[str] = None  # a resume's new LR schedule, said in one line (schedule_change)
    data_source: Optional[str] = None  # what the data was prepared from (its manifest's source): the report's baselines
    prompt_reason: Optional[str] = None  # why the samples' prompt is not the settings' (sample_prompt)
    supervised: Optional[tuple[int, int]] = None  # conversations: (assistant tokens, all tokens) of train

    @property
    def init_record(self) -> Optional[dict]:
        """run_info.json's "init_from": this run's source, or the one a resumed run began from."""
        return self.init.record() if self.init is not None else self.began


# -- the decisions: pure functions of (request, gathered) -------------------------------------
def make_plan(
    request: Request | TrainConfig,
    machine: MachineFacts,
    resume: Optional[str] = None,
    report: Optional[Callable[[str], None]] = None,
) -> RunPlan:
    """Every start-up decision of a run: train.gather.gather, then ``decide``; raises the first problem found.

    A TrainConfig is taken as a request whose architecture values are all given (``Request.of``).
    ``report`` hears of damaged checkpoints passed over as they are found (default: stderr).
    """
    req = request if isinstance(request, Request) else Request.of(request, resume)
    found = gather(
        machine,
        out=req.out,
        resume=req.resume,
        source=req.get("init_from"),
        data=str(req.get("data")),
        report=report or say,
        resume_with=req.resume_advice,
        prompt_from_data=not prompt_fits(req),
    )
    return decide_plan(req, found)


def decide_plan(req: Request, found: Gathered) -> RunPlan:
    """The plan of ``req`` from what was gathered (see the module docstring); reads no file."""
    machine, resumed, init = found.machine, found.resumed, found.init
    source = resumed.source if resumed is not None else init.source if init is not None else None
    # what the run takes from elsewhere, over what was asked for: the architecture of the weights it began
    # from, the prompt for its data, the chat template and tokenizer of its data (or of the model it continues)
    changes: dict = {"model": init_from.check_arch(source, req.explicit) if source is not None else {}}
    if resumed is not None and resumed.source is not None:
        changes["init_from"] = config_value(resumed.saved, "init_from")
    prompt, prompt_reason = sample_prompt(req, found)
    if prompt_reason:
        changes["sample_prompt"] = prompt
    template = chat_template(found.manifest, init, resumed)
    if template:
        changes["model"]["chat_template"] = template
    changes["model"].update(tokenizer_fields(req, found.manifest, init, resumed))
    cfg = _config(merge_config(req.values, changes, source=req.source), req, init)
    change = None
    if resumed is not None:
        check_resume_settings(cfg, resumed.saved, resumed.where)
        change = schedule_change(cfg, resumed.saved, step_of(resumed.where))
    accum = cfg.grad_accum_steps(machine.world_size)
    accum_at(cfg, 0, machine.world_size)  # the batch ramp's start divides evenly too (raises if not)
    ns_dtype, device = cfg.optim.muon_ns_dtype if cfg.optim.optimizer == "muon" else None, machine.device
    choices = runtime.resolve(device.device_type, cfg.system.dtype, cfg.system.compile, facts=device, ns_dtype=ns_dtype)
    dtype, compiled = str(choices.dtype.value), bool(choices.compile.value)
    strategy = strategy_for(cfg, machine, dtype, accum, compiled)
    sharded = strategy.value == "fsdp" and machine.world_size > 1
    predicted = device.device_type in ("cuda", "cpu")  # the devices memplan models
    memory = _predict(cfg, machine, str(strategy.value), dtype, accum, compiled).to_dict() if predicted else None
    train = found.manifest.get("splits", {}).get("train", {})  # conversations: (assistant tokens, all tokens)
    return RunPlan(
        config=cfg,
        machine=machine,
        resume=resumed.where if resumed else None,
        skipped=found.skipped,
        init=init,
        choices=choices,
        strategy=strategy,
        loss=choose_loss(device.device_type, compiled, sharded),
        peak_flops=choose_peak_flops(cfg.system.peak_flops, machine),
        accum=accum,
        params=memplan.params(cfg),
        memory=memory,
        began=resumed.began if resumed else None,
        schedule_change=change,
        data_source=found.manifest.get("source"),
        prompt_reason=prompt_reason,
        supervised=(int(train["supervised"]), int(train["tokens"])) if "supervised" in train else None,
    )


def prompt_fits(req: Request) -> bool:
    """Whether the settings' sample prompt was written for this run's data (or for this run: ``prompt_for``
    None): the same directory path, made absolute (no file read: a link to it counts as another)."""
    return req.prompt_for is None or os.path.abspath(str(req.prompt_for)) == os.path.abspath(str(req.get("data")))


def sample_prompt(req: Request, found: Gathered) -> tuple[str, Optional[str]]:
    """The prompt of the samples logged in training and its reason where it is not the settings' own: a
    preset's prompt (Tiny Shakespeare's "ROMEO:") is for the data that preset names; on other data the
    samples start from that data's first validation document (train.gather.val_start), or from nothing."""
    prompt = str(req.get("sample_prompt"))
    if prompt_fits(req):
        return prompt, None
    why = f"the settings' {prompt!r} was written for {req.prompt_for}"
    if found.val_start:
        return found.val_start, f"the start of {req.get('data')}'s first validation document; {why}"
    return "", f"empty: {req.get('data')} has no validation text to start from; {why}"


def choose_peak_flops(requested: Optional[float], machine: MachineFacts) -> Choice:
    kind, name = machine.device.device_type, machine.device.device_name
    if requested:
        return Choice(float(requested), "asked for with --peak-flops")
    if kind != "cuda":
        return Choice(None, f"no datasheet figure for a {kind}")
    found = hardware.peak_flops(name)
    if found is None:
        return Choice(None, f"{name!r} is not in gpt2lab.system.hardware's table; pass --peak-flops")
    return Choice(found, f"datasheet dense bf16 of {name}")


def strategy_for(cfg: TrainConfig, machine: MachineFacts, dtype: str, accum: int, compiled: bool) -> Choice:
    """ddp or fsdp for this run (the rule: parallel.choose_strategy), given DDP's per-rank memory on GPUs
    (memplan)."""
    ddp_bytes = None
    if machine.device_bytes is not None and machine.world_size > 1:
        ddp_bytes = _predict(cfg, machine, "ddp", dtype, accum, compiled).total
    return parallel.choose_strategy(
        cfg.parallel.strategy,
        world_size=machine.world_size,
        device_type=machine.device.device_type,
        dtype=dtype,
        lora=bool(cfg.finetune.lora_rank),
        ddp_bytes=ddp_bytes,
        device_bytes=machine.device_bytes,
    )


def _predict(cfg: TrainConfig, machine: MachineFacts, strategy: str, dtype: str, accum: int, compiled: bool):
    return memplan.predict(
        cfg,
        strategy=strategy,
        world_size=machine.world_size,
        dtype=dtype,
        accum=accum,
        device="cuda" if machine.device.device_type == "cuda" else "cpu",
        compiled=compiled,
        token_features=token_feature_count(cfg),
    )


def check_memory(plan: RunPlan) -> None:
    """Refuse a run whose predicted peak (memplan, per process) exceeds this machine's memory: the GPU's,
    or a CPU run's share of the RAM; name the largest --micro-batch-size that fits. (A start's check,
    after the data's: the plan itself describes any machine.)"""
    cfg, machine, b, world = plan.config, plan.machine, plan.config.batch, plan.machine.world_size
    limit, have = machine.memory()
    strategy, dtype, compiled = str(plan.strategy.value), str(plan.choices.dtype.value), plan.choices.compile.value

    def total_at(B: int) -> int:
        c = dataclasses.replace(cfg, batch=dataclasses.replace(b, micro_batch_size=B))
        return _predict(c, machine, strategy, dtype, c.grad_accum_steps(world), bool(compiled)).total

    if limit is None or not plan.memory or parallel.fits(need := total_at(b.micro_batch_size), limit):
        return
    rows = max(1, b.total_batch_tokens // (b.seq_len * world))  # a micro-batch must divide a step's rows
    sizes = (B for B in range(min(b.micro_batch_size - 1, rows), 0, -1) if rows % B == 0)
    fit = next((B for B in sizes if parallel.fits(total_at(B), limit)), None)
    fix = (
        f"lower --micro-batch-size to {fit} ({total_at(fit) / 2**30:.1f} GiB predicted)"
        if fit
        else "not even a micro-batch of 1 fits: a smaller model or a larger machine"
    )
    if not cfg.parallel.activation_checkpointing:
        fix += " or set --activation-checkpointing true"
    raise ConfigError(
        f"--micro-batch-size {b.micro_batch_size}: the run is predicted to need {need / 2**30:.1f} GiB per "
        f"process at its peak ({plan.memory['phase']}), more than {have}; {fix}"
    )


def token_feature_count(cfg: TrainConfig) -> int:
    """How many features --token-features gives the run's tokenizer (0: off)."""
    if not cfg.optim.token_features:
        return 0
    from gpt2lab.train.token_features import feature_count

    return feature_count(cfg.data if cfg.model.tokenizer else None, cfg.model.vocab_size)


def resume_fields(cfg: TrainConfig) -> list[str]:
    """The settings a resumed run must keep, by flat name: each field marked ``keep`` (train.config)
    that applies to ``cfg``, and every architecture field the run does not derive (its shapes too: refused
    here, a dry run too, not when the checkpoint loads)."""
    mine, out = cfg.to_dict(), []
    for name, f in FIELDS.items():
        keep = not f.metadata.get("derived") if SECTION_OF.get(name) == "model" else f.metadata.get("keep")
        if isinstance(keep, str):  # "NAME" or "NAME=VALUE": only where that field is set (to VALUE)
            setting, _, value = keep.partition("=")
            keep = str(config_value(mine, setting)) == value if value else bool(config_value(mine, setting))
        if keep:
            out.append(name)
    return out


def _saved(saved: dict, names) -> dict:
    """Fields of a checkpoint's config.json (either form); one written before a field existed: its default."""
    return {n: config_value(saved, n, default_value(n)) for n in names}


def check_resume_settings(cfg: TrainConfig, saved: dict, where: str) -> None:
    """A resume whose settings differ from those its checkpoint trained with (``saved``: its config.json,
    either form) in anything that changes what the run trains (``resume_fields``) is refused in one
    line naming each such field, both values and the flags to resume with; config.json is never
    rewritten with another value. A field a config.json written before it existed lacks counts as
    its default, what that version trained with."""
    mine, names = cfg.to_dict(), resume_fields(cfg)
    differ = [(n, theirs, config_value(mine, n)) for n, theirs in _saved(saved, names).items()]
    differ = [d for d in differ if d[1] != d[2]]
    if not differ:
        return
    flags = lambda side: " ".join(f"--{n.replace('_', '-')} {flag_text(v[side])}" for n, *v in differ)  # noqa: E731
    was = ", ".join(f"{n} {flag_text(theirs)}" for n, theirs, _ in differ)
    raise ConfigError(
        f"{flags(1)}: the checkpoint {where} was trained with {was}; resume with {flags(0)}, "
        "or start a new run in another --out"
    )


# The fields that shape the LR schedule (train.schedule.lr_at); those marked ``keep`` are refused before.
SCHEDULE_FIELDS = ("max_steps", "warmup_steps", "lr_schedule", "decay_frac", "max_lr", "min_lr")


def schedule_change(cfg: TrainConfig, saved: dict, step: int) -> Optional[str]:
    """One line naming what a resume changes in the LR schedule its checkpoint (``saved``, at ``step``)
    trained with: each field from what to what, the decay's new end and the rate of the next step
    before and after; None when it changes nothing. A rate's schedule is a function of max_steps, so
    resuming with another --max-steps moves the decay (cosine: its whole length; wsd: its start)."""
    mine, theirs = {n: getattr(cfg.optim, n) for n in SCHEDULE_FIELDS}, _saved(saved, SCHEDULE_FIELDS)
    old, new = (
        {n: v for n, v in opt.items() if n != "decay_frac" or opt["lr_schedule"] == "wsd"} for opt in (theirs, mine)
    )
    if old == new:
        return None
    changed = ", ".join(f"{n} {old.get(n, '-')} -> {new.get(n, '-')}" for n in new if old.get(n) != new.get(n))

    def rate(opt: dict) -> float:
        return lr_at(step, schedule=opt["lr_schedule"], **{n: opt[n] for n in SCHEDULE_FIELDS if n != "lr_schedule"})

    return (
        f"resuming at step {step} with another LR schedule than its checkpoint's: {changed}; the "
        f"{new['lr_schedule']} schedule now ends at step {new['max_steps']}, and step {step}'s learning rate is "
        f"{rate(mine):.3g} (the checkpoint's schedule: {rate(theirs):.3g})"
    )


def chat_template(manifest: Mapping, init: Optional[InitFrom], resumed: Optional[Resumed]) -> Optional[str]:
    """The run's chat template: its data's (conversations prepared in one: ``manifest``), else that of the
    model it began from (--init-from, or the resumed checkpoint's config), else None: a base model."""
    if manifest.get("chat_template"):
        return str(manifest["chat_template"])
    if init is not None:
        return init.source.config.chat_template
    return config_value(resumed.saved, "chat_template") if resumed else None


def tokenizer_fields(req: Request, manifest: Mapping, init: Optional[InitFrom], resumed: Optional[Resumed]) -> dict:
    """The run's tokenizer as model fields (empty for GPT-2's): its data's (``gpt2lab prepare
    --tokenizer``, named in its ``manifest``), which must be the tokenizer of the model it continues (an
    --init-from source's, a resumed checkpoint's; refused in one line naming both); without data here (a
    dry run planning for another machine), that model's. The vocabulary follows it (padded to a multiple
    of 128) unless --vocab-size was given, or a resumed run had another."""
    from gpt2lab.data.tokenizer import check_data_tokenizer, data_tokenizer

    data = str(req.get("data"))
    theirs, n, whose = None, None, None  # the tokenizer, its vocabulary and the model it continues
    if init is not None:
        src = init.source
        theirs, n, whose = src.config.tokenizer, src.config.real_vocab_size, f"--init-from {src.spec}"
    elif resumed is not None:
        theirs, n = config_value(resumed.saved, "tokenizer"), config_value(resumed.saved, "token_vocab_size")
        whose = f"the checkpoint {resumed.where}"
    if manifest:  # its tokenizer.json was checked when gathered
        if whose is not None:
            check_data_tokenizer(data, manifest, theirs, whose, "start from another model")
        theirs, n = data_tokenizer(manifest), manifest.get("vocab_size")
    if theirs is None:
        return {}
    given = req.explicit.get("vocab_size")
    if isinstance(given, int) and given < int(n):
        raise ConfigError(
            f"--vocab-size {given} is smaller than the tokenizer's {n} tokens (of --data {data}); "
            f"use {padded_vocab(int(n))}, or leave it out"
        )
    fields = {"tokenizer": theirs, "token_vocab_size": int(n)}
    if "vocab_size" not in req.explicit:  # a resumed run's, else the tokenizer's padded
        fields["vocab_size"] = config_value(resumed.saved, "vocab_size") if resumed else padded_vocab(int(n))
    return fields


def _config(values: dict, req: Request, init: Optional[InitFrom]) -> TrainConfig:
    try:
        return TrainConfig.from_dict(values, source=req.source)
    except ConfigError as e:
        if init is None:
            raise
        sizes = ", ".join(f"{k} {getattr(init.source.config, k)}" for k in init_from.ARCH_FIELDS)
        raise init_from.InitFromError(f"--init-from {init.source.spec} ({sizes}): {e}") from e


def say(line: str) -> None:
    """A line of ``gpt2lab train`` on stderr (a note, a warning, a damaged checkpoint passed over)."""
    print(f"gpt2lab train: {line}", file=sys.stderr, flush=True)

"""The run plan: every start-up decision of ``gpt2lab train``, made once, from plain data.

``decide(request, gathered)`` is a pure function of what the user asked for (``Request``: preset
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
  with DDP's memory from ``distributed.memplan``), the loss path (``model.loss.choose_loss``);
- accumulation steps, peak FLOP/s for MFU, the predicted memory per rank (``check_memory``, a
  start's check, refuses what does not fit).

``make_plan(request, machine)`` is the two together: train.gather.gather, then ``decide``. Under
torchrun, rank 0 makes the plan and hands it to the others in one broadcast (``train.run``); the
Trainer builds from it and decides nothing. The plan is printed at start, written to
``run_info.json`` and is all that ``gpt2lab train --dry-run`` shows.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from gpt2lab.checkpoint.store import step_of
from gpt2lab.distributed import memplan, parallel
from gpt2lab.model.config import GPTConfig, config_value, padded_vocab
from gpt2lab.model.loss import LossPath, choose_loss
from gpt2lab.system import hardware, runtime
from gpt2lab.system.errors import ConfigError
from gpt2lab.system.runtime import Choice
from gpt2lab.train import init_from
from gpt2lab.train.config import SECTIONS, TrainConfig, default_value, merge_config, nest_config
from gpt2lab.train.gather import Gathered, InitFrom, MachineFacts, Resumed, gather
from gpt2lab.train.schedule import accum_at, lr_at
from gpt2lab.weights.targets import export_target

PLAN_VERSION = 1


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
    dtype: Choice
    compile: Choice
    strategy: Choice
    loss: LossPath  # value "chunked" or "fused" (model.loss.choose_loss)
    peak_flops: Choice  # value: FLOP/s per device, or None
    accum: int  # micro-steps per optimizer step
    params: int  # parameters of the model (before LoRA)
    memory: Optional[dict]  # memplan's prediction per rank, MiB by term
    ns_dtype: Optional[Choice] = None  # Muon's Newton-Schulz dtype (None: the run has no Muon)
    began: Optional[dict] = None  # a resumed run's init-from record, from its checkpoint (began_from)
    schedule_change: Optional[str] = None  # a resume's new LR schedule, said in one line (schedule_change)
    data_source: Optional[str] = None  # what the data was prepared from (its manifest's source): the report's baselines
    prompt_reason: Optional[str] = None  # why the samples' prompt is not the settings' (sample_prompt)
    supervised: Optional[tuple[int, int]] = None  # conversations: (assistant tokens, all tokens) of train

    @property
    def choices(self) -> runtime.Resolved:
        return runtime.Resolved(self.dtype, self.compile, self.machine.device, self.ns_dtype)

    @property
    def export(self) -> str:
        """What ``gpt2lab export`` will write for this run's model, or why nothing (weights/targets.py)."""
        return export_target(self.config.model).describe()

    @property
    def checkpoints(self) -> dict:
        """What the run's checkpoints take on disk (``checkpoint_bytes``) and how many it keeps."""
        return checkpoint_disk(self.config)

    @property
    def init_record(self) -> Optional[dict]:
        """run_info.json's "init_from": this run's source, or the one a resumed run began from."""
        return self.init.record() if self.init is not None else self.began

    def record(self) -> dict:
        """run_info.json's "plan" entry (plain JSON)."""
        c = self.config

        def choice(ch):
            return {
                "value": ch.value,
                "reason": ch.reason,
                **({"warning": ch.warning} if ch.warning else {}),
            }

        return {
            "version": PLAN_VERSION,
            "facts": {
                **self.choices.record(),
                "world_size": self.machine.world_size,
                "device_bytes": self.machine.device_bytes,
                "host_bytes": self.machine.host_bytes,
                "faked": self.machine.faked,
            },
            "resume": self.resume,
            "schedule_change": self.schedule_change,
            "data_source": self.data_source,
            "sample_prompt": {"value": c.eval.sample_prompt, "reason": self.prompt_reason or "as set"},
            "skipped_checkpoints": list(self.skipped),
            "init_from": self.init_record,
            "dtype": choice(self.dtype),
            "compile": choice(self.compile),
            "strategy": choice(self.strategy),
            "loss": {"value": self.loss.value, "reason": self.loss.reason},
            "peak_flops": choice(self.peak_flops),
            "muon_ns_dtype": choice(self.ns_dtype) if self.ns_dtype else None,
            "activation_checkpointing": c.parallel.activation_checkpointing,
            "grad_accum_steps": self.accum,
            "params": self.params,
            "memory_mib": self.memory,
            "supervised": self.supervised,
            "checkpoints": self.checkpoints,
            "export": self.export,
            "config": c.to_dict(),
        }

    def lines(self) -> list[str]:
        """What start-up prints (and --dry-run shows), one decision a line."""
        c, m, ft = self.config, self.config.model, self.config.finetune
        on = lambda v: "on" if v else "off"  # noqa: E731
        mem = "no prediction for this device"
        if self.memory:
            f, have = self.machine, ""
            if f.device_bytes:
                have = f" of the device's {f.device_bytes / 2**30:.1f} GiB"
            elif f.host_bytes:
                have = f" of this machine's {f.host_bytes / 2**30:.1f} GiB of RAM" + (
                    " per process" if f.world_size > 1 else ""
                )
            mem = f"{self.memory['total'] / 1024:.2f} GiB per rank predicted{have} (peak at {self.memory['phase']})"
        peak = self.peak_flops.value
        b = c.batch
        ramp = (
            f"; ramped from {b.batch_ramp_start:,} tokens ({accum_at(c, 0, self.machine.world_size)} micro-steps) "
            f"at step 0 over {b.batch_ramp_steps} steps"
            if b.batch_ramp_steps
            else ""
        )
        if b.seq_len_ramp_steps:  # the sequence-length ramp: the same tokens in shorter rows
            ramp += (
                f"; sequences of {b.seq_len_start} tokens at step 0 (micro-batch "
                f"{b.micro_batch_size * b.seq_len // b.seq_len_start} rows), doubling to {b.seq_len} by step "
                f"{b.seq_len_ramp_steps}"
            )
        if m.mtp_heads:
            final = "" if m.mtp_weight_final is None else f", to {m.mtp_weight_final} at the last step"
            mtp = (
                f"; multi-token prediction: {m.mtp_heads} more heads (tokens t+2..t+{m.mtp_heads + 1}), "
                f"weight {m.mtp_weight}{final}"
            )
        out = [
            f"out       {c.out}" + (f" (resume from {self.resume})" if self.resume else " (new run)"),
            f"machine   {self.machine.describe()}",
            f"model     {m.n_layer} layers, {m.n_head} heads, {m.n_embd} wide, block {m.block_size}, "
            f"{self.params:,} params" + (f", LoRA rank {ft.lora_rank} on {ft.lora_targets}" if ft.lora_rank else ""),
            f"export    {self.export}",
        ]
        if m.tokenizer:
            out.append(
                f"tokenizer sha256:{m.tokenizer[:12]} (the data's): {m.token_vocab_size:,} tokens in "
                f"{m.vocab_size:,} embedding rows"
            )
        if self.supervised:
            n, total = self.supervised
            out.append(
                f"data      {c.data}: conversations in the {m.chat_template} template, supervised on "
                f"{n:,} of {total:,} tokens ({n / max(total, 1):.0%}: the assistant's turns)"
            )
        if self.prompt_reason:
            out.append(f"sample    prompt {c.eval.sample_prompt!r} ({self.prompt_reason})")
        out += [f"skipped   {line}" for line in self.skipped]
        if self.schedule_change:
            out.append(f"schedule  {self.schedule_change}")
        if self.init_record:
            r = self.init_record
            out.append(f"init from {r['source']} ({r.get('kind', 'recorded by the run')}, {r['id']})")
        out += [
            f"dtype     {self.dtype.value} ({self.dtype.reason})",
            f"compile   {on(self.compile.value)} ({self.compile.reason})",
            f"strategy  {self.strategy.value} ({self.strategy.reason})"
            + ("; activation checkpointing on" if c.parallel.activation_checkpointing else ""),
            f"loss      {self.loss.value} ({self.loss.reason})" + (mtp if m.mtp_heads else ""),
            f"optimizer {c.optim.optimizer}"
            + (f" ({c.optim.muon_variant})" if c.optim.muon_variant != "muon" else "")
            + f", {c.optim.lr_schedule} schedule"
            + (f"; Newton-Schulz in {self.ns_dtype.value} ({self.ns_dtype.reason})" if self.ns_dtype else "")
            + ("; Polar Express in place of Newton-Schulz's polynomial" if c.optim.muon_orth == "polar_express" else "")
            + ("; cautious weight decay" if c.optim.cautious_wd else "")
            + ("; token features shared by the token tables (training only)" if c.optim.token_features else "")
            + (
                f"; weight average (EMA) {c.optim.ema_decay}: evaluations and checkpoints hold it"
                if c.optim.ema_decay
                else ""
            ),
            f"batch     {c.batch.total_batch_tokens:,} tokens/step = micro-batch {c.batch.micro_batch_size} "
            f"x seq {c.batch.seq_len} x {self.machine.world_size} process(es) x {self.accum} micro-steps{ramp}; "
            f"steps to {c.optim.max_steps}",
            "peak      "
            + (
                f"{peak / 1e12:.0f} TFLOP/s per device ({self.peak_flops.reason})"
                if peak
                else f"unknown ({self.peak_flops.reason}); no MFU"
            ),
            f"memory    {mem}",
            f"disk      {describe_checkpoints(self.checkpoints)}",
        ]
        out += [f"warning: {ch.warning}" for ch in (self.dtype, self.compile) if ch.warning]
        return out


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
        report=report or _to_stderr,
        resume_with=req.resume_advice,
        prompt_from_data=not prompt_fits(req),
    )
    return decide(req, found)


def decide(req: Request, found: Gathered) -> RunPlan:
    """The plan of ``req`` from what was gathered (see the module docstring); reads no file."""
    machine, resumed, init = found.machine, found.resumed, found.init
    values = nest_config(req.values, req.source)
    if resumed is not None and resumed.source is not None:  # began from other weights: the checkpoint's architecture
        arch = init_from.check_arch(resumed.source, req.explicit)
        values = merge_config(
            values, {"init_from": config_value(resumed.saved, "init_from"), "model": arch}, source=req.source
        )
    elif init is not None:
        arch = init_from.check_arch(init.source, req.explicit)
        values = merge_config(values, {"model": arch}, source=req.source)
    prompt, prompt_reason = sample_prompt(req, found)
    if prompt_reason:
        values = merge_config(values, {"eval": {"sample_prompt": prompt}}, source=req.source)
    template = chat_template(found.manifest, init, resumed)
    if template:
        values = merge_config(values, {"model": {"chat_template": template}}, source=req.source)
    model = tokenizer_fields(values, req, found.manifest, init, resumed)
    if model:
        values = merge_config(values, {"model": model}, source=req.source)
    cfg = _config(values, req, init)
    change = None
    if resumed is not None:
        check_resume_settings(cfg, resumed.saved, resumed.where)
        change = schedule_change(cfg, resumed.saved, step_of(resumed.where))
    accum = cfg.grad_accum_steps(machine.world_size)
    accum_at(cfg, 0, machine.world_size)  # the batch ramp's start divides evenly too (raises if not)
    muon = cfg.optim.optimizer == "muon"
    choices = runtime.resolve(
        machine.device.device_type,
        cfg.system.dtype,
        cfg.system.compile,
        facts=machine.device,
        ns_dtype=cfg.optim.muon_ns_dtype if muon else None,
    )
    dtype, compiled = str(choices.dtype.value), bool(choices.compile.value)
    strategy = strategy_for(cfg, machine, dtype, accum, compiled)
    sharded = strategy.value == "fsdp" and machine.world_size > 1
    memory = None
    if machine.device.device_type in ("cuda", "cpu"):
        memory = _predict(cfg, machine, str(strategy.value), dtype, accum, compiled).to_dict()
    return RunPlan(
        config=cfg,
        machine=machine,
        resume=resumed.where if resumed else None,
        skipped=found.skipped,
        init=init,
        dtype=choices.dtype,
        compile=choices.compile,
        strategy=strategy,
        loss=choose_loss(machine.device.device_type, compiled, sharded),
        peak_flops=choose_peak_flops(cfg.system.peak_flops, machine),
        accum=accum,
        params=memplan.param_counts(cfg.model)["total"],
        memory=memory,
        ns_dtype=choices.ns_dtype,
        began=resumed.began if resumed else None,
        schedule_change=change,
        data_source=found.manifest.get("source"),
        prompt_reason=prompt_reason,
        supervised=supervised_tokens(found.manifest),
    )


def prompt_fits(req: Request) -> bool:
    """Whether the settings' sample prompt was written for this run's data (or for this run: ``prompt_for``
    None): the same directory path, made absolute (no file read: a link to it counts as another)."""
    if req.prompt_for is None:
        return True
    return os.path.abspath(str(req.prompt_for)) == os.path.abspath(str(req.get("data")))


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
    if requested:
        return Choice(float(requested), "asked for with --peak-flops")
    if machine.device.device_type != "cuda":
        return Choice(None, f"no datasheet figure for a {machine.device.device_type}")
    found = hardware.peak_flops(machine.device.device_name)
    if found is None:
        return Choice(
            None, f"{machine.device.device_name!r} is not in gpt2lab.system.hardware's table; pass --peak-flops"
        )
    return Choice(found, f"datasheet dense bf16 of {machine.device.device_name}")


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
    device = "cuda" if machine.device.device_type == "cuda" else "cpu"
    return memplan.predict(
        cfg.model,
        strategy=strategy,
        world_size=machine.world_size,
        micro_batch=cfg.batch.micro_batch_size,
        seq_len=cfg.batch.seq_len,
        dtype=dtype,
        activation_checkpointing=cfg.parallel.activation_checkpointing,
        accum=accum,
        device=device,
        compiled=compiled,
        optimizer=cfg.optim.optimizer,
        muon_variant=cfg.optim.muon_variant,
        average=bool(cfg.optim.ema_decay),
        token_features=token_feature_count(cfg),
    )


def check_memory(plan: RunPlan) -> None:
    """Refuse a run whose predicted peak (memplan, per process) exceeds this machine's memory: the GPU's,
    or a CPU run's share of the RAM; name the largest --micro-batch-size that fits. (A start's check,
    after the data's: the plan itself describes any machine.)"""
    cfg, machine = plan.config, plan.machine
    cuda = machine.device.device_type == "cuda"
    limit = machine.device_bytes if cuda else machine.host_bytes

    def total_at(B: int) -> int:
        c = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, micro_batch_size=B))
        return _predict(
            c,
            machine,
            str(plan.strategy.value),
            str(plan.dtype.value),
            c.grad_accum_steps(machine.world_size),
            bool(plan.compile.value),
        ).total

    if limit is None or not plan.memory or memplan.fits(total_at(cfg.batch.micro_batch_size), limit):
        return
    b, world = cfg.batch, machine.world_size
    rows = max(1, b.total_batch_tokens // (b.seq_len * world))  # a micro-batch must divide a step's rows
    fit = next(
        (
            B
            for B in range(min(b.micro_batch_size - 1, rows), 0, -1)
            if rows % B == 0 and memplan.fits(total_at(B), limit)
        ),
        None,
    )
    have = (
        f"the {limit / 2**30:.1f} GiB of {machine.device.device_name or 'the GPU'}"
        if cuda
        else f"this machine's {limit / 2**30:.1f} GiB of RAM" + (f" per process ({world})" if world > 1 else "")
    )
    fix = (
        f"lower --micro-batch-size to {fit} ({total_at(fit) / 2**30:.1f} GiB predicted)"
        if fit
        else "not even a micro-batch of 1 fits: a smaller model or a larger machine"
    )
    if not cfg.parallel.activation_checkpointing:
        fix += " or set --activation-checkpointing true"
    raise ConfigError(
        f"--micro-batch-size {b.micro_batch_size}: the run is predicted to need "
        f"{total_at(b.micro_batch_size) / 2**30:.1f} GiB per process at its peak "
        f"({plan.memory['phase']}), more than {have}; {fix}"
    )


def token_feature_count(cfg: TrainConfig) -> int:
    """How many features --token-features gives the run's tokenizer (0: off)."""
    if not cfg.optim.token_features:
        return 0
    from gpt2lab.train.token_features import feature_count

    return feature_count(cfg.data if cfg.model.tokenizer else None, cfg.model.vocab_size)


def checkpoint_bytes(cfg: TrainConfig) -> dict:
    """Bytes of one checkpoint of ``cfg``'s run by file, as checkpoint.store writes it: the weights in
    fp32 (model.safetensors; the tied head once; LoRA's adapters with the base), the optimizer's fp32
    state (optimizer.pt: memplan's, or the adapters' two AdamW moments under LoRA) and, with
    --ema-decay, the trained weights beside the average (training.safetensors). state.pt, config.json
    and checksums add kilobytes, left out."""
    m, ft = cfg.model, cfg.finetune
    params = memplan.param_counts(m)["total"]
    if ft.lora_rank:
        C = m.n_embd
        shapes = {"c_attn": [(C, 3 * C)], "c_fc": [(C, 4 * C)], "attn.c_proj": [(C, C)], "mlp.c_proj": [(4 * C, C)]}
        shapes["c_proj"] = shapes["attn.c_proj"] + shapes["mlp.c_proj"]
        targets = {t.strip() for t in ft.lora_targets.split(",")}
        linears = {shape for t in targets for shape in shapes[t]}  # c_proj and attn.c_proj: the same layer once
        adapters = m.n_layer * sum(ft.lora_rank * (a + b) for a, b in linears)
        weights, optimizer = memplan.FP32 * (params + adapters), 2 * memplan.FP32 * adapters
    else:
        weights = memplan.FP32 * params
        optimizer = memplan.optimizer_state_bytes(m, cfg.optim.optimizer, cfg.optim.muon_variant)
        optimizer += memplan.feature_state_bytes(m, token_feature_count(cfg))
    out = {"weights": weights, "optimizer": optimizer}
    if cfg.optim.ema_decay:
        out["training_weights"] = weights
    return {**out, "total": sum(out.values())}


def checkpoint_disk(cfg: TrainConfig) -> dict:
    """``checkpoint_bytes`` with the count the run writes (every ckpt_interval steps and at the end) and
    keeps (--keep-checkpoints, 0: all), and the disk that takes: ``kept`` checkpoints, one more while
    the next is written (the oldest goes once the new one is whole)."""
    c, steps = cfg.checkpoint, cfg.optim.max_steps
    each = checkpoint_bytes(cfg)
    written = steps // c.ckpt_interval + (1 if steps % c.ckpt_interval else 0) if c.ckpt_interval else 1
    kept = min(c.keep_checkpoints, written) if c.keep_checkpoints else written
    return {
        "bytes": each,
        "written": written,
        "keep_checkpoints": c.keep_checkpoints,
        "kept": kept,
        "kept_bytes": kept * each["total"],
        "peak_bytes": min(kept + 1, written) * each["total"],
    }


def describe_checkpoints(disk: dict) -> str:
    """The plan's line about checkpoints on disk."""
    each, mib = disk["bytes"], lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    parts = ", ".join(f"{k.replace('_', ' ')} {mib(v)}" for k, v in each.items() if k != "total")
    keep = "all kept" if not disk["keep_checkpoints"] else f"{disk['kept']} kept (--keep-checkpoints)"
    return (
        f"{mib(each['total'])} per checkpoint ({parts}); {disk['written']} written, {keep}: "
        f"{mib(disk['kept_bytes'])}"
        + (f", {mib(disk['peak_bytes'])} while the next is written" if disk["peak_bytes"] > disk["kept_bytes"] else "")
    )


def resume_fields(cfg: TrainConfig) -> list[str]:
    """The settings a resumed run must keep, by flat name: each field marked ``keep`` (train.config)
    that applies to ``cfg``, and every architecture field the run does not derive (its shapes too: refused
    here, a dry run too, not when the checkpoint loads)."""
    out = [f.name for f in dataclasses.fields(GPTConfig) if not f.metadata["derived"]]
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

    def schedule(opt: dict) -> dict:
        return {n: opt[n] for n in SCHEDULE_FIELDS if n != "decay_frac" or opt["lr_schedule"] == "wsd"}

    mine = {n: getattr(cfg.optim, n) for n in SCHEDULE_FIELDS}
    theirs = {n: _saved_value(saved, n) for n in SCHEDULE_FIELDS}
    old, new = schedule(theirs), schedule(mine)
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


def _saved_value(saved: dict, name: str):
    """A field of a checkpoint's config.json; one written before the field existed: its default."""
    value = config_value(saved, name, _ABSENT)
    return default_value(name) if value is _ABSENT else value


def _flag_text(value) -> str:
    """A value as its flag takes it (true/false, none)."""
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def supervised_tokens(manifest: Mapping) -> Optional[tuple[int, int]]:
    """(assistant tokens, all tokens) of a conversation directory's train split (its ``manifest``); None for text."""
    train = manifest.get("splits", {}).get("train", {})
    return (int(train["supervised"]), int(train["tokens"])) if "supervised" in train else None


def chat_template(manifest: Mapping, init: Optional[InitFrom], resumed: Optional[Resumed]) -> Optional[str]:
    """The run's chat template: its data's (conversations prepared in one: ``manifest``), else that of the
    model it began from (--init-from, or the resumed checkpoint's config), else None: a base model."""
    found = manifest.get("chat_template")
    if found:
        return str(found)
    if init is not None:
        return init.source.config.chat_template
    return config_value(resumed.saved, "chat_template") if resumed else None


def tokenizer_fields(
    values: dict, req: Request, manifest: Mapping, init: Optional[InitFrom], resumed: Optional[Resumed]
) -> dict:
    """The run's tokenizer as model fields (empty for GPT-2's): its data's (``gpt2lab prepare
    --tokenizer``, named in its ``manifest``), which must be the tokenizer of the model it continues (an
    --init-from source's, a resumed checkpoint's; refused in one line naming both); without data here (a
    dry run planning for another machine), that model's. The vocabulary follows it (padded to a multiple
    of 128) unless --vocab-size was given, or a resumed run had another."""
    from gpt2lab.data.tokenizer import GPT2, short

    data = str(config_value(values, "data", default_value("data")))
    theirs, n, whose = None, None, None  # the tokenizer, its vocabulary and the model it continues
    if init is not None:
        src = init.source
        theirs, n, whose = src.config.tokenizer, src.config.real_vocab_size, f"--init-from {src.spec}"
    elif resumed is not None:
        theirs, n = config_value(resumed.saved, "tokenizer"), config_value(resumed.saved, "token_vocab_size")
        whose = f"the checkpoint {resumed.where}"
    if manifest:
        found = manifest.get("tokenizer", GPT2)
        ours = None if found == GPT2 else str(found)  # its tokenizer.json was checked when gathered
        if whose is not None and ours != theirs:
            fix = (
                "prepare it with that model's tokenizer (gpt2lab prepare --tokenizer DIR, DIR holding its "
                "tokenizer.json: the run, checkpoint or export)"
                if theirs
                else "prepare it without --tokenizer"
            )
            raise ConfigError(
                f"--data {data} was prepared with {short(ours)}, but the model of {whose} uses "
                f"{short(theirs)}; {fix}, or start from another model"
            )
        theirs, n = ours, manifest.get("vocab_size")
    if theirs is None:
        return {}
    given = req.explicit.get("vocab_size")
    if isinstance(given, int) and given < int(n):
        raise ConfigError(
            f"--vocab-size {given} is smaller than the tokenizer's {n} tokens (of --data {data}); "
            f"use {padded_vocab(int(n))}, or leave it out"
        )
    fields = {"tokenizer": theirs, "token_vocab_size": int(n)}
    if resumed is not None and "vocab_size" not in req.explicit:
        fields["vocab_size"] = config_value(resumed.saved, "vocab_size")
    elif "vocab_size" not in req.explicit:
        fields["vocab_size"] = padded_vocab(int(n))
    return fields


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

"""The run plan as text: the lines start-up prints (and ``--dry-run`` shows), run_info.json's "plan"
entry, and what the run's checkpoints will take on disk. The decisions are train/plan.py's."""

from __future__ import annotations

import dataclasses

from gpt2lab.train import memplan
from gpt2lab.train.config import TrainConfig
from gpt2lab.train.plan import RunPlan, token_feature_count
from gpt2lab.train.schedule import accum_at
from gpt2lab.weights.targets import export_target

PLAN_VERSION = 1


def record(plan: RunPlan) -> dict:
    """run_info.json's "plan" entry (plain JSON)."""
    c, runtime = plan.config, plan.choices
    choice = lambda ch: {k: v for k, v in dataclasses.asdict(ch).items() if k != "warning" or v}  # noqa: E731
    return {
        "version": PLAN_VERSION,
        "facts": {
            **runtime.record(),
            **{k: getattr(plan.machine, k) for k in ("world_size", "device_bytes", "host_bytes", "faked")},
        },
        "resume": plan.resume,
        "schedule_change": plan.schedule_change,
        "data_source": plan.data_source,
        "sample_prompt": {"value": c.eval.sample_prompt, "reason": plan.prompt_reason or "as set"},
        "skipped_checkpoints": list(plan.skipped),
        "init_from": plan.init_record,
        "dtype": choice(runtime.dtype),
        "compile": choice(runtime.compile),
        "strategy": choice(plan.strategy),
        "loss": {"value": plan.loss.value, "reason": plan.loss.reason},
        "peak_flops": choice(plan.peak_flops),
        "muon_ns_dtype": choice(runtime.ns_dtype) if runtime.ns_dtype else None,
        "activation_checkpointing": c.parallel.activation_checkpointing,
        "grad_accum_steps": plan.accum,
        "params": plan.params,
        "memory_mib": plan.memory,
        "supervised": plan.supervised,
        "checkpoints": checkpoint_disk(plan.config),
        "export": export_target(c.model).describe(),  # what `gpt2lab export` will write, or why nothing
        "config": c.to_dict(),
    }


def lines(plan: RunPlan) -> list[str]:
    """What start-up prints (and --dry-run shows), one decision a line (a label, then what was decided)."""
    c, m, b, o, f = plan.config, plan.config.model, plan.config.batch, plan.config.optim, plan.machine
    mem = "no prediction for this device"
    if plan.memory:
        limit, have = f.memory()
        have = f" of {have}" if limit else ""
        mem = f"{plan.memory['total'] / 1024:.2f} GiB per rank predicted{have} (peak at {plan.memory['phase']})"
    final = "" if m.mtp_weight_final is None else f", to {m.mtp_weight_final} at the last step"
    loss = [
        f"{plan.loss.value} ({plan.loss.reason})",
        m.mtp_heads
        and f"multi-token prediction: {m.mtp_heads} more heads (tokens t+2..t+{m.mtp_heads + 1}), "
        f"weight {m.mtp_weight}{final}",
    ]
    optimizer = [
        o.optimizer + (f" ({o.muon_variant})" if o.muon_variant != "muon" else "") + f", {o.lr_schedule} schedule",
        o.muon_orth == "polar_express" and "Polar Express in place of Newton-Schulz's polynomial",
        o.cautious_wd and "cautious weight decay",
        o.token_features and "token features shared by the token tables (training only)",
        o.ema_decay and f"weight average (EMA) {o.ema_decay}: evaluations and checkpoints hold it",
    ]
    batch = [  # the sequence-length ramp: the same tokens in shorter rows
        f"{b.total_batch_tokens:,} tokens/step = micro-batch {b.micro_batch_size} x seq {b.seq_len} x "
        f"{f.world_size} process(es) x {plan.accum} micro-steps",
        b.batch_ramp_steps
        and f"ramped from {b.batch_ramp_start:,} tokens ({accum_at(c, 0, f.world_size)} "
        f"micro-steps) at step 0 over {b.batch_ramp_steps} steps",
        b.seq_len_ramp_steps
        and f"sequences of {b.seq_len_start} tokens at step 0 (micro-batch "
        f"{b.micro_batch_size * b.seq_len // b.seq_len_start} rows), doubling to {b.seq_len} by step "
        f"{b.seq_len_ramp_steps}",
        f"steps to {o.max_steps}",
    ]
    peak, init, (n, total), ft = plan.peak_flops, plan.init_record, plan.supervised or (0, 0), c.finetune
    lora = f", LoRA rank {ft.lora_rank} on {ft.lora_targets}" if ft.lora_rank else ""
    checkpointing = "; activation checkpointing on" if c.parallel.activation_checkpointing else ""
    rows = [
        f"out       {c.out}" + (f" (resume from {plan.resume})" if plan.resume else " (new run)"),
        f"machine   {f.describe()}",
        f"model     {m.n_layer} layers, {m.n_head} heads, {m.n_embd} wide, block {m.block_size}, "
        f"{plan.params:,} params{lora}",
        f"export    {export_target(m).describe()}",
        m.tokenizer
        and f"tokenizer sha256:{m.tokenizer[:12]} (the data's): {m.token_vocab_size:,} tokens in "
        f"{m.vocab_size:,} embedding rows",
        plan.supervised
        and f"data      {c.data}: conversations in the {m.chat_template} template, supervised on "
        f"{n:,} of {total:,} tokens ({n / max(total, 1):.0%}: the assistant's turns)",
        plan.prompt_reason and f"sample    prompt {c.eval.sample_prompt!r} ({plan.prompt_reason})",
        *(f"skipped   {line}" for line in plan.skipped),
        plan.schedule_change and f"schedule  {plan.schedule_change}",
        init and f"init from {init['source']} ({init.get('kind', 'recorded by the run')}, {init['id']})",
        f"runtime   {plan.choices.summary()}",
        f"strategy  {plan.strategy.value} ({plan.strategy.reason}){checkpointing}",
        "loss      " + "; ".join(part for part in loss if part),
        "optimizer " + "; ".join(part for part in optimizer if part),
        "batch     " + "; ".join(part for part in batch if part),
        f"peak      {peak.value / 1e12:.0f} TFLOP/s per device ({peak.reason})"
        if peak.value
        else f"peak      unknown ({peak.reason}); no MFU",
        f"memory    {mem}",
        f"disk      {describe_checkpoints(checkpoint_disk(c))}",
        *(f"warning: {ch.warning}" for ch in (plan.choices.dtype, plan.choices.compile) if ch.warning),
    ]
    return [line for line in rows if line]


def checkpoint_bytes(cfg: TrainConfig) -> dict:
    """Bytes of one checkpoint of ``cfg``'s run by file, as checkpoint.store writes it: the weights in
    fp32 (model.safetensors; the tied head once; LoRA's adapters with the base), the optimizer's state
    (optimizer.pt: counted on the optimizer built on the meta device, memplan.sizes; the token features' too) and,
    with --ema-decay, the trained weights beside the average (training.safetensors). state.pt,
    config.json and checksums add kilobytes, left out."""
    weights, state = memplan.sizes(cfg)
    out = {"weights": weights, "optimizer": state + memplan.feature_state_bytes(cfg.model, token_feature_count(cfg))}
    if cfg.optim.ema_decay:
        out["training_weights"] = weights
    return {**out, "total": sum(out.values())}


def checkpoint_disk(cfg: TrainConfig) -> dict:
    """``checkpoint_bytes`` with the count the run writes (every ckpt_interval steps and at the end) and
    keeps (--keep-checkpoints, 0: all), and the disk that takes: ``kept`` checkpoints, one more while
    the next is written (the oldest goes once the new one is whole)."""
    c, each = cfg.checkpoint, checkpoint_bytes(cfg)
    written = -(-cfg.optim.max_steps // c.ckpt_interval) if c.ckpt_interval else 1  # the last step's too
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
        f"{mib(each['total'])} per checkpoint ({parts}); {disk['written']} written, {keep}: {mib(disk['kept_bytes'])}"
        + (f", {mib(disk['peak_bytes'])} while the next is written" if disk["peak_bytes"] > disk["kept_bytes"] else "")
    )

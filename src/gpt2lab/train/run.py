"""``gpt2lab train`` after parsing, in its start-up order.

1. rank 0 checks that ``--out`` is missing, empty or one of gpt2lab's runs (system.rundir),
   claims it (writes the run marker) and takes its lock, held until the process ends;
2. rank 0 detects the machine's facts, makes the plan (train.plan.make_plan: train.gather reads, train.plan
   decides) and checks the data
   (train.preflight: present, large enough, HellaSwag's at hand); steps 1-2 are one
   ``decided_on_rank_0``: one broadcast, every rank raises its error;
3. rank 0 removes temporaries of dead runs, prints the plan, writes config.json and
   run_info.json (with the plan);
4. every rank builds the Trainer from the plan and runs it.

A failure before the first step removes what this start wrote (system.rundir.Claim.undo).
``dry_run`` stops after 2 (the plan printed, nothing written, the directory untouched, no network).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from typing import Optional

from gpt2lab.data.tokenizer import save_tokenizer
from gpt2lab.distributed import parallel
from gpt2lab.distributed.dist import DistInfo, decided_on_rank_0
from gpt2lab.observe.metrics import MetricsLogger, run_info
from gpt2lab.system import env, rundir
from gpt2lab.system.errors import ConfigError, DataError, DiskFullError, UsageError
from gpt2lab.system.files import sweep_stale, write_json
from gpt2lab.train import plan_text, preflight
from gpt2lab.train.config import TrainConfig, save_config
from gpt2lab.train.gather import detect_machine, fake_machine
from gpt2lab.train.plan import Request, RunPlan, check_memory, make_plan, say
from gpt2lab.train.trainer import Stopped, Trainer


def train(
    config: TrainConfig | Request, info: DistInfo, resume: Optional[str] = None, dry_run: bool = False
) -> Optional[str]:
    """Everything ``gpt2lab train`` does after parsing; returns the last checkpoint path
    (None for ``dry_run``, which prints the plan and writes nothing)."""
    request = config if isinstance(config, Request) else Request.of(config, resume)
    claimed: list[rundir.Claim] = []  # rank 0's claim on the run directory, in a real start
    with contextlib.ExitStack() as stack:  # the run lock, held until the run ends

        def decide() -> RunPlan:  # steps 1-2 on rank 0
            out, fake = request.out, env.fake_facts()
            if fake and not dry_run:
                raise ConfigError(
                    f"{env.FAKE_FACTS}={fake} is set: made-up machine facts can only be planned "
                    f"with, not trained on; add --dry-run or unset {env.FAKE_FACTS}"
                )
            facts = (
                fake_machine(fake) if fake else detect_machine(info.device, info.world_size, str(request.get("dtype")))
            )
            if dry_run:
                rundir.check(out, rundir.RUN, flag="--out", what_next=_WHAT_NEXT)  # read-only
                who = rundir.holder(out)
                if who is not None:
                    say(f"note: {out} is in use by a live run ({rundir.describe(who)}); a real start would be refused")
            else:
                claimed.append(stack.enter_context(rundir.claim(out, flag="--out", what_next=_WHAT_NEXT)))
            with _no_downloads() if dry_run else contextlib.nullcontext():
                plan = make_plan(request, facts)
            if plan.schedule_change:  # said before anything else: the user may not have meant it
                say(f"note: {plan.schedule_change}")
            lines = preflight.check_present(plan.config.data, faked=facts.faked is not None)  # before the rest
            check_memory(plan)
            for line in lines + preflight.check_data(plan.config, facts.world_size, dry_run):
                say(line)
            return plan

        plan = decided_on_rank_0(decide)
        if not dry_run:
            return _run(plan, info, claimed[0] if claimed else None, request.resume_advice)
        if info.is_main:
            lines = (f"  {line}" for line in plan_text.lines(plan))
            print("gpt2lab train --dry-run: the plan (nothing trained, nothing written)", *lines, sep="\n")
        return None


@contextlib.contextmanager
def _no_downloads():
    """A dry run plans offline: a hub source (--init-from gpt2) is read from the Hugging Face cache
    only, as under HF_HUB_OFFLINE=1 (what it sets for the planning)."""
    with env.hub_offline_set() as users:
        try:
            yield
        except (UsageError, DataError) as e:  # a source not in the cache: say who set HF_HUB_OFFLINE
            if not users and "HF_HUB_OFFLINE" in str(e):
                raise type(e)(f"{e} (--dry-run never downloads: it planned with HF_HUB_OFFLINE=1)") from e
            raise


_WHAT_NEXT = "choose a new or empty --out"


def _run(plan: RunPlan, info: DistInfo, claim: Optional[rundir.Claim], resume_with: str) -> Optional[str]:
    """Steps 3-4; until the first step is taken a failure removes what this start wrote (``claim``)."""
    cfg = plan.config
    if info.is_main:  # temporaries of killed runs (never of a live one) would block a full disk
        for folder in (cfg.out, os.path.join(cfg.out, "checkpoints")):
            sweep_stale(folder)
    import torch

    trainer = None
    try:
        trainer = Trainer(plan, info)
        if info.is_main:
            _write_run_files(plan, info, trainer, resume_with)
        # the logging section's fields are the logger's options; a progress bar never in a redirected log
        options = {**dataclasses.asdict(cfg.logging), "progress": cfg.logging.progress and sys.stderr.isatty()}
        at = dict(enabled=info.is_main, total_steps=cfg.optim.max_steps, start_step=trainer.step)
        log = MetricsLogger(cfg.out, config=cfg.to_dict(), **at, **options)
        for line in plan_text.lines(plan):  # the plan a --dry-run shows, each decision and its reason
            log.console(f"gpt2lab train: {line}")
        log.console(
            f"gpt2lab train: steps {trainer.step}..{cfg.optim.max_steps}, {trainer.accum} micro-steps/step"
            + (f", resumed from {plan.resume}" if plan.resume else "")
        )
        try:
            last = trainer.run(log)
        finally:
            log.close()
    except (torch.OutOfMemoryError, MemoryError) as e:  # one line, not a traceback
        at = f"at step {trainer.step}" if trainer is not None else "building the model"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"--micro-batch-size {cfg.batch.micro_batch_size}: out of memory {at} "
            f"({first[:200]}); lower --micro-batch-size or set --activation-checkpointing true"
        ) from e
    except DiskFullError as e:  # its advice ("--resume auto") as the command that continues this run
        if resume_with == "--resume auto" or "--resume auto" not in str(e):
            raise
        raise DiskFullError(str(e).replace("--resume auto", resume_with)) from e
    finally:
        if claim is not None and trainer is not None and trainer.steps_taken:
            claim.began = True  # from here on the run's files are kept whatever happens
    if trainer.stop_signal is not None:  # "preempted, resume me", told apart from "done" by the exit code
        saved = f"last checkpoint {last}" if last else "before its first step: nothing saved"
        raise Stopped(
            f"stopped by {signal.Signals(trainer.stop_signal).name} at step {trainer.step} "
            f"({saved}); continue with {resume_with}",
            trainer.stop_signal,
        )
    return last


def _write_run_files(plan: RunPlan, info: DistInfo, trainer: Trainer, resume_with: str) -> None:
    """config.json, the model's own tokenizer (it travels with the run and each checkpoint) and run_info.json."""
    cfg = plan.config
    save_config(cfg, os.path.join(cfg.out, "config.json"))
    if trainer.tokenizer is not None:
        save_tokenizer(trainer.tokenizer, cfg.out, what_next="free some space and start again")
    write_json(
        os.path.join(cfg.out, rundir.RUN_MARKER),
        {
            **rundir.RUN_TAG,
            **run_info(info.device, info.world_size, cfg.out),
            "params": trainer.raw.num_params(),
            "params_on_rank_0": parallel.params_on_this_rank(trainer.raw),
            "keep_cpu_memory_applied": trainer.malloc_tuned,
            "flops_per_token": trainer.flops_per_token,
            "mfu_formula": "6N + 12*n_layer*n_embd*T per token (PaLM), N without wpe",
            "plan": plan_text.record(plan),
            "resume_with": resume_with,
        },
    )

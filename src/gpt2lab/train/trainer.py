"""The training loop: one step (``Trainer.train_step``), then log, roll back, evaluate and save as due.

One ``Trainer`` per process, built from the run plan (gpt2lab.train.plan), which has made
every decision already: the Trainer builds the model, the wrapper, the optimizer and the
loader as the plan says, restores the plan's checkpoint, and runs the step and the loop.

``train_step`` reads top to bottom: the schedule's settings, the micro-batches' forward and
backward, clipping, the skip decision (train/spikes.py, judged on the device), the optimizer
step and the step's values, read back at once on a CPU and every few steps on a GPU
(``read_back``, one record per step: ``record``). ``run`` logs the records, carries out the
rollback the spikes call for (decided by the spike guard: ``_log``), evaluates
(``train.evaluation.Evaluator``) and saves. ``train.run.train`` is the whole command. Under
torchrun every rank runs the same loop on its slice of each batch; rank 0 alone prints, logs and
writes checkpoints. Steps are counted from 0; a checkpoint named ``step_N`` holds the state after
N completed steps, and a resumed run continues with step N.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as tdist

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.data.tokenizer import save_tokenizer
from gpt2lab.distributed import parallel
from gpt2lab.distributed.dist import DistInfo, agree, decided_on_rank_0
from gpt2lab.model.gpt import GPT
from gpt2lab.observe.metrics import MetricsLogger
from gpt2lab.system.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, GPT2LabError
from gpt2lab.train import schedule
from gpt2lab.train.averaging import WeightAverage
from gpt2lab.train.config import TrainConfig
from gpt2lab.train.evaluation import Evaluator, due
from gpt2lab.train.gather import detect_machine
from gpt2lab.train.init_from import load_source
from gpt2lab.train.optim import build_optimizer, unscale
from gpt2lab.train.plan import RunPlan, make_plan
from gpt2lab.train.spikes import SpikeGuard, TrainingError  # noqa: F401  (TrainingError re-exported)

# Steps between read-backs on a GPU (--check-interval 0). A read-back waits for the GPU's queue to
# drain, so the next step starts late by the host's launch time; every 16 steps spreads that over
# 16 steps of 0.1-1 s on any GPU. A NaN or spike is still found and skipped on the device at its own
# step: only the log lines, a rollback and a stop signal wait, at most 15 steps.
GPU_CHECK_INTERVAL = 16


def check_interval(configured: int, device: torch.device, optimizer, scaler, average) -> int:
    """Steps between read-backs (1: every step's verdict read back before its update, as on a CPU).
    More than 1 needs every decision on the device: an optimizer that skips there (fused AdamW, Muon),
    no fp16 grad scaler and no weight average (both act on the verdict on the host)."""
    if scaler is not None or average is not None or not getattr(optimizer, "skips_on_device", False):
        return 1
    return configured or (1 if device.type == "cpu" else GPU_CHECK_INTERVAL)


@dataclass
class Step:
    """A step that ran: where the loader was before and after it, its tokens, and its values
    (``SpikeGuard.judge``'s) on the device until read back, then its metrics record."""

    step: int
    lr: float
    start: int  # the loader's position at its start (a spike's data)
    end: int  # and after it (where a rollback's skipped data ends)
    tokens: int  # the step's
    total: int  # the run's after it
    values: torch.Tensor
    record: Optional[dict] = None


class Stopped(GPT2LabError):
    """The run stopped on a signal after saving; exit 143 (SIGTERM) or 130 (SIGINT)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = EXIT_PREEMPTED if signum == signal.SIGTERM else EXIT_INTERRUPTED


def build_model(plan: RunPlan, device: torch.device, tokenizer=None) -> GPT:
    """The plan's GPT on ``device`` (with ``tokenizer``, its own, where it has one): its --init-from weights,
    LoRA adapters and loss path."""
    cfg = plan.config
    model = GPT(cfg.model, tokenizer).to(device)
    if plan.init is not None:  # --init-from: weights only; optimizer, step and data order start fresh
        load_source(model, plan.init.source)
    ft = cfg.finetune
    if ft.lora_rank:  # before the optimizer: it gets the adapters' parameters only
        from gpt2lab.model.lora import add_lora

        add_lora(model, ft.lora_rank, ft.lora_alpha, ft.lora_targets)
    model.set_loss(plan.loss)
    model.activation_checkpointing = cfg.parallel.activation_checkpointing
    return model


class Trainer:
    def __init__(self, plan: RunPlan, info: DistInfo) -> None:
        cfg = self.cfg = plan.config
        self.plan, self.info, self.device, self.accum = plan, info, info.device, plan.accum
        self.choices = plan.choices  # dtype, compile and Muon's Newton-Schulz dtype (system.runtime)
        self.dtype, self.compile = str(self.choices.dtype.value), bool(self.choices.compile.value)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.malloc_tuned = keep_freed_memory() if cfg.system.keep_cpu_memory and self.device.type == "cpu" else False
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls
        from gpt2lab.data.tokenizer import for_data

        # the model's own tokenizer (None: GPT-2's), read from the data (the plan checked it is the model's)
        self.tokenizer = for_data(cfg.data) if cfg.model.tokenizer else None
        self.raw = build_model(plan, self.device, self.tokenizer)
        # self.raw stays the GPT (sharded in place under FSDP); train_model runs the micro-steps,
        # self.model the evaluations. The optimizer is built on the (sharded) parameters after wrapping.
        self.train_model, self.model = parallel.wrap(
            self.raw, str(plan.strategy.value), info.distributed, self.device, self.dtype, self.compile
        )
        ns = self.choices.ns_dtype
        self.optimizer = build_optimizer(
            self.raw, cfg.optim, self.device, ns_dtype=str(ns.value) if ns else None, tokenizer=self.tokenizer
        )
        from gpt2lab.data import TokenLoader

        b = cfg.batch
        self.loader = TokenLoader(
            cfg.data, "train", b.micro_batch_size, b.seq_len, rank=info.rank, world_size=info.world_size, seed=cfg.seed
        )
        self.step, self.tokens = 0, 0
        # --ema-decay: the weight average is what evaluations see (and what checkpoints hand on)
        self.average = WeightAverage(self.raw, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
        seen = (self.raw, self.model) if self.average is None else (self.average.module,) * 2
        self.spikes, self.evaluate = SpikeGuard(cfg, self.device), Evaluator(cfg, info, *seen, self.dtype)
        self.evaluate.stopping = lambda: self.stop_requested
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == "float16" else None
        if plan.resume:
            ckpt.load(plan.resume, self.parts(), verified=True)  # the plan checked its checksums
        self.flops_per_token = self.raw.flops_per_token(cfg.batch.seq_len)
        self.peak = plan.peak_flops.value
        self.stop_requested, self.stop_signal = False, None
        self.steps_taken = 0  # by this process: a start that failed before its first step removes what it wrote
        self.check_interval = check_interval(
            cfg.system.check_interval, self.device, self.optimizer, self.scaler, self.average
        )
        self.unread: list[Step] = []  # steps run and judged on the device, their values not yet read back
        self.since = time.perf_counter()  # the start of the unread steps' training time

    @classmethod
    def from_config(cls, cfg: TrainConfig, info: DistInfo, resume: Optional[str] = None) -> "Trainer":
        """A Trainer for ``cfg`` on this machine (the plan made here; for tests and benchmarks)."""
        machine = decided_on_rank_0(lambda: detect_machine(info.device, info.world_size, cfg.system.dtype))
        return cls(decided_on_rank_0(lambda: make_plan(cfg, machine, resume)), info)

    # -- state ---------------------------------------------------------------------------
    def parts(self) -> dict:
        """What a checkpoint holds: each part has state_dict/load_state_dict (None: not in this run)."""
        return {
            "model": self.raw,
            "optimizer": self.optimizer,
            "loader": self.loader,
            "rng": ckpt.RNG(),
            "scaler": self.scaler,
            "average": self.average,
            "trainer": self,
        }

    def state_dict(self) -> dict:
        """The trainer's own part: counters, the spike guard's memory and the data skipped; and
        the record of the weights the run began from, which a resume's plan reads back
        (train.gather.gather) rather than this."""
        return {
            "step": self.step,
            "tokens": self.tokens,
            "init_from": self.plan.init_record,
            **self.spikes.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.spikes.load_state_dict(state)

    def save(self) -> str:
        """Every rank: write the checkpoint for the steps completed so far (never a non-finite model)."""
        cfg = self.cfg
        # every rank gets the same answer (FSDP: each checks its shard): all raise together, none waits
        if not parallel.all_finite(self.raw):
            raise TrainingError(
                f"model has non-finite weights at step {self.step}; not saving over "
                f"the last good checkpoint in {cfg.out}/checkpoints"
            )
        # the model's own tokenizer goes into the checkpoint: the run's copy (rank 0 writes checkpoints' files)
        own = self.tokenizer is not None and self.info.is_main
        files = [save_tokenizer(self.tokenizer, cfg.out)] if own else []
        path = ckpt.save(cfg.out, self.step, self.parts(), cfg.to_dict(), cfg.checkpoint.keep_checkpoints, files)
        self.spikes.rollbacks = 0
        if self.info.distributed:
            tdist.barrier()
        return path

    # -- one optimizer step ----------------------------------------------------------------
    def train_step(self) -> list[Step]:
        """Run step ``self.step`` and count it; return the steps read back at its end, each with its
        record: this one on a CPU, else every ``check_interval`` steps (``_read_back_due``)."""
        cfg, step, world = self.cfg, self.step, self.info.world_size
        if not self.unread:
            self.since = time.perf_counter()
        # the schedule: this step's learning rates, micro-steps, sequence length, multi-token weight
        lr = schedule.set_lrs(self.optimizer, step, cfg.optim)
        accum, length = schedule.accum_at(cfg, step, world), schedule.seq_len_at(cfg.batch, step)
        if cfg.model.mtp_heads:
            self.raw.set_mtp_weight(schedule.mtp_weight_at(cfg, step))
        # the micro-batches, forward and backward, from past any data a rollback marked bad
        start = self.loader.position = self.spikes.skip_bad_data(self.loader.position)
        batch = functools.partial(self.loader.next_batch, length)  # the sequence-length ramp: shorter rows
        loss = parallel.accumulate_gradients(
            self.train_model, batch, accum, self.device, self.dtype, self.scaler, masked=self.loader.masked
        )
        # clip (fp16: the gradients unscaled first)
        unscale(self.optimizer, self.scaler)
        norm = parallel.clip_grad_norm(self.raw, cfg.optim.grad_clip or math.inf)
        # the skip decision, NaN/inf or a spike, judged on the device; read back now where the update
        # cannot skip there (check_interval 1), else handed to the optimizer as a tensor: no host sync
        values = self.spikes.judge(loss, norm)
        skip = values[2] if self.check_interval > 1 else bool(values[2])
        # the optimizer step (a skipped one changes no weight and no state), fp16's scale, the average
        self.optimizer.step(skip=skip)
        if self.scaler is not None:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.average is not None and not skip:
            self.average.update(self.raw)
        # the record, its values read back when due
        tokens = accum * cfg.batch.micro_batch_size * cfg.batch.seq_len * world
        self.tokens += tokens
        self.unread.append(Step(step, lr, start, self.loader.position, tokens, self.tokens, values))
        self.step += 1
        self.steps_taken += 1
        return self.read_back() if self._read_back_due() else []

    def read_back(self) -> list[Step]:
        """The unread steps with their records (one host sync for all of them; their time shared equally)."""
        if not self.unread:
            return []
        values = torch.stack([s.values for s in self.unread]).tolist()
        now = time.perf_counter()
        dt, self.since = (now - self.since) / len(self.unread), now
        done, self.unread = self.unread, []
        for s, v in zip(done, values):
            s.record = self.record(s, *v, dt=dt)
        return done

    def record(self, s: Step, loss: float, norm: float, skip: float, loss_z: float, norm_z: float, dt: float) -> dict:
        """A step's metrics line. A non-finite step is logged as text (NaN is not JSON, and a plot must not
        mistake it for a loss); fp16's scaler skipping one with a finite loss while it finds its scale is
        marked routine (``grad_scaler``)."""
        out: dict = {"step": s.step, "lr": s.lr}
        if not (math.isfinite(loss) and math.isfinite(norm)):
            out.update(
                skipped="nan" if math.isnan(loss) or math.isnan(norm) else "inf", loss=str(loss), grad_norm=str(norm)
            )
            if self.scaler is not None and math.isfinite(loss):
                out["grad_scaler"] = True
        elif skip:
            out.update(skipped="spike", loss=loss, grad_norm=norm, loss_z=round(loss_z, 2), norm_z=round(norm_z, 2))
        else:  # throughput, MFU and (CUDA) peak memory since the start
            tok_per_s = s.tokens / dt
            mfu = self.flops_per_token * tok_per_s / (self.peak * self.info.world_size) if self.peak else None
            out.update(train_loss=loss, grad_norm=norm, dt_ms=1000 * dt, tok_per_s=tok_per_s, mfu=mfu, tokens=s.total)
            if self.device.type == "cuda":
                out["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def _read_back_due(self) -> bool:
        """Whether the unread steps are read back now (``self.step`` just counted): every
        ``check_interval`` steps, after a process's first step (its time is the compile's), before
        anything else happens between steps (evaluation, checkpoint, the end) and, in one process,
        at a stop signal (across processes the signal is agreed at the regular read-backs)."""
        s = self.step
        return (
            len(self.unread) >= self.check_interval
            or self.steps_taken == 1
            or s == self.cfg.optim.max_steps
            or (self.stop_requested and not self.info.distributed)
            or due(self.cfg.checkpoint.ckpt_interval, s, -1)
            or self.evaluate.any_due(s)
        )

    # -- the loop ----------------------------------------------------------------------------
    def run(self, log: MetricsLogger) -> Optional[str]:
        """Train to ``max_steps`` (or a stop signal); return the last checkpoint written. Each step:
        evaluate if due, train it, log the records at hand (one, or the device's read back), roll back
        if the spikes say so, save if due or stopping. A stop during an evaluation (which it cuts short)
        saves the steps so far at once (unless saved already), so that a resumed run evaluates that step again."""
        cfg, last_ckpt = self.cfg, self.plan.resume
        with _stop_on_signals(self):
            while True:
                if self.evaluate(self.step, log) and self._stop_agreed():  # evaluations: on every rank alike
                    saved = not self.steps_taken or last_ckpt == ckpt.checkpoint_dir(cfg.out, self.step)
                    return self._stopped(last_ckpt if saved else self.save(), log)
                if self.step >= cfg.optim.max_steps:  # after the end-of-run evaluation
                    return last_ckpt
                done = self.train_step()
                if not done or self._log(done, log):  # nothing read back, or rolled back
                    continue
                stop = self._stop_agreed()
                if stop or self.step == cfg.optim.max_steps or due(cfg.checkpoint.ckpt_interval, self.step, -1):
                    last_ckpt = self.save() or last_ckpt
                if stop:
                    return self._stopped(last_ckpt, log)

    def _stopped(self, last_ckpt: Optional[str], log: MetricsLogger) -> Optional[str]:
        # train.run says how to go on
        log.console(
            f"stop signal: saved step {self.step} to {last_ckpt}" if last_ckpt else "stop signal: no step to save"
        )
        self.stop_signal = self.stop_signal or signal.SIGTERM  # another rank's signal
        return last_ckpt

    def _log(self, done: list[Step], log: MetricsLogger) -> bool:
        """Log steps' records in order, each then read by the spike guard (TrainingError after too many bad
        steps in a row); carry out the rollback the spikes call for, if they do (whether they did): restore
        its checkpoint, forget the log's records of the steps to repeat, log the decision (with no
        checkpoint before the spikes, log it only)."""

        def restore(checkpoint: str) -> None:
            ckpt.load(checkpoint, self.parts())
            log.rewind(self.step)

        for s in done:
            log.log(s.record)
            if self.spikes.read(s.record, s.start):
                log.log(self.spikes.decide(end=s.end, step=s.step + 1, restore=restore))
                return True
        return False

    def _stop_agreed(self) -> bool:
        """All ranks stop together if any of them got SIGTERM/SIGINT (one process: no device round trip)."""
        return agree(self.stop_requested) if self.info.distributed else self.stop_requested


@contextlib.contextmanager
def _stop_on_signals(trainer: Trainer):
    """SIGTERM/SIGINT set a flag: the current step (or evaluation batch, or sample token) finishes, a
    checkpoint is saved, then exit.

    A second Ctrl-C stops at once (KeyboardInterrupt): the last checkpoint stays intact,
    a save in progress is dropped whole.
    """

    def handler(signum, frame):
        if signum == signal.SIGINT and trainer.stop_signal == signal.SIGINT:
            raise KeyboardInterrupt
        trainer.stop_requested, trainer.stop_signal = True, signum
        if trainer.info.is_main:
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(
                f"{name}: stopping after this step, saving a checkpoint"
                + ("; press Ctrl-C again to stop now" if signum == signal.SIGINT else ""),
                file=sys.stderr,
                flush=True,
            )

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory(enable: bool = True) -> bool:
    """Serve large CPU tensors from the heap and keep freed memory there (glibc only).

    By default glibc gives every allocation over 32 MB its own mmap and unmaps it when
    freed, so each step's large buffers (the loss's logits) arrive as fresh pages, faulted in
    again every step. ``enable=False`` restores glibc's defaults.
    Returns whether the setting took effect (False off Linux/glibc).
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_MAX, 0 if enable else 65536)
    return bool(ok and mallopt(_M_TRIM_THRESHOLD, (1 << 30) if enable else 128 * 1024))

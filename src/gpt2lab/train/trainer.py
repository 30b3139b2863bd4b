"""The training loop: accumulate, judge, step, log; evaluate, roll back, save as due.

One ``Trainer`` per process, built from the run plan (gpt2lab.train.plan), which has made
every decision already: the Trainer builds the model, the wrapper, the optimizer and the
loader as the plan says, restores the plan's checkpoint, and runs the step and the loop.

``train_step`` accumulates the micro-steps' gradients (no_sync, autocast), clips, and has the step
judged (NaN/inf, spike) in one of two places: on the host at once (``_judge``), or on the device
(``DeviceGuard``, train/spikes.py) with its record read back every few steps (``read_back``). ``run``
logs the records, carries out the rollback the spikes call for (decided by ``train.rollback``:
``_roll_back``), evaluates (``train.evaluation.Evaluator``) and saves. ``train.run.train`` is the
whole command. Under torchrun every rank runs the same loop on its slice of each batch; rank 0
alone prints, logs and writes checkpoints. Steps are counted from 0; a checkpoint named ``step_N``
holds the state after N completed steps, and a resumed run continues with step N.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import signal
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as tdist

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.data.tokenizer import save_tokenizer
from gpt2lab.distributed import parallel
from gpt2lab.distributed.dist import DistInfo, all_reduce_mean, all_reduce_sum, autocast, decided_on_rank_0
from gpt2lab.model.gpt import GPT
from gpt2lab.observe.metrics import MetricsLogger
from gpt2lab.system.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, GPT2LabError
from gpt2lab.train.averaging import WeightAverage
from gpt2lab.train.config import TrainConfig
from gpt2lab.train.evaluation import Evaluator, due
from gpt2lab.train.gather import detect_machine
from gpt2lab.train.init_from import load_source
from gpt2lab.train.optim import apply_update, build_optimizer, scheduled_lr, skips_on_device, unscaled_grad_norm
from gpt2lab.train.plan import RunPlan, make_plan
from gpt2lab.train.rollback import Rollback, RollbackDecision, TrainingError  # noqa: F401  (TrainingError re-exported)
from gpt2lab.train.spikes import DeviceGuard

Batch = tuple[torch.Tensor, torch.Tensor]

# Steps between read-backs on a GPU (--check-interval 0). A read-back waits for the GPU's queue to
# drain, so the next step starts late by the host's launch time; every 16 steps spreads that over
# 16 steps of 0.1-1 s on any GPU. A NaN or spike is still found and skipped on the device at its own
# step: only the log lines, a rollback and a stop signal wait, at most 15 steps.
GPU_CHECK_INTERVAL = 16


def check_interval(configured: int, device: torch.device, optimizer, scaler, average) -> int:
    """Steps between read-backs (1: every step decided on the host, as on a CPU). More than 1 needs
    every decision on the device: an optimizer that skips there (fused AdamW, Muon), no fp16 grad
    scaler and no weight average (both decide on the host)."""
    if scaler is not None or average is not None or not skips_on_device(optimizer):
        return 1
    if configured:
        return configured
    return 1 if device.type == "cpu" else GPU_CHECK_INTERVAL


class Stopped(GPT2LabError):
    """The run stopped on a signal after saving; exit 143 (SIGTERM) or 130 (SIGINT)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = EXIT_PREEMPTED if signum == signal.SIGTERM else EXIT_INTERRUPTED


def accumulate_gradients(
    model: torch.nn.Module,
    next_batch: Callable[[], Batch],
    accum: int,
    device: torch.device,
    dtype: str,
    scaler=None,
    masked: bool = False,
) -> torch.Tensor:
    """Forward/backward ``accum`` micro-batches; return the mean loss over the step's targets, all ranks.

    Each micro-loss (a mean over its targets) is weighted so that the summed gradients are those
    of the mean over every target of the step: 1/accum when every micro-batch has the same number
    of targets (text); ``masked`` (conversations, where targets the loss skips are -1), its share of
    the step's supervised targets summed over ranks, so a micro-batch holding few assistant tokens
    counts for few. Under DDP and FSDP, gradients are reduced over ranks (a mean) only on the last
    micro-step.
    """
    batches = [next_batch() for _ in range(accum)] if masked else None
    weights = _target_weights(batches, device) if masked else [1.0 / accum] * accum
    total = torch.zeros((), dtype=torch.float32, device=device)
    for micro in range(accum):
        x, y = batches[micro] if masked else next_batch()
        if device.type == "cuda" and x.device.type == "cpu":  # from pinned memory the copy is queued; from
            x, y = x.pin_memory(), y.pin_memory()  # pageable it waits for the GPU (bench memory's are on the GPU)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = micro == accum - 1
        with parallel.sync_gradients(model, last):
            with autocast(device, dtype):
                _, loss = model(x, y, return_logits=False)
            loss = loss * weights[micro]
            total += loss.detach().float()
            (scaler.scale(loss) if scaler is not None else loss).backward()
    return all_reduce_mean(total)


def _target_weights(batches: list[Batch], device: torch.device) -> list[torch.Tensor]:
    """Each micro-batch's weight n_i * world / N: n_i its supervised targets, N the step's over all
    ranks (summed on the device: no host sync). Ranks' gradients are then averaged, so the step's
    gradient is that of the mean loss over all N targets."""
    counts = torch.tensor([float((y != -1).sum()) for _, y in batches], device=device)
    n = all_reduce_sum(counts.sum())
    world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
    return list(counts * world / n.clamp(min=1))


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
        self.choices, self.dtype, self.compile = plan.choices, str(plan.dtype.value), bool(plan.compile.value)
        _seed_everything(cfg.seed)
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
            self.raw,
            str(plan.strategy.value),
            distributed=info.distributed,
            device=self.device,
            dtype=self.dtype,
            compile=self.compile,
        )
        ns = plan.ns_dtype
        self.optimizer = build_optimizer(
            self.raw, cfg.optim, self.device, ns_dtype=str(ns.value) if ns else None, tokenizer=self.tokenizer
        )
        from gpt2lab.data import TokenLoader

        self.loader = TokenLoader(
            cfg.data,
            "train",
            cfg.batch.micro_batch_size,
            cfg.batch.seq_len,
            rank=info.rank,
            world_size=info.world_size,
            seed=cfg.seed,
        )
        self.step, self.tokens = 0, 0
        # --ema-decay: the weight average is what evaluations see (and what checkpoints hand on)
        self.average = WeightAverage(self.raw, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
        seen = (self.raw, self.model) if self.average is None else (self.average.module,) * 2
        self.spikes, self.evaluate = Rollback(cfg), Evaluator(cfg, info, *seen, self.dtype)
        self.evaluate.stopping = lambda: self.stop_requested
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == "float16" else None
        if plan.resume:
            self.restore(plan.resume, verified=True)  # the plan checked its checksums
        self.flops_per_token = self.raw.flops_per_token(cfg.batch.seq_len)
        self.peak = plan.peak_flops.value
        self.stop_requested, self.stop_signal = False, None
        self.steps_taken = 0  # by this process: a start that failed before its first step removes what it wrote
        self.check_interval = check_interval(
            cfg.system.check_interval, self.device, self.optimizer, self.scaler, self.average
        )
        self.pending: list[tuple] = []  # steps the device has run and judged, their records not yet read back
        self.device_guard: Optional[DeviceGuard] = None  # built from the host guard's state when first used
        self.since = time.perf_counter()  # the start of the pending steps' training time

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
        (train.gather.began_from) rather than this."""
        return {
            "step": self.step,
            "tokens": self.tokens,
            "init_from": self.plan.init_record,
            **self.spikes.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.spikes.load_state_dict(state)
        self.device_guard = None  # rebuilt from the restored host guard

    def restore(self, path: str, verified: bool = False) -> None:
        ckpt.load(path, self.parts(), verified=verified)

    def save(self) -> str:
        """Every rank: write the checkpoint for the steps completed so far (never a non-finite model)."""
        # every rank gets the same answer (FSDP: each checks its shard): all raise together, none waits
        if not parallel.all_finite(self.raw):
            raise TrainingError(
                f"model has non-finite weights at step {self.step}; not saving over "
                f"the last good checkpoint in {self.cfg.out}/checkpoints"
            )
        # the model's own tokenizer goes into the checkpoint: the run's copy (rank 0 writes checkpoints' files)
        own = self.tokenizer is not None and self.info.is_main
        files = [save_tokenizer(self.tokenizer, self.cfg.out)] if own else []
        path = ckpt.save(
            self.cfg.out,
            self.step,
            self.parts(),
            self.cfg.to_dict(),
            keep=self.cfg.checkpoint.keep_checkpoints,
            files=files,
        )
        self.spikes.saved()
        if self.info.distributed:
            tdist.barrier()
        return path

    # -- one optimizer step ----------------------------------------------------------------
    def train_step(self) -> Optional[dict]:
        """Run step ``self.step``: accumulate its micro-steps' gradients, judge them, take or skip the
        update; return its metrics record. None when it was judged on the device (``check_interval`` > 1):
        its record waits in ``pending`` for the next ``read_back``."""
        cfg, t0 = self.cfg, time.perf_counter()
        lr = scheduled_lr(self.step, cfg.optim)  # max_lr's group; set_lrs gives every group its own
        position = self.loader.position = self.spikes.skip_bad_data(self.loader.position)
        accum = cfg.accum_at(self.step, self.info.world_size)  # self.accum, or fewer on the batch ramp
        if cfg.model.mtp_heads:  # the multi-token prediction loss's weight at this step
            self.raw.set_mtp_weight(cfg.mtp_weight_at(self.step))
        length, next_batch = cfg.seq_len_at(self.step), self.loader.next_batch
        if length != cfg.batch.seq_len:  # the sequence-length ramp: the same tokens in shorter rows
            next_batch = functools.partial(next_batch, length)
        loss = accumulate_gradients(
            self.train_model,
            next_batch,
            accum,
            self.device,
            self.dtype,
            self.scaler,
            masked=self.loader.masked,
        )
        norm = unscaled_grad_norm(self.raw, self.optimizer, self.scaler, cfg.optim.grad_clip)
        tokens = accum * cfg.batch.micro_batch_size * cfg.batch.seq_len * self.info.world_size
        self.tokens += tokens
        if self.check_interval > 1:
            return self._step_on_device(lr, position, tokens, loss, norm)
        take, judged = self._judge(position, loss.item(), norm.item())
        apply_update(self.optimizer, self.scaler, self.step, cfg.optim, take=take)
        if self.average is not None and take:
            self.average.update(self.raw)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        record = {"step": self.step, "lr": lr, **judged}
        return record if "skipped" in judged else {**record, **self._speed(dt, tokens)}

    def _judge(self, position: int, loss: float, norm: float) -> tuple[bool, dict]:
        """The host's verdict on a step read back at once: (take its update, the record's fields). A
        non-finite step is skipped (logged as text: NaN is not JSON, and a plot must not mistake it for a
        loss), unless fp16's grad scaler skips it itself while it finds its scale; a spike is skipped."""
        finite = bool(np.isfinite(loss) and np.isfinite(norm))
        if not finite:
            kind = "nan" if np.isnan(loss) or np.isnan(norm) else "inf"
            fields = {"skipped": kind, "loss": str(loss), "grad_norm": str(norm)}
            scaler_skip = self.scaler is not None and bool(np.isfinite(loss))
            return (True, {**fields, "grad_scaler": True}) if scaler_skip else (False, fields)
        spike = self.spikes.check(self.step, position, loss, norm)
        if spike is not None:
            return False, {"skipped": "spike", "loss": loss, "grad_norm": norm, **spike}
        return True, {"train_loss": loss, "grad_norm": norm}

    def _step_on_device(self, lr: float, position: int, tokens: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """The rest of a step with no host sync: the device's guard judges it (NaN/inf, spike) and the
        optimizer skips it there if bad; what ``read_back`` needs is kept in ``pending``."""
        if self.device_guard is None:
            self.device_guard = DeviceGuard(self.spikes.guard, self.device)
        bad, z_loss, z_norm = self.device_guard.check(loss, norm)
        apply_update(self.optimizer, None, self.step, self.cfg.optim, take=True, skip=bad)
        dt = self.device_guard.dtype
        values = torch.stack([loss.detach().to(dt), norm.detach().to(dt), bad.to(dt), z_loss, z_norm])
        self.pending.append((self.step, lr, position, self.loader.position, tokens, self.tokens, values))
        return None

    def read_back(self) -> list[tuple[dict, int, Optional[tuple]]]:
        """The pending steps' records (one host sync for all of them), each with the loader position
        after its step and what the host guard is to learn of it (``SpikeGuard.record``'s arguments:
        the device's verdict; ``_log`` hands them on in order). Their time is shared equally."""
        if not self.pending:
            return []
        values = torch.stack([p[-1] for p in self.pending]).tolist()
        now = time.perf_counter()
        dt, self.since = (now - self.since) / len(self.pending), now
        out = []
        for (step, lr, position, after, tokens, total, _), (loss, norm, bad, z_loss, z_norm) in zip(
            self.pending, values
        ):
            record, verdict = {"step": step, "lr": lr}, (step, position, loss, norm, bool(bad))
            if not (math.isfinite(loss) and math.isfinite(norm)):
                record.update(
                    skipped="nan" if math.isnan(loss) or math.isnan(norm) else "inf",
                    loss=str(loss),
                    grad_norm=str(norm),
                )
                verdict = None
            elif bad:
                record.update(
                    skipped="spike", loss=loss, grad_norm=norm, loss_z=round(z_loss, 2), norm_z=round(z_norm, 2)
                )
            else:
                record.update(train_loss=loss, grad_norm=norm, **self._speed(dt, tokens, total))
            out.append((record, after, verdict))
        self.pending = []
        return out

    def _read_back_due(self) -> bool:
        """Whether the pending records are read back now (``self.step`` just incremented): every
        ``check_interval`` steps, after a process's first step (its time is the compile's), before
        anything else happens between steps (evaluation, checkpoint, the end) and, in one process,
        at a stop signal (across processes the signal is agreed at the regular read-backs)."""
        s = self.step
        return (
            len(self.pending) >= self.check_interval
            or self.steps_taken == 1
            or s == self.cfg.optim.max_steps
            or (self.stop_requested and not self.info.distributed)
            or due(self.cfg.checkpoint.ckpt_interval, s, -1)
            or self.evaluate.any_due(s)
        )

    def _speed(self, dt: float, tokens: int, total: Optional[int] = None) -> dict:
        """Throughput, MFU and (CUDA) peak memory of a step of ``tokens`` that took ``dt`` seconds
        (``total``: the run's tokens after it, default all so far)."""
        tok_per_s = tokens / dt
        mfu = self.flops_per_token * tok_per_s / (self.peak * self.info.world_size) if self.peak else None
        out = {
            "dt_ms": 1000 * dt,
            "tok_per_s": tok_per_s,
            "mfu": mfu,
            "tokens": self.tokens if total is None else total,
        }
        if self.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30  # since the start
        return out

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
                if not self.pending:
                    self.since = time.perf_counter()
                record = self.train_step()
                self.step += 1
                self.steps_taken += 1
                if record is not None:
                    done = [(record, self.loader.position, None)]
                else:
                    done = self.read_back() if self._read_back_due() else []
                if not done:
                    continue
                rollback = self._log(done, log)
                if rollback is not None:
                    self._roll_back(rollback, log)
                    continue
                stop = self._stop_agreed()
                if stop or self.step == cfg.optim.max_steps or due(cfg.checkpoint.ckpt_interval, self.step, -1):
                    last_ckpt = self.save() or last_ckpt
                if stop:
                    return self._stopped(last_ckpt, log)

    def _stopped(self, last_ckpt: Optional[str], log: MetricsLogger) -> Optional[str]:
        log.console(f"stop signal: saved step {self.step} to {last_ckpt}")  # train.run says how to go on
        self.stop_signal = self.stop_signal or signal.SIGTERM  # another rank's signal
        return last_ckpt

    def _log(self, done: list[tuple[dict, int, Optional[tuple]]], log: MetricsLogger) -> Optional[RollbackDecision]:
        """Log steps' records in order (the host guard learning the device's verdicts as it goes) and
        count bad steps (TrainingError after too many in a row); the rollback the spikes call for, if
        they do (the records after that step are dropped: the rollback repeats those steps)."""
        for record, after, verdict in done:
            if verdict is not None:
                self.spikes.guard.record(*verdict)
            log.log(record)
            self.spikes.check_bad(record)
            if self.spikes.due(record, record["step"] + 1):
                return self.spikes.decide(end=after, step=record["step"] + 1)
        return None

    def _roll_back(self, decision: RollbackDecision, log: MetricsLogger) -> None:
        """Carry out a rollback: restore its checkpoint (the rollback keeping its newer skips), forget
        the log's records of the steps to repeat, log the decision; with no checkpoint, log it only."""
        if decision.target is not None:
            self.restore(decision.target)
            self.spikes.rolled_back(decision)
            log.rewind(self.step)
        log.log(decision.record)

    def _stop_agreed(self) -> bool:
        """All ranks stop together if any of them got SIGTERM/SIGINT (one process: no device round trip)."""
        if not self.info.distributed:
            return self.stop_requested
        flag = torch.tensor(float(self.stop_requested), device=self.device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return bool(flag.item())


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


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

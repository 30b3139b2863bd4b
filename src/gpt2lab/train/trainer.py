"""The training loop: micro-steps with no_sync, autocast, clip, AdamW step, log, eval, save.

One ``Trainer`` per process. Under torchrun every rank runs the same loop on its slice of
each batch; rank 0 alone prints, logs and writes checkpoints. Steps are counted from 0;
a checkpoint named ``step_N`` holds the state after N completed steps, and a resumed run
continues with step N.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as tdist

from gpt2lab.checkpoint import store as ckpt
from gpt2lab.distributed import parallel
from gpt2lab.system import runtime
from gpt2lab.system import hardware
from gpt2lab.train.config import ConfigError, TrainConfig, save_config
from gpt2lab.distributed.dist import DistInfo, all_reduce_mean, autocast, decided_on_rank_0
from gpt2lab.system.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, GPT2LabError, RunDiverged
from gpt2lab.system.files import sweep_stale
from gpt2lab.train.init_from import adapt_config, load_into
from gpt2lab.train import preflight
from gpt2lab.observe.metrics import MetricsLogger, run_info
from gpt2lab.system.files import write_json
from gpt2lab.model.gpt import GPT
from gpt2lab.train.optim import build_optimizer, parts, scheduled_lr, set_lrs
from gpt2lab.train.spikes import SpikeGuard
from gpt2lab.inference.generate import generate

Batch = tuple[torch.Tensor, torch.Tensor]


class TrainingError(RunDiverged):
    """The run cannot continue (e.g. repeated NaN losses); the message says what to do."""


class Stopped(GPT2LabError):
    """The run stopped on a signal after saving; exit 143 (SIGTERM) or 130 (SIGINT)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = EXIT_PREEMPTED if signum == signal.SIGTERM else EXIT_INTERRUPTED


# Rollbacks to the same checkpoint before the run gives up (the spikes are not the data's fault).
MAX_ROLLBACKS = 5


def accumulate_gradients(model: torch.nn.Module, next_batch: Callable[[], Batch], accum: int,
                         device: torch.device, dtype: str, scaler=None) -> torch.Tensor:
    """Forward/backward ``accum`` micro-batches; return the mean loss over micro-steps and ranks.

    Each micro-loss is scaled by 1/accum so the summed gradients are those of the whole
    batch; under DDP and FSDP, gradients are reduced over ranks only on the last micro-step.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    for micro in range(accum):
        x, y = next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = micro == accum - 1
        with parallel.sync_gradients(model, last):
            with autocast(device, dtype):
                _, loss = model(x, y, return_logits=False)
            loss = loss / accum
            total += loss.detach().float()
            (scaler.scale(loss) if scaler is not None else loss).backward()
    return all_reduce_mean(total)


def loss_settings(device: torch.device, compiled: bool) -> tuple[bool, bool]:
    """(compile_loss, chunked_loss) for GPT: the chunked loss where chunked_loss.used_for says,
    its softmax kernel compiled when the model is."""
    from gpt2lab.model.loss import used_for

    return compiled, used_for(device.type, compiled)


def peak_flops(cfg: TrainConfig, device: torch.device) -> Optional[float]:
    if cfg.peak_flops:
        return cfg.peak_flops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return hardware.peak_flops(name)
    return None


class Trainer:
    def __init__(self, cfg: TrainConfig, info: DistInfo, resume: Optional[str] = None,
                 resume_verified: bool = False) -> None:
        self.cfg, self.info, self.device = cfg, info, info.device
        self.accum = cfg.grad_accum_steps(info.world_size)
        self.choices = _resolve_choices(cfg, info)
        self.dtype, self.compile = str(self.choices.dtype.value), bool(self.choices.compile.value)
        _seed_everything(cfg.seed)
        self.malloc_tuned = keep_freed_memory() if cfg.keep_cpu_memory and self.device.type == "cpu" else False
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls
        self.raw = GPT(cfg.model).to(self.device)
        self.init_source = None  # --init-from: weights only; optimizer, step and data order start fresh
        if cfg.init_from and not resume:
            self.init_source = load_into(self.raw, cfg.init_from)
            self.cfg = cfg = dataclasses.replace(cfg, init_from_id=self.init_source["id"])
        if cfg.lora_rank:  # before the optimizer: it gets the adapters' parameters only
            from gpt2lab.model.lora import add_lora

            add_lora(self.raw, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        self.raw.compile_loss, self.raw.chunked_loss = loss_settings(self.device, self.compile)
        self.raw.activation_checkpointing = cfg.activation_checkpointing
        self.strategy = _resolve_strategy(cfg, info, self.dtype, self.accum, self.compile)
        # self.raw stays the GPT (sharded in place under FSDP); train_model runs the micro-steps,
        # self.model the evaluations. The optimizer is built on the (sharded) parameters after wrapping.
        self.train_model, self.model = parallel.wrap(self.raw, str(self.strategy.value), distributed=info.distributed,
                                                     device=self.device, dtype=self.dtype, compile=self.compile)
        ns = self.choices.ns_dtype
        self.optimizer = build_optimizer(self.raw, cfg, self.device, ns_dtype=str(ns.value) if ns else None)
        from gpt2lab.data import TokenLoader

        self.loader = TokenLoader(cfg.data, "train", cfg.micro_batch_size, cfg.seq_len, rank=info.rank,
                                  world_size=info.world_size, seed=cfg.seed)
        self.step, self.tokens, self.bad_steps = 0, 0, 0
        self.guard = SpikeGuard(cfg.spike_window, cfg.spike_loss_z, cfg.spike_norm_z, cfg.spike_rollback)
        self.skips: list[list[int]] = []  # [start, end) loader positions never trained on (spike rollbacks)
        self.rollbacks = 0  # since the last checkpoint was saved
        use_scaler = self.dtype == "float16"
        self.scaler = torch.amp.GradScaler(self.device.type) if use_scaler else None
        self.resumed_from = self._restore(resume, resume_verified) if resume else None
        self.flops_per_token = self.raw.flops_per_token(cfg.seq_len)
        self.peak = peak_flops(cfg, self.device)
        self.stop_requested = False
        self.stop_signal: Optional[int] = None

    # -- state ---------------------------------------------------------------------------
    def parts(self) -> dict:
        """What a checkpoint holds: each part has state_dict/load_state_dict (None: not in this run)."""
        return {"model": self.raw, "optimizer": self.optimizer, "loader": self.loader, "rng": ckpt.RNG(),
                "scaler": self.scaler, "trainer": self}

    def state_dict(self) -> dict:
        """The trainer's own part: counters, the spike guard's memory and the data skipped."""
        return {"step": self.step, "tokens": self.tokens, "guard": self.guard.state_dict(), "skips": self.skips}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        if state.get("guard"):
            self.guard.load_state_dict(state["guard"])
        self.skips = [list(r) for r in state.get("skips", [])]

    def _restore(self, path: str, verified: bool = False) -> str:
        where = ckpt.resolve(path)
        ckpt.load(where, self.parts(), verified=verified)
        saved = ckpt.read_config(where)
        if saved.get("init_from_id"):  # the run began from other weights: keep saying which
            self.cfg = dataclasses.replace(self.cfg, init_from=saved["init_from"], init_from_id=saved["init_from_id"])
        return where

    def save(self) -> str:
        """Every rank: write the checkpoint for the steps completed so far (never a non-finite model)."""
        # every rank gets the same answer (FSDP: each checks its shard): all raise together, none waits
        if not parallel.all_finite(self.raw):
            raise TrainingError(f"model has non-finite weights at step {self.step}; not saving over "
                                f"the last good checkpoint in {self.cfg.out}/checkpoints")
        path = ckpt.save(self.cfg.out, self.step, self.parts(), self.cfg.to_dict(), keep=self.cfg.keep_checkpoints)
        self.rollbacks = 0
        if self.info.distributed:
            tdist.barrier()
        return path

    # -- one optimizer step ----------------------------------------------------------------
    def train_step(self) -> dict:
        """Run step ``self.step`` (all its micro-steps) and return its metrics record."""
        cfg, t0 = self.cfg, time.perf_counter()
        lr = scheduled_lr(self.step, cfg)  # max_lr's group; set_lrs gives every group its own
        position = self._skip_bad_data()
        loss = accumulate_gradients(self.train_model, self.loader.next_batch, self.accum, self.device, self.dtype,
                                    self.scaler)
        if self.scaler is not None:
            for opt in parts(self.optimizer):
                self.scaler.unscale_(opt)
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        norm = parallel.clip_grad_norm(self.raw, clip)  # the whole gradient's norm, sharded or not
        loss_v, norm_v = loss.item(), norm.item()
        finite = bool(np.isfinite(loss_v) and np.isfinite(norm_v))
        # fp16: the scaler itself skips steps with inf gradients (and backs off) while it finds its scale
        scaler_skip = self.scaler is not None and bool(np.isfinite(loss_v)) and not finite
        spike = self.guard.check(self.step, position, loss_v, norm_v) if finite else None
        if (finite and spike is None) or scaler_skip:
            set_lrs(self.optimizer, self.step, cfg)
            if self.scaler is not None:
                for opt in parts(self.optimizer):
                    self.scaler.step(opt)
                self.scaler.update()
            else:
                self.optimizer.step()
        elif self.scaler is not None:  # unscale_ ran: update() must follow (it also backs off the scale)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.tokens += cfg.total_batch_tokens
        if not finite:  # logged as text: NaN is not JSON, and a plot must not mistake it for a loss
            kind = "nan" if np.isnan(loss_v) or np.isnan(norm_v) else "inf"
            rec = {"step": self.step, "skipped": kind, "loss": str(loss_v), "grad_norm": str(norm_v), "lr": lr}
            return {**rec, "grad_scaler": True} if scaler_skip else rec
        if spike is not None:
            return {"step": self.step, "skipped": "spike", "loss": loss_v, "grad_norm": norm_v, "lr": lr, **spike}
        tok_per_s = cfg.total_batch_tokens / dt
        mfu = self.flops_per_token * tok_per_s / (self.peak * self.info.world_size) if self.peak else None
        return {"step": self.step, "train_loss": loss_v, "lr": lr, "grad_norm": norm_v, "dt_ms": 1000 * dt,
                "tok_per_s": tok_per_s, "mfu": mfu, "tokens": self.tokens,
                **({"peak_mem_gib": torch.cuda.max_memory_allocated(self.device) / 2 ** 30}  # since the start
                   if self.device.type == "cuda" else {})}

    def check_bad(self, record: dict) -> None:
        """Count skipped steps in a row; stop the run after ``max_bad_steps`` of them.

        A step the fp16 grad scaler skipped while lowering its scale is routine, not counted.
        """
        if record.get("grad_scaler"):
            return
        self.bad_steps = self.bad_steps + 1 if "skipped" in record else 0
        if self.bad_steps >= self.cfg.max_bad_steps:
            last = ckpt.find_latest(self.cfg.out) or "none yet"
            raise TrainingError(
                f"{self.bad_steps} steps in a row had a non-finite or spiking loss or gradient norm (last at step "
                f"{record['step']}); stopping. The last good checkpoint is {last}. Lower --max-lr, "
                "raise --warmup-steps or use --dtype bfloat16/float32, then --resume from it.")

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, log: MetricsLogger) -> None:
        cfg, s = self.cfg, self.step
        if _due(cfg.eval_interval, s, cfg.max_steps):
            val = self.val_loss()
            log.log({"step": s, "val_loss": val})
        if _due(cfg.hellaswag_interval, s, cfg.max_steps):
            from gpt2lab.evals.hellaswag import evaluate_hellaswag

            with parallel.gathered(self.raw):  # FSDP: ranks score different numbers of batches
                res = evaluate_hellaswag(self.model, cfg.hellaswag_data, device=self.device, dtype=self.dtype,
                                         batch_size=cfg.micro_batch_size, limit=cfg.hellaswag_limit,
                                         rank=self.info.rank, world_size=self.info.world_size)
            log.log({"step": s, "hellaswag_acc": res["acc"], "hellaswag_acc_norm": res["acc_norm"],
                     "hellaswag_n": res["n"]})
        if _due(cfg.sample_interval, s, cfg.max_steps):
            with parallel.gathered(self.raw):  # FSDP: every rank gathers; rank 0 alone generates
                text = self.sample() if self.info.is_main else None
            if text is not None:
                log.log({"step": s, "sample": text})
        if self.info.is_main and (_due(cfg.eval_interval, s, cfg.max_steps)
                                  or _due(cfg.hellaswag_interval, s, cfg.max_steps)):
            _plot(cfg.out)

    def val_loss(self) -> float:
        from gpt2lab.evals.loss import evaluate_loss

        with parallel.gathered(self.raw):  # FSDP: one all-gather, not one per block and batch
            return evaluate_loss(self.model, self.cfg.data, tokens=self.cfg.eval_tokens,
                                 batch_size=self.cfg.micro_batch_size, seq_len=self.cfg.seq_len,
                                 device=self.device, dtype=self.dtype, rank=self.info.rank,
                                 world_size=self.info.world_size)

    @torch.no_grad()
    def sample(self) -> str:
        """A continuation of the fixed prompt (uncompiled model: generation has varying shapes)."""
        from gpt2lab.data.tokenizer import EOT_ID, get_tokenizer

        enc = get_tokenizer()
        idx = torch.tensor([enc.encode(self.cfg.sample_prompt, allowed_special="all")], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(42)  # own generator: training RNG untouched
        self.raw.eval()
        # eager: under FSDP the blocks are compiled in place, and generation has varying shapes
        with autocast(self.device, self.dtype), torch.compiler.set_stance("force_eager"):
            out = generate(self.raw, idx, self.cfg.sample_tokens, top_k=50, generator=gen, stop_token=EOT_ID)
        self.raw.train()
        return enc.decode([t for t in out[0].tolist() if t != EOT_ID])

    # -- the loop ----------------------------------------------------------------------------
    def run(self, log: MetricsLogger) -> Optional[str]:
        """Train to ``max_steps`` (or a stop signal); return the last checkpoint written."""
        cfg, last_ckpt = self.cfg, None
        with _stop_on_signals(self):
            while self.step < cfg.max_steps:
                self.evaluate(log)
                record = self.train_step()
                log.log(record)
                self.check_bad(record)
                self.step += 1
                if record.get("skipped") == "spike" and self.guard.rollback_due(self.step):
                    self.rollback(log)
                    continue
                stop = self._stop_agreed()
                if stop or self.step == cfg.max_steps or _due(cfg.ckpt_interval, self.step, -1):
                    last_ckpt = self.save() or last_ckpt
                if stop:
                    log.console(f"stop signal: saved step {self.step} to {last_ckpt}; resume with --resume auto")
                    self.stop_signal = self.stop_signal or signal.SIGTERM  # another rank's signal
                    return last_ckpt
        self.evaluate(log)  # the end-of-run evaluation (step == max_steps)
        return last_ckpt

    # -- the spike guard's rollback ---------------------------------------------------------
    def _skip_bad_data(self) -> int:
        """Jump over data a rollback marked bad; return the loader position this step starts at."""
        for start, end in self.skips:
            if start <= self.loader.position < end:
                self.loader.position = end
        return self.loader.position

    def rollback(self, log: MetricsLogger) -> None:
        """Back to the newest checkpoint before the first recent spike; never train on the spiking steps' data."""
        first_step, first_pos = self.guard.first_spike()
        target = next((p for p in reversed(ckpt.list_checkpoints(self.cfg.out)) if ckpt.step_of(p) <= first_step),
                      None)
        skip = [first_pos, self.loader.position]
        self.skips.append(skip)
        T = self.cfg.seq_len
        record = {"step": self.step, "rollback_to": target, "skip_positions": skip,
                  "skip_tokens": [skip[0] * T, skip[1] * T], "spike_steps": [s for s, _ in self.guard.spikes]}
        if target is None:  # nothing saved before the spikes; their updates were skipped anyway: go on
            self.guard.spikes = []
            log.log({**record, "note": "no checkpoint before the spikes; continuing without rolling back"})
            return
        self.rollbacks += 1
        if self.rollbacks > MAX_ROLLBACKS:
            raise TrainingError(f"rolled back to {target} {MAX_ROLLBACKS} times and the loss still spikes; "
                                "the data is not the cause: lower --max-lr or raise --warmup-steps and "
                                f"--resume from {target}, or set --spike-rollback 0")
        skips, rollbacks = self.skips, self.rollbacks
        self._restore(target)
        self.skips, self.rollbacks, self.bad_steps = skips, rollbacks, 0  # newer than the checkpoint's own
        log.rewind(self.step)
        log.log(record)

    def _stop_agreed(self) -> bool:
        """All ranks stop together if any of them got SIGTERM/SIGINT."""
        flag = torch.tensor(float(self.stop_requested), device=self.device)
        if self.info.distributed:
            tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return bool(flag.item())


def _due(interval: int, step: int, final: int) -> bool:
    return interval > 0 and (step % interval == 0 or step == final)


@contextlib.contextmanager
def _stop_on_signals(trainer: Trainer):
    """SIGTERM/SIGINT set a flag: the current step finishes, a checkpoint is saved, then exit.

    A second Ctrl-C stops at once (KeyboardInterrupt): the last checkpoint stays intact,
    a save in progress is dropped whole.
    """
    def handler(signum, frame):
        if signum == signal.SIGINT and trainer.stop_signal == signal.SIGINT:
            raise KeyboardInterrupt
        trainer.stop_requested, trainer.stop_signal = True, signum
        if trainer.info.is_main:
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(f"{name}: stopping after this step, saving a checkpoint"
                  + ("; press Ctrl-C again to stop now" if signum == signal.SIGINT else ""),
                  file=sys.stderr, flush=True)

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
    freed, so each step's logit buffers arrive as fresh pages: ~190k page faults per
    shakespeare-cpu step, half its time. ``enable=False`` restores glibc's defaults.
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


def _resolve_choices(cfg: TrainConfig, info: DistInfo) -> runtime.Resolved:
    """dtype and compile for this run (runtime.resolve); under torchrun rank 0 decides for all,
    so that no probe's noise can leave the ranks training in different dtypes."""
    ns_dtype = cfg.muon_ns_dtype if cfg.optimizer == "muon" else None
    return decided_on_rank_0(lambda: runtime.resolve(info.device, cfg.dtype, cfg.compile, ns_dtype=ns_dtype))


def _resolve_strategy(cfg: TrainConfig, info: DistInfo, dtype: str, accum: int, compile: bool) -> runtime.Choice:
    """ddp or fsdp (parallel.choose_strategy, DDP's memory from memplan); under torchrun rank 0 decides for all."""
    def decide() -> runtime.Choice:
        device_bytes = parallel.device_bytes(info.device)
        ddp_bytes = None
        if device_bytes is not None and info.world_size > 1:  # a GPU's own memory: what DDP would need of it
            from gpt2lab.distributed import memplan

            ddp_bytes = memplan.predict(cfg.model, strategy="ddp", world_size=info.world_size,
                                        micro_batch=cfg.micro_batch_size, seq_len=cfg.seq_len, dtype=dtype,
                                        activation_checkpointing=cfg.activation_checkpointing, accum=accum,
                                        device="cuda", compiled=compile).total
        return parallel.choose_strategy(
            cfg.strategy, world_size=info.world_size, device_type=info.device.type, dtype=dtype,
            lora=bool(cfg.lora_rank), ddp_bytes=ddp_bytes, device_bytes=device_bytes)

    return decided_on_rank_0(decide)


def _plot(run_dir: str) -> None:
    try:
        from gpt2lab.observe.plot import plot_runs
    except ImportError:  # matplotlib (the plot extra) not installed: plots are optional
        return
    plot_runs([run_dir], os.path.join(run_dir, "plot.png"))


def train(cfg: TrainConfig, info: DistInfo, resume: Optional[str] = None) -> Optional[str]:
    """Everything ``gpt2lab train`` does after parsing; returns the last checkpoint path."""
    if info.is_main:  # temporaries of killed runs (never of a live one) would block a full disk
        for folder in (cfg.out, os.path.join(cfg.out, "checkpoints")):
            sweep_stale(folder)
    verified = resume == "auto"  # find_intact has just checked its checksums
    resume = decided_on_rank_0(lambda: _resolve_resume(cfg, resume))
    if cfg.init_from and not resume:
        cfg = adapt_config(cfg)  # SRC checked before any work; a conflicting architecture is an error
    preflight.check_resume(cfg, resume)
    preflight.check_splits(cfg, info.world_size, info.is_main)
    _check_hellaswag(cfg)
    trainer = Trainer(cfg, info, resume, resume_verified=verified)
    cfg = trainer.cfg  # with where the weights came from
    if info.is_main:
        os.makedirs(cfg.out, exist_ok=True)
        save_config(cfg, os.path.join(cfg.out, "config.json"))
        write_json(os.path.join(cfg.out, "run_info.json"),
                   {**run_info(info.device, info.world_size), "grad_accum_steps": trainer.accum,
                    "resumed_from": trainer.resumed_from, "params": trainer.raw.num_params(),
                    "params_on_rank_0": parallel.params_on_this_rank(trainer.raw),
                    "choices": {**trainer.choices.record(), "strategy": trainer.strategy.value,
                                "strategy_reason": trainer.strategy.reason,
                                "activation_checkpointing": cfg.activation_checkpointing},
                    "init_from": trainer.init_source or _carried_init(cfg),
                    "keep_cpu_memory_applied": trainer.malloc_tuned,
                    "flops_per_token": trainer.flops_per_token, "peak_flops": trainer.peak,
                    "mfu_formula": "6N + 12*n_layer*n_embd*T per token (PaLM), N without wpe"})
    log = MetricsLogger(cfg.out, enabled=info.is_main, total_steps=cfg.max_steps, start_step=trainer.step,
                        log_interval=cfg.log_interval, tensorboard=cfg.tensorboard, progress=cfg.progress,
                        wandb_project=cfg.wandb_project, wandb_run_name=cfg.wandb_run_name, config=cfg.to_dict())
    log.console(f"gpt2lab train: {trainer.choices.summary()}")
    log.console(f"gpt2lab train: strategy {trainer.strategy.value} ({trainer.strategy.reason})"
                + ("; activation checkpointing on" if cfg.activation_checkpointing else ""))
    for choice in (trainer.choices.dtype, trainer.choices.compile):
        if choice.warning:
            log.console(f"gpt2lab train: warning: {choice.warning}")
    log.console(f"gpt2lab train: {trainer.raw.num_params():,} params, {info.world_size} process(es), "
                f"{trainer.accum} micro-steps/step, steps {trainer.step}..{cfg.max_steps}, out {cfg.out}"
                + (f", resumed from {trainer.resumed_from}" if trainer.resumed_from else ""))
    try:
        last = trainer.run(log)
    finally:
        log.close()
    if trainer.stop_signal is not None:  # "preempted, resume me", told apart from "done" by the exit code
        raise Stopped(f"stopped by {signal.Signals(trainer.stop_signal).name} at step {trainer.step}; "
                      f"resume with --resume auto (last checkpoint {last})", trainer.stop_signal)
    return last


def _carried_init(cfg: TrainConfig) -> Optional[dict]:
    """A resumed run's --init-from provenance, as its checkpoint's config recorded it."""
    return {"source": cfg.init_from, "id": cfg.init_from_id} if cfg.init_from_id else None


def _resolve_resume(cfg: TrainConfig, resume: Optional[str]) -> Optional[str]:
    if resume == "auto":  # the newest checkpoint that is intact, saying which ones were skipped
        found = ckpt.find_intact(cfg.out, report=lambda line: print(f"gpt2lab train: {line}", file=sys.stderr))
        if found is None and ckpt.find_latest(cfg.out):
            raise ckpt.CheckpointError(f"{cfg.out}: every checkpoint is damaged; start again with a new --out")
        return found
    if resume is None and ckpt.find_latest(cfg.out):
        raise ConfigError(f"{cfg.out} already has checkpoints; continue it with --resume auto "
                          "or choose another --out")
    return resume


def _check_hellaswag(cfg: TrainConfig) -> None:
    """Fail before training, not at step 250, when HellaSwag is asked for but cannot run."""
    if not cfg.hellaswag_interval:
        return
    try:
        from gpt2lab.evals.hellaswag import load_examples
    except ImportError as e:
        raise ConfigError(f"--hellaswag-interval {cfg.hellaswag_interval}: HellaSwag evaluation is "
                          f"unavailable ({e}); set --hellaswag-interval 0") from e
    try:
        load_examples(cfg.hellaswag_data, limit=1)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--hellaswag-interval {cfg.hellaswag_interval}: cannot load HellaSwag data "
                          f"({e}); pass --hellaswag-data FILE or set --hellaswag-interval 0") from e

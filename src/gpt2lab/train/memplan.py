"""Per-rank memory of a training step, measured on fake tensors: the trainer's own step, nothing allocated.

``fake_step`` builds a run's model (its LoRA adapters too) and optimizer under torch's
``FakeTensorMode`` (tensors with shapes, dtypes and devices but no storage) and runs the trainer's
own code on them: the optimizer's state made, the last micro-step of a step (forward, the loss and
backward; with accumulation, into the gradients the micro-steps before it left), clipping and the
optimizer step. A dispatch mode adds up the bytes of every storage alive at each moment: the peak
of the tensors one CPU process holds, every lever of the model counted by running it, never by a
formula of it. ``predict`` adds what one process alone does not show: DDP's gradient buckets,
FSDP's shards and gathered blocks, the weight average, the token features' state, the runtime
(a CUDA context, a CPU process's resident size), on a CPU the heap's slack, and on CUDA the two
kernels a CPU does not run. ``largest_micro_batches`` searches the largest micro-batch that fits a
card; ``gpt2lab bench memory`` prints the prediction beside measured peaks (docs/benchmarks.md).

The fake run uses torch's private ``torch._subclasses.fake_tensor`` (in every torch this project supports).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode  # torch's own (private, in every torch >= 2.0)
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2lab.distributed import parallel
from gpt2lab.distributed.dist import autocast
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.model.loss import LossPath, choose_loss, chunked_cross_entropy
from gpt2lab.system.choices import STRATEGIES
from gpt2lab.system.errors import UsageError
from gpt2lab.train.config import TrainConfig
from gpt2lab.train.optim import build_optimizer

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4
# What a rank holds besides tensors. CUDA: the context, cuBLAS workspaces and NCCL buffers,
# none of which torch.cuda.max_memory_allocated counts (about 0.5 GiB of context on an H100
# with torch 2.x), plus room for the caching allocator's fragmentation. CPU: the resident
# size of a process that imported torch and gpt2lab's trainer (measured ~300 MB on x86-64,
# torch 2.13; the same under torchrun once gloo's process group is up).
CUDA_RUNTIME_BYTES = 2 * 2**30
CPU_PROCESS_BYTES = 300 * 2**20
CPU = torch.device("cpu")


class PlanError(UsageError):
    """A value the planner cannot use (unknown strategy or dtype, non-positive size)."""


@dataclass
class Prediction:
    """Bytes one rank holds at the step's peak (``phase``), term by term."""

    phase: str
    terms: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def to_dict(self, unit: float = 2**20) -> dict:
        """Terms and total in MiB by default (``unit`` bytes each)."""
        return {"phase": self.phase, **{k: round(v / unit, 1) for k, v in {**self.terms, "total": self.total}.items()}}


@dataclass(frozen=True)
class StepBytes:
    """What one process holds over a step on fake tensors, in bytes."""

    weights: int  # every parameter (frozen ones too)
    state: int  # the optimizer's
    grads: int  # the trainable parameters' gradients (fp32)
    micro: int  # the peak of everything through the last micro-step
    step: int  # the peak through clipping and the optimizer step
    casts: int  # autocast's low-precision copies of the blocks' Linear weights, alive through a forward
    root: int  # fp32 weights outside the blocks (FSDP keeps them whole)
    block: int  # fp32 weights of the largest block
    blocks: int  # of all blocks


class _Live(TorchDispatchMode):
    """Bytes of the storages made under it and still alive, and their peak. A fake (or meta) tensor's
    value is unknown, so a read of one (``item``, ``bool``) answers as on real data: ``any`` false (the
    chunked loss asks whether any target's probability underflows), the rest 1 (whether every target
    counts; the optimizer's step count)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._anys: set[int] = set()

    def _free(self, n: int) -> None:
        self.bytes -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            return int(id(args[0]) not in self._anys)
        out = func(*args, **(kwargs or {}))
        self._anys.discard(id(out))
        if func is aten.any.default:
            self._anys.add(id(out))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            st = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if st is not None and st not in self._seen:
                self._seen.add(st)
                self.bytes += st.nbytes()
                self.peak = max(self.peak, self.bytes)
                weakref.finalize(st, self._free, st.nbytes())
        return out


_CACHE: dict[str, object] = {}


def _cached(key: str, make):
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


def _build(cfg: TrainConfig, device: torch.device, lora: bool = True):
    """The run's model (with its LoRA adapters: peft moves them with Module.to, which fake parameters
    refuse, so ``lora`` False on fake tensors) and optimizer (token features aside: their state is
    ``predict``'s own term), the optimizer's state made as after a first step; (model, optimizer)."""
    ft = cfg.finetune
    model = GPT(cfg.model)
    if ft.lora_rank and lora:
        from gpt2lab.model.lora import add_lora

        add_lora(model, ft.lora_rank, ft.lora_alpha, ft.lora_targets)
    optimizer = build_optimizer(model, dataclasses.replace(cfg.optim, token_features=False), device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def params(cfg: TrainConfig) -> int:
    """The parameters of ``cfg``'s model (the tied head once), counted on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg.model).parameters())


def sizes(cfg: TrainConfig) -> tuple[int, int]:
    """(bytes of the weights, bytes of the optimizer's state) of ``cfg``'s model and optimizer, counted on
    the meta device: the tied head once; LoRA's adapters and their state included, the token features' not."""

    def count():
        with torch.device("meta"), _Live() as live:
            model, optimizer = _build(cfg, torch.device("meta"))
            weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
            return weights, live.bytes - weights

    return _cached(repr(("sizes", cfg.model, cfg.optim, cfg.finetune)), count)


def fake_step(cfg: TrainConfig, dtype: str, accum: int) -> StepBytes:
    """One eager step of ``cfg``'s run in one process (``accum`` micro-steps, the chunked loss) on fake
    tensors; cached by what changes it (the architecture, batch shape, optimizer, checkpointing)."""
    b = cfg.batch
    key = (cfg.model, b.micro_batch_size, b.seq_len, cfg.optim, cfg.parallel.activation_checkpointing)
    return _cached(repr((key, dtype, accum > 1)), lambda: _measure(cfg, dtype, accum))


def _measure(cfg: TrainConfig, dtype: str, accum: int) -> StepBytes:
    b = cfg.batch
    fake, live = FakeTensorMode(), _Live()
    with fake, live:
        model, optimizer = _build(cfg, CPU, lora=False)  # LoRA predicted as full fine-tuning: more, never less
        trainable = [p for p in model.parameters() if p.requires_grad]
        model.set_loss(LossPath(chunked=True))
        model.activation_checkpointing = cfg.parallel.activation_checkpointing
        fixed = live.bytes
        if accum > 1:  # the micro-steps before the last left their gradients
            for p in trainable:
                p.grad = torch.zeros_like(p)
        live.peak, x = live.bytes, torch.zeros((b.micro_batch_size, b.seq_len), dtype=torch.long)
        parallel.accumulate_gradients(model, lambda: (x, x), 1, CPU, dtype)
        micro, live.peak = live.peak, live.bytes
        parallel.clip_grad_norm(model, cfg.optim.grad_clip or math.inf)
        optimizer.step()
        blocks = [sum(p.numel() for p in block.parameters()) for block in model.transformer.h]
        linears = [m for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear)]
        total = sum(p.numel() for p in model.parameters())
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
    low = DTYPE_BYTES[dtype] if dtype != "float32" else 0
    return StepBytes(
        weights=weights,
        state=fixed - weights,
        grads=FP32 * sum(p.numel() for p in trainable),
        micro=micro,
        step=live.peak,
        casts=low * sum(p.numel() for m in linears for p in m.parameters()),
        root=FP32 * (total - sum(blocks)),
        block=FP32 * max(blocks),
        blocks=FP32 * sum(blocks),
    )


def _loss_bytes(m: GPTConfig, rows: int, dtype: str) -> int:
    """The chunked loss's own peak over ``rows`` rows of model ``m`` (its workspace), on fake tensors; cached."""

    def measure() -> int:
        fake, live = FakeTensorMode(), _Live()
        with fake, live, autocast(CPU, dtype):
            x, targets = torch.zeros(rows, m.n_embd, requires_grad=True), torch.zeros(rows, dtype=torch.long)
            w = torch.zeros(m.vocab_size, m.n_embd, requires_grad=True)
            start = live.peak = live.bytes
            chunked_cross_entropy(x, w, targets, softcap=m.logit_softcap)
        return live.peak - start

    return _cached(repr(("loss", m, rows, dtype)), measure)


def predict(
    cfg: TrainConfig,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    dtype: str = "bfloat16",
    accum: int = 2,
    device: str = "cuda",
    compiled: bool = False,
    token_features: int = 0,
) -> Prediction:
    """Peak per-rank bytes of one step of ``cfg``'s run (its micro-batch, sequence length, architecture,
    optimizer, LoRA, activation checkpointing, weight average) under ``strategy`` on ``world_size``
    ranks of ``device``; ``accum``: micro-steps per step (a batch or sequence-length ramp's early steps
    hold no more); ``compiled``: the model is compiled (on CUDA its loss is then logits and
    F.cross_entropy, model.loss.choose_loss); ``token_features``: --token-features' feature count.

    One process trains unwrapped whatever the strategy. DDP adds its buckets (one more fp32 copy of
    the gradients: ``gradient_as_bucket_view`` is off). FSDP as distributed.parallel shards it: fp32
    weights, gradients and state split over the ranks, the root (wte = lm_head, wpe, ln_f) whole, the
    blocks gathered in ``dtype`` (two at a time, all of them through a step's micro-steps before the
    last, which neither reduce nor reshard), autocast's copies of the blocks' weights not made."""
    check_values(strategy, world_size, cfg.batch.micro_batch_size, dtype, accum, device)
    m, a, tokens = cfg.model, DTYPE_BYTES[dtype], cfg.batch.micro_batch_size * cfg.batch.seq_len
    sharded = strategy == "fsdp" and world_size > 1
    got = fake_step(cfg, dtype, accum)
    fixed = got.weights + got.state
    terms = {"weights": got.weights, "optimizer": got.state}
    if sharded:
        w = world_size
        terms = {k: v // w for k, v in terms.items()}
        gathered = got.root + (got.blocks if accum > 1 else 2 * got.block) * a // FP32
        phases = {"micro-step": got.micro - fixed - got.casts + gathered, "optimizer step": (got.step - fixed) // w}
    else:
        phases = {"micro-step": got.micro - fixed, "optimizer step": got.step - fixed}
    if device == "cuda":  # kernels a CPU does not run (the fake run is the CPU's)
        phases["micro-step"] += _cuda_only(cfg, a)
    if not choose_loss(device, compiled, sharded=sharded).chunked:  # compiled on CUDA: the graph keeps the
        # logits of the main head and of the K multi-token heads in dtype, and the heads' inputs, where the
        # eager step kept the chunked loss's workspace (H100, 124M, B=64: 28.48 GiB measured)
        K = m.mtp_heads
        fused = (1 + K) * tokens * m.vocab_size * a + K * tokens * m.n_embd * a
        phases["micro-step"] += fused - _loss_bytes(m, tokens * max(1, K), dtype)
    phase = max(phases, key=phases.get)
    terms["step_tensors"] = phases[phase]  # gradients, activations, the loss, low-precision weight copies
    if strategy == "ddp" and world_size > 1:
        terms["comm_buffers"] = got.grads
    if cfg.optim.ema_decay:  # --ema-decay's fp32 copy of the weights (refused with FSDP)
        terms["average"] = got.weights
    if token_features:  # their state, and a step's feature gradient and update (n_features x C each)
        terms["token_features"] = feature_state_bytes(m, token_features) + 2 * FP32 * token_features * m.n_embd
    terms["runtime"] = CUDA_RUNTIME_BYTES if device == "cuda" else CPU_PROCESS_BYTES
    # On a CPU the peak RSS exceeds the peak of live tensors by about one more chunked-loss workspace
    # (docs/benchmarks.md): the trainer keeps freed memory in glibc's heap (keep_cpu_memory), gradients
    # made in a backward land in the hole the workspace left, and the next micro-step's extends the heap.
    if device == "cpu":
        terms["allocator"] = _loss_bytes(m, tokens * max(1, m.mtp_heads), dtype)
    return Prediction(phase, terms)


def feature_state_bytes(model: GPTConfig, n_features: int) -> int:
    """--token-features' optimizer state (train.token_features): Adam's two fp32 moments of a vector per
    feature (n_features x C) for each token table it shares (the embedding, and an untied head)."""
    return 2 * FP32 * n_features * model.n_embd * (1 if model.tie_embeddings else 2)


def _cuda_only(cfg: TrainConfig, act: int) -> int:
    """What a CUDA forward keeps beyond the CPU's (from torch's source and autocast tables): its fused
    RMSNorm keeps the input and rstd where the CPU's decomposition also keeps the normalised input
    (4 bytes a channel less per norm), and autocast runs ReLU^2's pow in fp32 there (an fp32 copy of
    relu's output, 16 bytes a channel). Blocks recomputed (activation checkpointing) keep one block's."""
    m = cfg.model
    tokens = cfg.batch.micro_batch_size * cfg.batch.seq_len
    blocks = 1 if cfg.parallel.activation_checkpointing else m.n_layer
    out = -FP32 * m.n_embd * tokens * (2 * blocks + 1) if m.norm == "rmsnorm" else 0
    return out + (4 * FP32 * m.n_embd * tokens * blocks if m.mlp_act == "relu2" and act != FP32 else 0)


def largest_micro_batches(
    gpu_bytes: int,
    cfg: TrainConfig,
    *,
    world_size: int = 1,
    dtype: str = "bfloat16",
    max_batch: int = 4096,
    compiled: bool = True,
) -> list[dict]:
    """The largest micro-batch (at most ``max_batch``) whose predicted peak fits ``gpu_bytes``, per
    strategy and activation checkpointing: [{"strategy", "activation_checkpointing", "micro_batch",
    "predicted_bytes"}]; micro_batch 0 where not even one sequence fits."""
    if gpu_bytes <= 0:
        raise PlanError(f"memory to plan for must be positive, got {gpu_bytes} bytes")
    rows = []
    for strategy, ac in itertools.product(STRATEGIES, (False, True)):

        def total_at(B: int) -> int:
            c = dataclasses.replace(
                cfg,
                batch=dataclasses.replace(cfg.batch, micro_batch_size=B),
                parallel=dataclasses.replace(cfg.parallel, activation_checkpointing=ac),
            )
            return predict(c, strategy=strategy, world_size=world_size, dtype=dtype, compiled=compiled).total

        best = largest_fitting(lambda B: parallel.fits(total_at(B), gpu_bytes), max_batch)
        fit = total_at(max(best, 1))
        rows.append(dict(strategy=strategy, activation_checkpointing=ac, micro_batch=best, predicted_bytes=fit))
    return rows


def largest_fitting(fits, cap: int) -> int:
    """Largest B in [1, cap] with fits(B) (fits is monotone), 0 if none: bisection."""
    return bisect.bisect_left(range(1, cap + 1), True, key=lambda B: not fits(B))


def check_values(strategy: str, world_size: int, micro_batch: int, dtype: str, accum: int, device: str) -> None:
    """Raise PlanError naming the first value the planner cannot use."""
    if strategy not in STRATEGIES:
        raise PlanError(f"strategy {strategy!r} unknown; use one of {', '.join(STRATEGIES)}")
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {dtype!r} unknown; use one of {', '.join(DTYPE_BYTES)}")
    if device not in ("cuda", "cpu"):
        raise PlanError(f"device {device!r}: the planner knows cuda and cpu")
    for name, v in (("world size", world_size), ("micro-batch", micro_batch), ("accumulation steps", accum)):
        if v < 1:
            raise PlanError(f"{name} must be at least 1, got {v}")

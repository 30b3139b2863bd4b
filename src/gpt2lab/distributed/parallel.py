"""How the training model is spread over the processes of a torchrun: DDP or FSDP2.

``ddp``: every process holds the whole model, its gradients and AdamW's moments (16 bytes
per parameter in fp32) and DDP all-reduces the gradients once per optimizer step.
``fsdp``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on each ``Block`` and on
the root GPT; every parameter becomes a DTensor sharded over the processes, so weights,
gradients and AdamW state take 1/world of that each. A block's weights are all-gathered
just before its forward and its backward and freed after; gradients are reduce-scattered.
The optimizer is built on the sharded parameters afterwards and steps on the shards only.

Mixed precision under FSDP computes what bf16 autocast computes under DDP: the blocks'
Linear weights are gathered in bf16 (``MixedPrecisionPolicy``; autocast would round them to
exactly that, so the matmuls see the same numbers, with half the all-gather traffic),
gradients are reduced and AdamW steps in fp32 on fp32 master shards, and autocast stays on
around the forward for everything else. The LayerNorms are FSDP groups of their own kept in
fp32, and so are the root's weights (wte = lm_head, wpe, ln_f): the residual stream and the
normalisations stay fp32 as under DDP. (A bf16 LayerNorm weight on an fp32 input is also an
error on CPU: "mixed dtype (CPU): expect parameter to have scalar type of Float".) What does
differ: gradients of the bf16 weights leave backward in bf16 and are upcast for the fp32
reduce-scatter, where autocast's cast-backward upcasts each one before DDP's all-reduce;
the same values, summed in a different order.

``choose_strategy`` decides ``--strategy auto`` as a pure function of the facts (like
``gpt2lab.system.runtime.choose_dtype``); the rest are the few places where the trainer must treat
a sharded model differently: gradient sync during accumulation, the clipping norm, the
finite-weights check and evaluation (``gathered``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from gpt2lab.distributed.dist import agree, all_reduce_sum, autocast, world
from gpt2lab.system.choices import STRATEGY_CHOICES
from gpt2lab.system.runtime import Choice, ChoiceError

Batch = tuple[torch.Tensor, torch.Tensor]


def choose_strategy(
    requested: str,
    *,
    world_size: int,
    device_type: str,
    dtype: str = "float32",
    lora: bool = False,
    ddp_bytes: Optional[int] = None,
    device_bytes: Optional[int] = None,
) -> Choice:
    """ddp or fsdp for a run: the user's request if it can run here, else what fits.

    (--strategy fsdp with --lora-rank is refused by TrainConfig itself, before any process starts work.)

    ``ddp_bytes``: the predicted memory per rank under DDP (None: no prediction);
    ``device_bytes``: the memory of one device (None: unknown, e.g. a CPU).
    """
    if requested not in STRATEGY_CHOICES:
        raise ChoiceError(f"strategy {requested!r}: choose one of {', '.join(STRATEGY_CHOICES)}")
    if world_size == 1:
        also = " (--strategy fsdp applies under torchrun with several processes)" if requested == "fsdp" else ""
        return Choice("ddp", f"one process: nothing to shard, the model trains unwrapped{also}")
    if requested == "fsdp" and dtype == "float16":
        raise ChoiceError(
            "--strategy fsdp with float16 (a GPU without bf16): the gradient scaler is not "
            "wired for sharded gradients; use --dtype float32 or --strategy ddp"
        )
    if requested != "auto":
        return Choice(requested, f"asked for with --strategy {requested}")
    if lora:
        return Choice("ddp", "LoRA: only the adapters have gradients and AdamW state")
    if dtype == "float16":
        return Choice("ddp", "float16: the gradient scaler needs DDP's whole gradients")
    if ddp_bytes is None or device_bytes is None:
        return Choice(
            "ddp",
            f"{world_size} processes; no memory prediction for this {device_type}, so DDP "
            "(--strategy fsdp shards weights, gradients and AdamW state)",
        )
    need, have = ddp_bytes / 2**30, device_bytes / 2**30
    if not fits(ddp_bytes, device_bytes):
        return Choice(
            "fsdp",
            f"DDP would need {need:.1f} GiB per rank (gpt2lab.train.memplan), more than "
            f"the device's {have:.1f} GiB: sharded over {world_size} processes",
        )
    return Choice("ddp", f"DDP needs {need:.1f} GiB per rank of the device's {have:.1f} GiB: it fits")


def fits(predicted_bytes: int, device_bytes: int) -> bool:
    """Whether a predicted peak fits a device: the one rule of the planner and of --strategy auto.

    No further margin: the prediction's runtime term already holds the CUDA context and
    room for the allocator's fragmentation, and it ran 0-5% above the measured peaks.
    """
    return predicted_bytes <= device_bytes


def device_bytes(device: torch.device) -> Optional[int]:
    """Memory of one accelerator (None for a CPU: its RAM is shared by every process)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


# -- wrapping ------------------------------------------------------------------------------
def wrap(
    model: nn.Module, strategy: str, distributed: bool, device: torch.device, dtype: str, compile: bool
) -> tuple[nn.Module, nn.Module]:
    """(module to train, module to evaluate) around ``model``, which stays the GPT to save.

    One process: the (compiled) model for both. DDP: DDP around the compiled model, the
    compiled model for evaluation. FSDP: ``model`` itself, sharded in place, its blocks
    compiled one by one (each block's code is the same, so dynamo compiles it once).
    """
    if distributed and strategy == "fsdp":
        return (shard(model, dtype=dtype, compile=compile),) * 2
    compiled = torch.compile(model) if compile else model
    if not distributed:
        return compiled, compiled
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(compiled, device_ids=ids), compiled


def shard(model: nn.Module, *, dtype: str, compile: bool) -> nn.Module:
    """``fully_shard`` each block, then the root (wte = lm_head, wpe, ln_f); returns ``model``.

    The tied wte/lm_head Parameter belongs to the root's group only, so it stays one
    DTensor used by both. Compiling a block in place (``Module.compile``) keeps the
    parameter names, so checkpoints look the same as unsharded ones.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = getattr(torch, dtype)
    # cast_forward_inputs=False: the residual stream enters each block in fp32, as under DDP
    block_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.transformer.h:
        if compile:
            block.compile()
        if low != torch.float32:  # LayerNorms: their own groups, kept fp32 (as autocast uses them)
            for norm in (block.ln_1, block.ln_2):
                fully_shard(norm)
        fully_shard(block, mp_policy=block_policy if low != torch.float32 else MixedPrecisionPolicy())
    fully_shard(model)
    # the root is not compiled, so the loss must be the chunked one: model.loss.choose_loss(sharded=True),
    # which the run plan asks (the trainer calls model.set_loss before wrapping)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` went through ``shard`` (FSDP2 makes the root an ``FSDPModule``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# -- the training step ---------------------------------------------------------------------
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
    micro-step: DDP's ``no_sync`` before it; FSDP neither reduce-scatters nor reshards before it (the full
    gradients accumulate on each rank, in fp32 when the weights were gathered in bf16, and the next
    micro-step's forward finds the weights still gathered instead of all-gathering them again).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = [next_batch() for _ in range(accum)] if masked else None
    weights = _target_weights(batches, device) if masked else [1.0 / accum] * accum
    total = torch.zeros((), dtype=torch.float32, device=device)
    for micro in range(accum):
        x, y = batches[micro] if masked else next_batch()
        if device.type == "cuda" and x.device.type == "cpu":  # from pinned memory the copy is queued; from
            x, y = x.pin_memory(), y.pin_memory()  # pageable it waits for the GPU (bench memory's are on the GPU)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = micro == accum - 1
        if is_sharded(model):
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        with model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext():
            with autocast(device, dtype):
                _, loss = model(x, y, return_logits=False)
            loss = loss * weights[micro]
            total += loss.detach().float()
            (scaler.scale(loss) if scaler is not None else loss).backward()
    return all_reduce_sum(total).div_(world())  # the mean over ranks


def _target_weights(batches: list[Batch], device: torch.device) -> list[torch.Tensor]:
    """Each micro-batch's weight n_i * world / N: n_i its supervised targets, N the step's over all
    ranks (summed on the device: no host sync). Ranks' gradients are then averaged, so the step's
    gradient is that of the mean loss over all N targets."""
    counts = torch.tensor([float((y != -1).sum()) for _, y in batches], device=device)
    return list(counts * world() / all_reduce_sum(counts.sum()).clamp(min=1))


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm``; return the norm before clipping (a plain tensor).

    Over FSDP's sharded gradients ``clip_grad_norm_`` sums each rank's squares and
    all-reduces them, giving the norm of the whole gradient, the same as under DDP.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def all_finite(model: nn.Module) -> bool:
    """Whether every weight is finite, the same answer on every rank (FSDP: each checks its shard)."""
    local = all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters())
    if not (is_sharded(model) and dist.is_initialized()):
        return local  # DDP keeps the weights equal: every rank finds the same
    return not agree(not local)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def params_on_this_rank(model: nn.Module) -> int:
    """Parameters this process holds (FSDP: its shards, padding included; else all of them)."""
    return sum(_local(p).numel() for p in model.parameters())


# -- evaluation ----------------------------------------------------------------------------
@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside: every rank holds the whole model and its forwards run no collectives.

    FSDP all-gathers a block's weights inside each forward, so every rank must run the
    same forwards in the same order; HellaSwag gives ranks different numbers of batches and
    a sample is generated on rank 0 alone. Gathering once before (all ranks together) and
    resharding after lets each rank run what it needs. Costs one full copy of the weights
    (bf16 in the blocks under mixed precision) for the duration. Not sharded: nothing to do.
    """
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    blocks = [m for m in mods if m is not model]  # the root never reshards after forward (FSDP2's own rule)
    for m in blocks:
        m.set_reshard_after_forward(False, recurse=False)
    for m in mods:
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
        for m in blocks:
            m.set_reshard_after_forward(True, recurse=False)

"""AdamW with GPT-2/3 parameter groups, and the learning-rate schedule as a pure function."""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay every >=2-D tensor (matmul weights, embeddings); never biases or LayerNorm gains.

    Tied weights appear once (``named_parameters`` de-duplicates shared tensors).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def fused_available(device: torch.device) -> bool:
    """Fused AdamW kernels exist for CUDA (and CPU on recent torch)."""
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False
    return device.type in ("cuda", "cpu")


def make_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                   eps: float, device: torch.device, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; fused when the device has the kernel (``fused=None``)."""
    use_fused = fused_available(device) if fused is None else fused
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                             fused=use_fused or None)


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup to max_lr over ``warmup_steps``, then cosine decay to min_lr at ``max_steps``.

    Step 0 gets max_lr / warmup_steps (never 0, which would waste a step); past max_steps
    the rate stays at min_lr.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)

"""gpt2lab bench lora: what full fine-tuning and LoRA keep in memory, at a GPT-2 size.

For each mode (all weights trainable; LoRA adapters only, through peft) it builds the
model, gives every trainable weight a gradient, takes one ``torch.optim.AdamW`` step as
the trainer builds it, and adds up the bytes of the state tensors AdamW created. On the
meta device (the default) nothing is allocated, so gpt2-xl is counted on any machine;
with ``--device cpu`` the step is a real forward/backward on random tokens and the
process's peak RSS is reported too (run one ``--mode`` per process for that figure).
"""

from __future__ import annotations

import argparse

import torch

from gpt2lab.benchmarks import peak_rss_bytes
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.train.optim import AdamW, param_groups

GIB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="1558M", help="GPT-2 size: 124M, 350M, 774M, 1558M")
    p.add_argument("--mode", default="both", choices=["full", "lora", "both"])
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--targets", default="c_attn", help="LoRA target layers (as --lora-targets)")
    p.add_argument("--device", default="meta", choices=["meta", "cpu"])
    p.add_argument("--batch", type=int, default=1, help="micro-batch of the real step (--device cpu)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length of the real step (--device cpu)")


def _gib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / GIB


def count_state(args: argparse.Namespace, lora: bool) -> dict:
    device = torch.device(args.device)
    with device:
        model = GPT(GPTConfig.preset(args.size, vocab_size=50304, token_vocab_size=50257))
    if lora:
        from gpt2lab.model.lora import add_lora

        add_lora(model, args.rank, 2.0 * args.rank, args.targets)
    opt = AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cpu" or None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if device.type == "meta":
        for p in trainable:
            p.grad = torch.empty_like(p)
    else:
        x = torch.randint(0, 50257, (args.batch, args.seq_len))
        model(x, x, return_logits=False)[1].backward()
    opt.step()
    out = {
        "mode": "lora" if lora else "full",
        "params": model.num_params(),
        "trainable_params": sum(p.numel() for p in trainable),
        "weights_gib": _gib(model.parameters()),
        "grads_gib": _gib(trainable),
        "adamw_state_gib": _gib(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)),
    }
    if device.type == "cpu":
        out["peak_rss_gib"] = peak_rss_bytes() / GIB
    return out


def run(args: argparse.Namespace) -> dict:
    modes = {"full": [False], "lora": [True], "both": [False, True]}[args.mode]
    results = [count_state(args, lora) for lora in modes]
    return {**{k: getattr(args, k) for k in ("size", "device", "rank", "targets")}, "results": results}

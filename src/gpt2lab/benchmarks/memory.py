"""gpt2lab bench memory: the largest micro-batch that trains, at a GPT-2 size and T.

One training step as ``gpt2lab train`` runs it (bf16 autocast, the chunked loss, fused
AdamW; eager unless ``--compile true``, since every new batch size recompiles) on random
tokens, at doubling micro-batch sizes until one runs out of memory, then a bisection
between the last that fit and the first that did not. Prints each try with its peak
memory, and the answer. On CPU it only runs the tries it is given (``--max-batch``).
"""
from __future__ import annotations

import argparse
import json

import torch

from gpt2lab.dist import pick_device
from gpt2lab.model import GPT, GPTConfig
from gpt2lab.optim import make_optimizer
from gpt2lab.train import accumulate_gradients


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="124M", help="GPT-2 size: 124M, 350M, 774M, 1558M")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-batch", type=int, default=1024, help="stop searching here")
    p.add_argument("--compile", default="false", choices=["true", "false"])
    p.add_argument("--device", default=None)


def try_batch(model: GPT, opt, B: int, T: int, device: torch.device, compiled) -> dict:
    """One step at micro-batch B: {"B", "fits", "peak_gib"}."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        x = torch.randint(0, 50257, (B, T), device=device)
        accumulate_gradients(compiled, lambda: (x, x), 1, device, "bfloat16")  # the trainer's micro-step
        opt.step()
        fits = True
    except torch.OutOfMemoryError:
        fits = False
    finally:
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    return {"B": B, "fits": fits, "peak_gib": round(peak, 2) if peak is not None else None}


def run(args: argparse.Namespace) -> dict:
    device = pick_device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.size, vocab_size=50304, token_vocab_size=50257,
                                 block_size=args.seq_len)).to(device)
    model.compile_loss = args.compile == "true"
    opt = make_optimizer(model, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device=device)
    compiled = torch.compile(model) if args.compile == "true" else model
    tries, good, bad, B = [], 0, None, 1
    while B <= args.max_batch:  # doubling
        rec = try_batch(model, opt, B, args.seq_len, device, compiled)
        tries.append(rec)
        print(json.dumps(rec), flush=True)
        if not rec["fits"]:
            bad = B
            break
        good, B = B, 2 * B
    while bad is not None and bad - good > 1:  # bisection
        mid = (good + bad) // 2
        rec = try_batch(model, opt, mid, args.seq_len, device, compiled)
        tries.append(rec)
        print(json.dumps(rec), flush=True)
        good, bad = (mid, bad) if rec["fits"] else (good, mid)
    return {"size": args.size, "seq_len": args.seq_len, "device": str(device), "params": model.num_params(),
            "compile": args.compile == "true", "largest_micro_batch": good or None,
            "searched_up_to": args.max_batch, "tries": tries}

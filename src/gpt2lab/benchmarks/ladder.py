"""gpt2lab bench ladder: the reference recipe's speed ladder, then gpt2lab's step and a
``transformers`` step, one JSON line per rung.

Rungs, each adding one thing to the one before (the reference recipe's order): fp32 ->
TF32 matmuls -> bf16 autocast -> torch.compile -> flash attention (SDPA; the rungs before
it use attention written out: matmul, causal mask, softmax, matmul) -> vocab padded to
50304 -> fused AdamW. The model of these rungs is the recipe's, written plainly
(``ReferenceGPT``: materialised logits, one ``F.cross_entropy``). Then, at the last rung's
settings: ``gpt2lab`` (exactly ``gpt2lab train``'s step on real token shards) and ``hf``
(``transformers.GPT2LMHeadModel``: sdpa attention, bf16 autocast, torch.compile, fused
AdamW). Two diagnostic rungs split the gpt2lab step in parts: ``model_chunked`` (gpt2lab's
GPT, compiled, its chunked loss, in the recipe's step: no trainer, no loader, no ``.item()``)
and ``model_ce`` (the same with materialised logits and one ``F.cross_entropy``, so the
chunked loss is compared with what the compiler makes of the plain one). Every rung reports ms/step,
tok/s, MFU and peak memory. MFU divides
FLOPs/token = 6N + 12 * n_layer * n_embd * T (PaLM; N without position embeddings) by
both the datasheet peak and the bf16 matmul rate measured at the start of the same run. With
``--profile DIR``, torch.profiler then runs over more steps of each rung: where its time goes.

Meant for a GPU (see benchmarks/gpu.sh); on a CPU it runs too, for a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

import torch

from gpt2lab.benchmarks import rounds
from gpt2lab.benchmarks.train import ReferenceGPT, loss_of_step, recipe_step
from gpt2lab.distributed.dist import pick_device
from gpt2lab.model.config import PRESETS, SIZES
from gpt2lab.system.choices import finite_float
from gpt2lab.system.errors import UsageError
from gpt2lab.system.files import atomic_write, tmp_name
from gpt2lab.system.runtime import measure_matmul

RUNGS = ("fp32", "tf32", "bf16", "compile", "flash", "vocab50304", "fused_adamw")
EXTRA = ("gpt2lab", "hf")
DIAGNOSTIC = ("model_chunked", "model_ce")
SHAPES = {**{s.label: PRESETS[s.hub] for s in SIZES[:2]}, "tiny": dict(n_layer=2, n_head=2, n_embd=64)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="124M", choices=sorted(SHAPES), help="model size (tiny: smoke tests)")
    p.add_argument("--batch-size", type=int, default=16, help="micro-batch B (one micro-step per step)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per rung (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--rungs", default=",".join(RUNGS + EXTRA), help=f"from {', '.join(RUNGS + EXTRA + DIAGNOSTIC)}")
    p.add_argument("--data", help="token shards for the gpt2lab rung (gpt2lab prepare output)")
    p.add_argument("--device")
    p.add_argument("--peak-flops", type=finite_float, help="datasheet peak FLOP/s (default: by GPU name)")
    p.add_argument("--profile", metavar="DIR", help="then torch.profiler over more steps of each rung, into DIR")


def settings(rung: str) -> dict:
    """What is switched on at ``rung`` (each rung keeps everything before it; gpt2lab and hf: all)."""
    on = RUNGS[: RUNGS.index(rung) + 1] if rung in RUNGS else RUNGS
    switches = {k: k in on for k in ("tf32", "bf16", "compile", "flash")}
    return {**switches, "vocab": 50304 if "vocab50304" in on else 50257, "fused": "fused_adamw" in on}


def _build(rung: str, shape, B: int, T: int, device: torch.device, data):
    """A rung's step and model: gpt2lab's own, or the recipe's step (AdamW decay 0.1, compiled, autocast
    as ``settings(rung)`` has them) of the reference model, transformers' or gpt2lab's GPT, on one random batch."""
    if rung == "gpt2lab":  # exactly `gpt2lab train`'s step, on --data's shards
        from gpt2lab.distributed.dist import DistInfo
        from gpt2lab.train.settings import load_preset
        from gpt2lab.train.trainer import Trainer

        batch = dict(block_size=T, seq_len=T, micro_batch_size=B, total_batch_tokens=B * T)
        how = dict(device=str(device), compile=True, dtype="bfloat16", hellaswag_interval=0, progress=False)
        cfg = load_preset("gpt2-124m", data=data, **shape, **batch, **how)
        trainer = Trainer.from_config(cfg, DistInfo(device=device))
        return loss_of_step(trainer), trainer.raw
    s = settings(rung)
    torch.manual_seed(0)
    if rung == "hf":  # sdpa attention, no dropout
        import transformers

        transformers.logging.set_verbosity_error()
        no_dropout = dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.0)
        cfg = transformers.GPT2Config(**shape, n_positions=T, vocab_size=50304, use_cache=False, **no_dropout)
        model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").train()
    elif rung in DIAGNOSTIC:  # gpt2lab's GPT, its chunked loss or the logits and one F.cross_entropy
        from gpt2lab.model.gpt import GPT, GPTConfig
        from gpt2lab.model.loss import LossPath

        model = GPT(GPTConfig(block_size=T, vocab_size=50304, token_vocab_size=50257, **shape))
        model.set_loss(LossPath(chunked=True, compiled=True))
    else:
        model = ReferenceGPT(s["vocab"], T, **shape, flash=s["flash"])
    x, y = (torch.randint(0, 50257, (B, T), device=device) for _ in range(2))

    def loss(forward) -> torch.Tensor:
        if rung == "hf":
            return forward(input_ids=x, labels=x).loss
        return forward(x, x, return_logits=rung == "model_ce")[1] if rung in DIAGNOSTIC else forward(x, y)

    adamw = dict(lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    dtype = "bfloat16" if s["bf16"] else "float32"
    return recipe_step(model.to(device), loss, device, dtype, s["compile"], s["fused"], **adamw), model


def _profile(step, device: torch.device, steps: int, prefix: str) -> None:
    """torch.profiler over ``steps`` steps: the operators' table (``prefix``_profile.txt, and stderr) and
    the Chrome trace (``prefix``_trace.json)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]) as p:
        for _ in range(steps):
            step()
    table = p.key_averages().table(sort_by=f"{'cuda' if device.type == 'cuda' else 'cpu'}_time_total", row_limit=30)
    print(table, file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with atomic_write(f"{prefix}_profile.txt") as fh:
        fh.write(table)
    p.export_chrome_trace(tmp := tmp_name(f"{prefix}_trace.json"))
    os.replace(tmp, f"{prefix}_trace.json")


def run(args: argparse.Namespace) -> dict:
    from gpt2lab.system.hardware import peak_flops

    device = pick_device(args.device)
    cuda = device.type == "cuda"
    shape, B, T = SHAPES[args.size], args.batch_size, args.seq_len
    wanted = [r.strip() for r in args.rungs.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in RUNGS + EXTRA + DIAGNOSTIC]
    if unknown:
        raise UsageError(f"--rungs: unknown {', '.join(unknown)}; choose from {', '.join(RUNGS + EXTRA + DIAGNOSTIC)}")
    if "gpt2lab" in wanted and not args.data:
        raise UsageError("--rungs gpt2lab needs --data DIR (token shards from gpt2lab prepare)")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = args.peak_flops or peak_flops(name)
    measured = measure_matmul(device, 8192 if cuda else 512).bf16_gflops / 1000  # MFU's ceiling
    out = {
        "device": name,
        "torch": torch.__version__,
        "size": args.size,
        "B": B,
        "T": T,
        "bf16_matmul_tflops_measured": round(measured, 3),
        "peak_flops_datasheet": peak,
        "mfu_formula": "6N + 12*n_layer*n_embd*T per token (PaLM), N without wpe",
        "rungs": [],
    }
    for rung in wanted:
        s = settings(rung)
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = s["tf32"]
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        step = model = None
        try:
            step, model = _build(rung, shape, B, T, device, args.data)
            for _ in range(args.warmup):  # compilation happens here
                step()
            times, last = rounds({"step": step}, args.steps, device)  # median ms a step, the last loss
            ms, loss = 1000 * statistics.median(times["step"]), float(last.get("step", "nan"))
            if args.profile:
                _profile(step, device, args.steps, os.path.join(args.profile, rung))
        except torch.OutOfMemoryError:  # e.g. the fp32 rungs' materialised attention at B=64: say so, go on
            ms = None
        rec = {"rung": rung, **s}
        if ms is None:  # outside the except: its traceback no longer holds the rung's tensors
            rec["oom"] = True
        else:
            n = sum(p.numel() for p in model.parameters()) - T * shape["n_embd"]  # without wpe, tied counted once
            fpt = 6 * n + 12 * shape["n_layer"] * shape["n_embd"] * T
            tok_s = B * T / (ms / 1000)
            rec.update(
                ms_per_step=round(ms, 2),
                tok_per_s=round(tok_s),
                loss=round(loss, 4),
                flops_per_token=fpt,
                mfu_datasheet=round(fpt * tok_s / peak, 4) if peak else None,
                mfu_measured_matmul=round(fpt * tok_s / (measured * 1e12), 4),
                peak_mem_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
            )
        print(json.dumps(rec), flush=True)
        out["rungs"].append(rec)
        del step, model  # free this rung's model, optimizer and compiled graphs before the next
        torch._dynamo.reset()
        gc.collect()  # the next rung's start empties CUDA's cache
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    return out

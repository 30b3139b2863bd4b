"""gpt2lab bench train: time full training steps (data, forward, backward, clip, AdamW).

``--preset P`` plus any train flag gives exactly the step ``gpt2lab train`` would run; each
``--recipe PRESET[:field=value,...]`` is one more run timed beside it, in turn, round by round (the
same flags, then its own fields: ``--recipe chat-cpu:data=data/chitchat`` times the same run on
other data), each reported with its ratio to the preset's.
``--reference`` also times the reference recipe's model, written here plainly in PyTorch
(nanoGPT-style: one ``F.cross_entropy`` over materialised logits, bf16 autocast and
torch.compile as the recipe uses them, AdamW fused only on CUDA as the recipe does), on the
same batches, alternating with gpt2lab's step for several rounds; it reports the median
of each side and their ratio. Each side runs in a process of its own, so that neither
inherits the other's CPU allocator setting or heap.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import multiprocessing as mp
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn as nn
from torch.nn import functional as F

from gpt2lab.benchmarks import timed
from gpt2lab.distributed.dist import DistInfo, autocast, pick_device
from gpt2lab.train.config import merge_config
from gpt2lab.train.optim import AdamW, param_groups
from gpt2lab.train.settings import add_config_flags, load_preset, overrides_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, help="a training preset (any train flag overrides it)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=8, help="rounds (alternating with the reference when asked)")
    p.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="PRESET[:field=value,...]",
        help="another run timed beside (repeatable): a preset, the flags, its fields, e.g. wiki-cpu-fast:seq_len=128",
    )
    p.add_argument("--reference", action="store_true", help="also time the reference recipe's model")
    p.add_argument("--reference-compile", default="true", choices=["true", "false"], help="torch.compile it")
    p.add_argument("--reference-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reference-keep-memory", default="false", choices=["true", "false"], help="its --keep-cpu-memory")
    add_config_flags(p)


def run(args: argparse.Namespace) -> dict:
    flags = overrides_from_args(args)
    cfg = load_preset(args.preset, **flags)
    recipes = {text: _recipe(text, flags) for text in args.recipe}
    device = pick_device(None if cfg.system.device == "auto" else cfg.system.device)
    names = ["gpt2lab", *recipes] + (["reference"] if args.reference else [])
    # Each side runs in a process of its own: the CPU allocator setting (mallopt) and the
    # heap it leaves behind are per process, and one side's setting must not tax the other.
    opts = {k: getattr(args, k) for k in ("warmup", "reference_compile", "reference_dtype", "reference_keep_memory")}
    # the runs' directories (nothing is written there); the sides' processes end before they go
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        sides = {n: stack.enter_context(ProcessPoolExecutor(1, mp.get_context("spawn"))) for n in names}
        started = [
            pool.submit(_start, name, recipes.get(name, cfg).with_values(out=f"{tmp}/{i}"), str(device), opts)
            for i, (name, pool) in enumerate(sides.items())
        ]
        info = dict(zip(names, (f.result() for f in started)))  # built and warmed up, all at once
        rounds: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):  # in turn, so that every side sees the same machine load
            for name, pool in sides.items():
                rounds[name].append(pool.submit(_time, args.steps).result())
    med = {name: statistics.median(times) for name, times in rounds.items()}  # each side's ms a step
    kept = {name: [round(m, 1) for m in times] for name, times in rounds.items()}
    ms, ours = med["gpt2lab"], info["gpt2lab"]
    tok_per_s = cfg.batch.total_batch_tokens / (ms / 1000)
    result = {
        "preset": args.preset,
        **{k: getattr(cfg.model, k) for k in ("n_layer", "n_embd", "vocab_size")},
        **{k: getattr(cfg.batch, k) for k in ("seq_len", "micro_batch_size", "total_batch_tokens")},
        "dtype_asked": cfg.system.dtype,
        "compile_asked": cfg.system.compile,
        **{k: ours[k] for k in ("dtype", "compile", "choices")},
        "device": str(device),
        "threads": ours["threads"],
        "keep_cpu_memory": cfg.system.keep_cpu_memory,
        "ms_per_step": round(ms, 2),
        "tok_per_s": round(tok_per_s, 1),
        "mfu": ours["flops_per_token"] * tok_per_s / ours["peak"] if ours["peak"] else None,
        "flops_per_token": ours["flops_per_token"],
        "rounds_ms": kept["gpt2lab"],
    }
    if args.reference:
        ref, ref_ms = rounds["reference"], med["reference"]
        ratios = [r / o for o, r in zip(rounds["gpt2lab"], ref)]  # per round: same machine load
        result.update(
            reference_keep_cpu_memory=args.reference_keep_memory == "true",
            reference_compile=args.reference_compile == "true",
            reference_dtype=args.reference_dtype,
            reference_ms_per_step=round(ref_ms, 2),
            reference_tok_per_s=round(cfg.batch.total_batch_tokens / (ref_ms / 1000), 1),
            reference_rounds_ms=kept["reference"],
            speedup=round(ref_ms / ms, 3),
            speedup_median_of_rounds=round(statistics.median(ratios), 3),
            speedup_best_vs_best=round(min(ref) / min(rounds["gpt2lab"]), 3),
        )
    if recipes:
        result["recipes"] = [
            {"recipe": n, "ms_per_step": round(med[n], 2), "vs_preset": round(med[n] / ms, 3), "rounds_ms": kept[n]}
            for n in recipes
        ]
    return result


def _recipe(text: str, flags: dict):
    """The run of 'preset:field=value,...': the preset, the train flags given, then its fields over them;
    values as Python literals where they parse as one (1, 0.5, True), else strings."""
    preset, _, rest = text.partition(":")
    changes = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            changes[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            changes[key] = value
    return load_preset(preset, **merge_config(flags, changes))


_SIDE: dict = {}  # in a side's process: its name, device and step


def _start(name: str, cfg, device: str, opts: dict) -> dict:
    """One side, in a process of its own: built and warmed up; its facts."""
    from gpt2lab.data import TokenLoader
    from gpt2lab.train.trainer import Trainer, keep_freed_memory

    device = torch.device(device)
    keep = cfg.system.keep_cpu_memory if name != "reference" else opts["reference_keep_memory"] == "true"
    if device.type == "cpu":
        keep_freed_memory(keep)
    info = {"threads": torch.get_num_threads(), "flops_per_token": None, "peak": None}
    if name != "reference":  # exactly the step `gpt2lab train` runs
        trainer = Trainer.from_config(cfg, DistInfo(device=device))
        info.update({k: getattr(trainer, k) for k in ("flops_per_token", "peak", "dtype", "compile")})
        info["choices"] = trainer.choices.summary()
        fn = loss_of_step(trainer)
    else:  # the same batches (same loader, same seed)
        if device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32, as the recipe sets it
        torch.manual_seed(cfg.seed)
        loader = TokenLoader(cfg.data, "train", cfg.batch.micro_batch_size, cfg.batch.seq_len, seed=cfg.seed)
        compiled = opts["reference_compile"] == "true"
        fn = reference_step(cfg, device, loader.next_batch, compiled, opts["reference_dtype"])
    for _ in range(opts["warmup"]):
        fn()
    _SIDE.update(name=name, device=device, step=fn)
    return info


def _time(steps: int) -> float:
    """ms a step of this process's side, over ``steps`` steps."""
    seconds, losses = timed(lambda: [_SIDE["step"]() for _ in range(steps)], _SIDE["device"])
    if not math.isfinite(float(losses[-1])):
        raise RuntimeError(f"{_SIDE['name']}: non-finite loss {losses[-1]} while benchmarking")
    return 1000 * seconds / steps


# -- the reference recipe's model, written plainly ---------------------------------------
class _Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, flash: bool = True) -> None:
        super().__init__()
        self.n_head, self.flash = n_head, flash
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # written out, as the recipe had it before flash attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, flash: bool = True) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = _Attention(n_embd, n_head, flash)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ReferenceGPT(nn.Module):
    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, n_embd: int, flash: bool = True) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.h = nn.ModuleList([_Block(n_embd, n_head, flash) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def recipe_step(model, loss_of, device: torch.device, dtype: str, compile: bool, fused: bool, accum: int = 1, **adamw):
    """The recipe's step of ``model``: ``accum`` micro-steps of ``loss_of(forward)`` (``forward``: the model,
    torch.compile'd if ``compile``) under autocast in ``dtype`` (float32: none), backward, clip 1.0, the step
    of AdamW (``adamw``'s values; fused if ``fused``, else torch's default, foreach); the step returns its loss."""
    opt = AdamW(param_groups(model, adamw.pop("weight_decay")), **adamw, fused=fused or None)
    forward = torch.compile(model) if compile else model

    def step() -> torch.Tensor:
        total = 0.0
        for _ in range(accum):
            with autocast(device, dtype):
                loss = loss_of(forward) / accum
            total += loss.detach()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def reference_step(cfg, device: torch.device, next_batch, compile: bool, dtype: str = "float32"):
    """The recipe's model and step on ``next_batch``'s batches: AdamW (fused on CUDA only) at max_lr."""
    m, o = cfg.model, cfg.optim
    model = ReferenceGPT(m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd).to(device)
    adamw = dict(lr=o.max_lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps)

    def loss(forward) -> torch.Tensor:
        x, y = next_batch()
        return forward(x.to(device), y.to(device))

    return recipe_step(model, loss, device, dtype, compile, device.type == "cuda", cfg.grad_accum_steps(1), **adamw)


def loss_of_step(trainer):
    """A function that runs ``trainer``'s next step as ``gpt2lab train`` does and returns the last loss read
    back by it (0.0 while a GPU's values wait on the device: they are read back every few steps)."""

    def step() -> float:
        done = trainer.train_step()
        return done[-1].record.get("train_loss", float("nan")) if done else 0.0

    return step

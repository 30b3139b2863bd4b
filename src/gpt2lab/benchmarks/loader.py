"""gpt2lab bench loader: TokenLoader batches/s (default B=16, T=1024), train and val.

Without --data it writes synthetic shards (random tokens, FineWeb-like documents of
~1,000 tokens) to a temporary directory. The time includes opening each shard and, for
the shuffled train split, finding and permuting its documents. --step-model also times
one CPU forward+backward of GPT-2 124M at (1, T) and scales it by B, to compare.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from gpt2lab.benchmarks import timed
from gpt2lab.data import TokenLoader
from gpt2lab.data.shards import shard_name, write_shard
from gpt2lab.data.tokenizer import EOT_ID


def add_arguments(parser) -> None:
    parser.add_argument("--data", help="shard directory (default: synthetic shards)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=1000, help="batches timed per split")
    parser.add_argument("--shard-tokens", type=int, default=10_000_000, help="synthetic shard size")
    parser.add_argument("--step-model", action="store_true", help="also time a CPU GPT-2 124M step, for the ratio")


def synthetic_shards(root: str, tokens: int, train_shards: int = 1, val_tokens: int = 4096) -> None:
    """Random tokens in documents of ~1,000 (FineWeb-like) in ``root``: ``train_shards`` train shards of
    ``tokens`` (seed 0), one val shard of ``val_tokens`` (seed 1)."""
    for split, n_shards, size, seed in (("train", train_shards, tokens, 0), ("val", 1, val_tokens, 1)):
        rng = np.random.default_rng(seed)
        for k in range(n_shards):
            toks = rng.integers(0, EOT_ID, size, dtype=np.int64).astype(np.uint16)
            starts = np.cumsum(rng.geometric(1 / 1000, size // 500))
            toks[starts[starts < size]] = EOT_ID
            toks[0] = EOT_ID
            write_shard(f"{root}/{shard_name(split, k)}", toks)


def _rate(loader: TokenLoader, batches: int) -> dict:
    first, _ = timed(loader.next_batch)  # first batch: opens a shard (and indexes its documents)
    dt, _ = timed(lambda: [loader.next_batch() for _ in range(batches)])
    return {
        "batches_per_s": round(batches / dt, 1),
        "first_batch_ms": round(first * 1e3, 1),
        "tokens_per_s": round(batches * loader.B * loader.T / dt),
    }


def run(args) -> dict:
    B, T = args.batch_size, args.seq_len
    out: dict = {"batch_size": B, "seq_len": T, "load_avg_1m_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as tmp:
        data = tmp if args.data is None else args.data
        if args.data is None:
            synthetic_shards(tmp, args.shard_tokens, train_shards=2, val_tokens=args.shard_tokens)
            out["data"] = f"synthetic: train 2 x {args.shard_tokens} tokens, val 1 shard"
        for split in ("train", "val"):
            out[split] = _rate(TokenLoader(data, split, B, T), args.batches)
    if args.step_model:  # one CPU forward+backward at (1, T), scaled by B (it scales ~linearly in B)
        import torch

        from gpt2lab.model.gpt import GPT, GPTConfig

        model, x = GPT(GPTConfig()), torch.randint(0, 50257, (1, T))
        step = B * timed(lambda: model(x, x)[1].backward())[0]
        out["cpu_train_step_s_estimate"] = round(step, 2)
        out["loader_vs_step"] = round(min(out[s]["batches_per_s"] for s in ("train", "val")) * step)
    return out

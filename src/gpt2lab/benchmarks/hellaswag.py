"""gpt2lab bench hellaswag: examples/s, batched scoring vs one example per forward.

"One example per forward" is the reference recipe's method: the four rows of one
example padded to their longest, the full logits turned into per-token losses, then
the ending tokens summed. Both methods score the same examples with the same random
124M weights, and the benchmark checks that they pick the same endings.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F

from gpt2lab.evals.hellaswag import load_examples, render_example, score_examples
from gpt2lab.model import GPT, GPTConfig
from gpt2lab.tokenizer import asset_path, get_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None,
                   help="HellaSwag jsonl (default: the test slice shipped in the repo, tests/data/)")
    p.add_argument("--size", default="124M", help="GPT-2 size of the random model (124M, 350M, ...)")
    p.add_argument("--limit", type=int, default=64, help="examples scored by each method")
    p.add_argument("--batch-size", type=int, default=16, help="examples per forward in the batched method")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _default_data() -> str:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "..", "tests", "data", "hellaswag_val_200.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"no default HellaSwag slice at {os.path.normpath(path)}; pass --data FILE")
    return path


@torch.no_grad()
def reference_predictions(model: GPT, examples, device: torch.device) -> list[int]:
    """acc_norm predictions the reference way: one example (4 rows) per forward."""
    enc, preds = get_tokenizer(), []
    for ex in examples:
        ctx, ends = render_example(enc, ex)
        T = max(len(ctx) + len(e) for e in ends)
        tokens = torch.zeros(4, T, dtype=torch.long)
        mask = torch.zeros(4, T, dtype=torch.long)
        for i, e in enumerate(ends):
            tokens[i, :len(ctx) + len(e)] = torch.tensor(ctx + e)
            mask[i, len(ctx):len(ctx) + len(e)] = 1
        tokens, mask = tokens.to(device), mask.to(device)
        logits, _ = model(tokens)
        losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                 tokens[:, 1:].reshape(-1), reduction="none").view(4, -1)
        m = mask[:, 1:]
        preds.append(int(((losses * m).sum(1) / m.sum(1)).argmin()))
    return preds


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.size)).to(device).eval()
    examples = load_examples(args.data or _default_data(), args.limit)
    methods = {
        "reference": lambda exs: reference_predictions(model, exs, device),
        "shared": lambda exs: [s.pred_norm for s in score_examples(
            model, exs, device=device, batch_size=args.batch_size, strategy="shared")],
        "padded": lambda exs: [s.pred_norm for s in score_examples(
            model, exs, device=device, batch_size=args.batch_size, strategy="padded")],
    }
    for fn in methods.values():  # warm-up: one-time allocations and thread pools
        fn(examples[:2])
    # The methods take turns chunk by chunk, so load from other processes on a shared
    # machine falls on all of them alike.
    seconds, preds = dict.fromkeys(methods, 0.0), {k: [] for k in methods}
    chunk = 4 * args.batch_size
    for start in range(0, len(examples), chunk):
        for name, fn in methods.items():
            dt, out = _timed(lambda: fn(examples[start:start + chunk]))
            seconds[name] += dt
            preds[name] += out
    n = len(examples)
    result = {"bench": "hellaswag", "size": args.size, "device": str(device), "threads": torch.get_num_threads(),
              "examples": n, "batch_size": args.batch_size}
    for name in methods:
        result[f"{name}_examples_per_s"] = round(n / seconds[name], 2)
    for name in ("shared", "padded"):
        result[f"{name}_speedup"] = round(seconds["reference"] / seconds[name], 2)
        result[f"{name}_same_predictions"] = f"{sum(a == b for a, b in zip(preds[name], preds['reference']))}/{n}"
    return result

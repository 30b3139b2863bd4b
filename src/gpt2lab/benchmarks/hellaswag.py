"""gpt2lab bench hellaswag: examples/s, batched scoring vs one example per forward.

"One example per forward" is the reference recipe's method: the four rows of one
example padded to their longest, the full logits (fp32 unless ``--dtype``) turned into
per-token losses, then the ending tokens' losses summed and averaged. Every method scores the same
examples with the same random weights; the benchmark checks that they pick the same
endings (both acc and acc_norm predictions) and counts each method's matmul FLOPs, so
its speed can be read as a share of the machine's FLOP rate. Methods take turns over
the whole set, ``--repeats`` times, and the best time of each is kept, so load from
other processes falls on all of them alike.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from gpt2lab.benchmarks import rounds
from gpt2lab.data.tokenizer import for_model
from gpt2lab.distributed.dist import autocast
from gpt2lab.evals.hellaswag import DEFAULT_BATCH_SIZE, load_examples, render_example, resolve_strategy, score_examples
from gpt2lab.inference.choice import InferenceRequest, rule
from gpt2lab.inference.form import detect_facts
from gpt2lab.model.gpt import GPT, GPTConfig
from gpt2lab.system.choices import DTYPES, positive_int
from gpt2lab.system.errors import UsageError

SLICE = Path(__file__).resolve().parents[3] / "tests" / "data" / "hellaswag_val_200.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=str(SLICE), help="HellaSwag jsonl (default: the repo's test slice, tests/data/)")
    p.add_argument("--size", default="124M", help="GPT-2 size of the random model (124M, 350M, ...)")
    p.add_argument("--limit", type=positive_int, default=128, help="examples scored by each method")
    p.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, help="examples per batched call")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each method over the whole set")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["auto", *sorted(DTYPES)], help="autocast dtype of all")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


@torch.no_grad()
def reference_predictions(model: GPT, examples, device: torch.device, dtype: str = "float32") -> list[tuple[int, int]]:
    """(acc, acc_norm) predictions the reference way: one example (4 rows) per forward."""
    enc, preds = for_model(model), []
    for ex in examples:
        ctx, ends = render_example(enc, ex)
        T = max(len(ctx) + len(e) for e in ends)
        tokens, mask = (torch.zeros(4, T, dtype=torch.long, device=device) for _ in range(2))
        for i, e in enumerate(ends):
            tokens[i, : len(ctx) + len(e)] = torch.tensor(ctx + e)
            mask[i, len(ctx) : len(ctx) + len(e)] = 1
        with autocast(device, dtype):
            logits, _ = model(tokens)  # (4, T, V): every position, as the reference computes it
        losses = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1), reduction="none"
        ).view(4, -1)
        m = mask[:, 1:]
        sums = (losses * m).sum(1)
        preds.append((int(sums.argmin()), int((sums / m.sum(1)).argmin())))
    return preds


class MatmulFlops:
    """Counts a GPT's matmul FLOPs (2 per multiply-add) with forward hooks: every token fed
    through the blocks (padding included) and every row through lm_head. Attention's
    QK^T and AV are left out: at HellaSwag lengths they add about 2%."""

    def __init__(self, model: GPT) -> None:
        blocks, self.flops = model.transformer.h, 0
        per_token = 2 * sum(m.weight.numel() for m in blocks.modules() if isinstance(m, torch.nn.Linear))
        for module, per in ((blocks[0], per_token), (model.lm_head, 2 * model.lm_head.weight.numel())):
            module.register_forward_hook(functools.partial(self._count, per))

    def _count(self, per: int, module, inputs, output) -> None:
        self.flops += per * (inputs[0].numel() // inputs[0].shape[-1])  # the tokens (rows) of its input


def run(args: argparse.Namespace) -> dict:
    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    device = torch.device(args.device)
    decision = rule(InferenceRequest(dtype=args.dtype, workload="score"), detect_facts(device))
    print(f"bench hellaswag: {decision.summary()}", file=sys.stderr, flush=True)
    args.dtype = decision.candidate.dtype
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.size)).to(device).eval()
    examples = load_examples(args.data, args.limit)

    def batched(strategy):
        how = dict(device=device, dtype=args.dtype, strategy=strategy, batch_size=args.batch_size)
        return lambda exs: [(s.pred, s.pred_norm) for s in score_examples(model, exs, **how)]

    methods = {"reference": lambda exs: reference_predictions(model, exs, device, args.dtype)}
    methods.update({strategy: batched(strategy) for strategy in ("padded", "shared")})
    for fn in methods.values():  # warm-up: one-time allocations and thread pools
        fn(examples[:2])
    counter = MatmulFlops(model)

    def counted(fn):  # (predictions, matmul FLOPs) of one whole run
        def run():
            counter.flops = 0
            return fn(examples), counter.flops

        return run

    load_before = os.getloadavg()
    times, last = rounds({name: counted(fn) for name, fn in methods.items()}, args.repeats, device)
    times = {k: [round(t, 2) for t in v] for k, v in times.items()}
    preds, flops = ({name: got[i] for name, got in last.items()} for i in (0, 1))
    n = len(examples)
    loadavg = {"before": load_before, "after": os.getloadavg()}
    result = {
        "bench": "hellaswag",
        **{k: getattr(args, k) for k in ("size", "dtype", "batch_size", "repeats")},
        "device": str(device),
        "threads": torch.get_num_threads(),
        "examples": n,
        "default_strategy": resolve_strategy("auto", model, device),
        "loadavg_1_5_15": {k: [round(x, 2) for x in v] for k, v in loadavg.items()},
    }
    for name in methods:
        best = min(times[name])
        result[name] = {
            "examples_per_s": round(n / best, 2),
            "seconds": times[name],
            "gflop_per_example": round(flops[name] / n / 1e9, 1),
            "gflop_per_s": round(flops[name] / best / 1e9, 1),
        }
        if name != "reference":
            result[name]["speedup"] = round(min(times["reference"]) / best, 2)
            same = sum(a == b for a, b in zip(preds[name], preds["reference"]))
            result[name]["same_predictions"] = f"{same}/{n}"
    return result

"""gpt2lab bench NAME: benchmarks that print one JSON line (speed targets live here, not in tests).

Each benchmark is a module ``gpt2lab.benchmarks.<name>`` with ``add_arguments(parser)``
and ``run(args) -> dict``; the dict is printed as JSON.
"""

from __future__ import annotations

import importlib
import json

BENCHES = {
    "sample": "tokens/s generating with and without the KV cache, vs transformers",
    "prepare": "tokenization throughput of `prepare` vs a single-process tiktoken loop",
    "loader": "TokenLoader batches/s",
    "train": "full training steps: ms/step, tok/s, MFU",
    "hellaswag": "HellaSwag examples/s, batched vs one example per forward",
    "ladder": "the recipe's speed ladder (fp32 ... fused AdamW), then gpt2lab's and transformers' steps",
    "memory": "predicted vs measured per-rank memory; --plan GPU_GB; the largest micro-batch that trains",
    "serve": "gpt2lab serve tokens/s: one stream, and the aggregate of N concurrent streams",
    "lora": "AdamW state, weights and gradients: full fine-tuning vs LoRA (meta device or CPU)",
    "precision": "quality of bf16 and int8 inference against fp32: val loss, top-1 and greedy agreement, HellaSwag",
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (print JSON)")
    bsub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, help_text in BENCHES.items():
        bp = bsub.add_parser(name, help=help_text)
        mod = importlib.import_module(f"gpt2lab.benchmarks.{name}")
        mod.add_arguments(bp)
        bp.set_defaults(func=_runner(mod))


def _runner(mod):
    def run(args) -> int:
        result = mod.run(args)
        if result is not None:  # None: a torchrun rank other than 0, whose result rank 0 prints
            print(json.dumps(result), flush=True)
        return 0

    return run

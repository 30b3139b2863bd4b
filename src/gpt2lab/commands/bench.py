"""gpt2lab bench NAME: benchmarks that print one JSON line (speed targets live here, not in tests).

Each benchmark is a module ``gpt2lab.benchmarks.<name>`` (its docstring's first paragraph is its help)
with ``add_arguments(parser)`` and ``run(args) -> dict``; the dict is printed as JSON. A benchmark's
``--threads`` is set here.
"""

from __future__ import annotations

import functools
import importlib
import json

BENCHES = ("sample", "prepare", "loader", "train", "hellaswag", "ladder", "memory", "serve", "lora", "precision")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (print JSON)")
    bsub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name in BENCHES:
        mod = importlib.import_module(f"gpt2lab.benchmarks.{name}")
        summary = mod.__doc__.split("\n\n")[0].split(": ", 1)[1]  # its docstring's first paragraph
        bp = bsub.add_parser(name, help=" ".join(summary.split()))
        mod.add_arguments(bp)
        bp.set_defaults(func=functools.partial(_run, mod))


def _run(mod, args) -> int:
    if getattr(args, "threads", None):  # the benchmarks that take --threads: torch's CPU threads
        import torch

        torch.set_num_threads(args.threads)
    result = mod.run(args)
    if result is not None:  # None: a torchrun rank other than 0, whose result rank 0 prints
        print(json.dumps(result), flush=True)
    return 0

"""Step times of several runs, interleaved so that every run sees the same machine load:

    PYTHONPATH=src python benchmarks/recipe_step_times.py --data data/wiki [--rounds 2]
        [--recipe PRESET[:field=value,...] ...]

One ``Trainer`` per recipe (default: wiki-cpu; wiki-cpu-fast with the logit softcap at 15 and
off; off with a tied head; ``--recipe`` names others, e.g. ``--recipe wiki-cpu-long --recipe
wiki-cpu-long-fast:value_embeds=1``, or the same preset on two data directories: ``--data
data/tinyshakespeare --recipe chat-cpu --recipe chat-cpu:data=data/chitchat`` times a step on
conversations, the loader's mask and the micro-batches' weights, against one on text), one
warm-up step each, then ``--rounds`` rounds of one step per recipe in turn. Prints each recipe's
median ``dt_ms``, every round's, and its ratio to the first recipe's. Run directories go to a
temporary folder this script makes and removes.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import tempfile

import torch

from gpt2lab.distributed.dist import DistInfo
from gpt2lab.train.settings import load_preset
from gpt2lab.train.trainer import Trainer

RECIPES = {
    "wiki-cpu": ("wiki-cpu", {}),
    "wiki-cpu-fast, softcap 15": ("wiki-cpu-fast", {"logit_softcap": 15.0}),
    "wiki-cpu-fast (softcap off)": ("wiki-cpu-fast", {}),
    "wiki-cpu-fast, tied head": ("wiki-cpu-fast", {"tie_embeddings": True}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="token shards made by gpt2lab prepare")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--recipe",
        action="append",
        default=None,
        metavar="PRESET[:field=value,...]",
        help="a recipe to time instead of the default four (repeat for more)",
    )
    args = p.parse_args()
    recipes = dict(_parse(r) for r in args.recipe) if args.recipe else RECIPES
    off = dict(progress=False, eval_interval=0, sample_interval=0, init_from=None)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: Trainer.from_config(
                load_preset(preset, **{"data": args.data, "out": f"{tmp}/{i}", **off, **changes}),
                DistInfo(device=torch.device("cpu")),
            )
            for i, (name, (preset, changes)) in enumerate(recipes.items())
        }
        for t in trainers.values():  # a warm-up step each, then one step of each in turn
            t.train_step()
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for _ in range(args.rounds):
            for name, t in trainers.items():
                times[name].append(t.train_step()[0].record["dt_ms"])
    first = statistics.median(next(iter(times.values())))
    for name, ms in times.items():
        med = statistics.median(ms)
        rounds = ", ".join(f"{m:.0f}" for m in ms)
        print(f"{name}: median {med:.0f} ms per step, {med / first:.3f}x the first ({rounds})")


def _parse(text: str) -> tuple[str, tuple[str, dict]]:
    """'preset:field=value,...' -> (text, (preset, {field: value})); values as Python literals
    where they parse as one (1, 0.5, True), else strings."""
    preset, _, rest = text.partition(":")
    changes = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            changes[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            changes[key] = value
    return text, (preset, changes)


if __name__ == "__main__":
    main()

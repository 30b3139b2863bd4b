"""A training step on conversations (the masked loss) against one on plain text of the same size:

    PYTHONPATH=src python benchmarks/chat_step_cost.py --text data/tinyshakespeare --chat data/chitchat \
        [--preset chat-cpu] [--rounds 40] [--field value ...]

Two ``Trainer``s of one preset, the same model and batch shape, one on each data directory; a warm-up
step each, then ``--rounds`` rounds of one step of each in turn, so both see the same machine load.
What the conversations add is the loader's mask (targets -1 where the assistant did not write) and
the step's weights (each micro-batch's share of the supervised targets, summed over ranks); the
model's work is the same. Prints the median ``dt_ms`` of each and their ratio. Run directories go
to a temporary folder this script makes and removes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from gpt2lab.benchmarks.train import interleaved_step_ms
from gpt2lab.distributed.dist import DistInfo
from gpt2lab.train.settings import load_preset
from gpt2lab.train.trainer import Trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", required=True, help="token shards of text (gpt2lab prepare)")
    p.add_argument("--chat", required=True, help="token shards of conversations (gpt2lab prepare --format chat)")
    p.add_argument("--preset", default="chat-cpu")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument(
        "--set",
        nargs=2,
        action="append",
        default=[],
        metavar=("FIELD", "VALUE"),
        help="a preset field to change, as a Python literal (e.g. --set total_batch_tokens 3072)",
    )
    args = p.parse_args()
    import ast

    changes = {k: ast.literal_eval(v) for k, v in args.set}
    info = DistInfo(device=torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: Trainer.from_config(
                load_preset(
                    args.preset,
                    data=data,
                    out=f"{tmp}/{name}",
                    progress=False,
                    eval_interval=0,
                    sample_interval=0,
                    init_from=None,
                    **changes,
                ),
                info,
            )
            for name, data in (("text", args.text), ("chat", args.chat))
        }
        times = interleaved_step_ms(trainers, args.rounds)
    med = {name: statistics.median(ms) for name, ms in times.items()}
    cfg = trainers["chat"].cfg
    print(
        f"{args.preset} {changes or ''}: {cfg.batch.total_batch_tokens} tokens per step, micro-batch "
        f"{cfg.batch.micro_batch_size} x {cfg.batch.seq_len}, {trainers['chat'].accum} micro-steps, "
        f"dtype {trainers['chat'].dtype}, {args.rounds} rounds"
    )
    for name, ms in times.items():
        print(f"  {name}: median {med[name]:.1f} ms per step")
    print(f"  conversations / text: {med['chat'] / med['text']:.3f}")


if __name__ == "__main__":
    main()
